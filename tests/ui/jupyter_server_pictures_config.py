"""Server config for the pictures in docs/images (`./run pictures`): the demo's own configuration
(binder/jupyter_server_config.py: two simulated GPUs, the demo's caps) as a new user runs it, plus Galata's
test setup and the scenario's fake NVML and checkpoint driver (ui_scenario.py), so that the kernels in the
pictures have usage, history, a parked kernel and one that waits for device memory. A short poll interval,
so that a minute of pictures fills a chart's window (300 samples).
"""

import os
import sys

from jupyterlab.galata import configure_jupyter_server

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # ui_scenario.py, for nvml_class below

load_subconfig(os.path.join(HERE, "..", "..", "binder", "jupyter_server_config.py"))  # noqa: F821
configure_jupyter_server(c)  # noqa: F821 (c is the config object traitlets hands config files)

c.ServerApp.port = int(os.environ.get("GQ_UI_PORT", "8888"))  # noqa: F821
c.ServerApp.ip = "127.0.0.1"  # noqa: F821
c.ServerApp.jpserver_extensions.update({"gpu_quota_ext": True})  # noqa: F821
c.GpuQuota.nvml_class = "ui_scenario.ScenarioNvml"  # noqa: F821
c.GpuQuota.checkpoint_class = "gpu_quota_ext.parking.fake_checkpoint.FakeCheckpoint"  # noqa: F821
c.GpuQuota.poll_interval = 0.25  # noqa: F821
# The broker parks only kernels idle this long to make room: in the pictures' two minutes none is, so the
# waiting kernel waits (for memory that processes outside this server hold) instead of an idle one parking.
c.GpuQuota.park_min_idle = "10min"  # noqa: F821
