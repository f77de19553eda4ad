"""Server side of benchmarks/sidebar_bench.py: a jupyter_server extension that fills gpu-quota-ext's
ledger with N grants (GQ_BENCH_KERNELS, default 200) for kernels that do not exist, as if N kernels ran.

Enabled by the config sidebar_bench.py writes (with benchmarks/ on PYTHONPATH); not part of the package.
"""

import os
import uuid

from tornado.ioloop import IOLoop

from gpu_quota_ext.manager import SETTINGS_KEY


def _jupyter_server_extension_points():
    return [{"module": "sidebar_bench_server"}]


def _load_jupyter_server_extension(serverapp):
    count = int(os.environ.get("GQ_BENCH_KERNELS", "200"))

    async def fill():
        manager = serverapp.web_app.settings[SETTINGS_KEY]
        for i in range(count):
            kernel_id = f"bench-{i:04d}-{uuid.uuid4()}"
            await manager.admit(kernel_id, "python3", ["python", "-m", "ipykernel_launcher"], {}, language="python")
        serverapp.log.info("sidebar_bench_server: %d grants in the ledger", count)

    # After every extension has loaded (gpu_quota_ext's manager must exist).
    IOLoop.current().add_callback(fill)
