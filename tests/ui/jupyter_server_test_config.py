"""Server config for the browser tests: Galata's test setup plus gpu-quota-ext with two static GPUs.

`run.sh` starts `jupyter lab --config tests/ui/jupyter_server_test_config.py`; GQ_UI_PORT picks the port.
"""

import os

from jupyterlab.galata import configure_jupyter_server

configure_jupyter_server(c)  # noqa: F821 (c is the config object traitlets hands config files)

c.ServerApp.port = int(os.environ.get("GQ_UI_PORT", "8888"))  # noqa: F821
c.ServerApp.ip = "127.0.0.1"  # noqa: F821
c.ServerApp.jpserver_extensions.update({"gpu_quota_ext": True})  # noqa: F821
c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"  # noqa: F821
c.StaticInventory.devices = [  # noqa: F821
    {"name": "Test GPU 0", "total": "80GiB"},
    {"name": "Test GPU 1", "total": "80GiB"},
]
