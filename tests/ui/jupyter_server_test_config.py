"""Server config for the browser tests: Galata's test setup plus gpu-quota-ext with two static GPUs, whose
usage, lost devices and parking the specs set through a scenario file (ui_scenario.py: the fake NVML and the
fake checkpoint driver; everything else is the real server).

`run.sh` starts `jupyter lab --config tests/ui/jupyter_server_test_config.py`; GQ_UI_PORT picks the port,
GQ_UI_SCENARIO the scenario file.
"""

import os
import sys

from jupyterlab.galata import configure_jupyter_server

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ui_scenario.py, for nvml_class below

configure_jupyter_server(c)  # noqa: F821 (c is the config object traitlets hands config files)

c.ServerApp.port = int(os.environ.get("GQ_UI_PORT", "8888"))  # noqa: F821
c.ServerApp.ip = "127.0.0.1"  # noqa: F821
c.ServerApp.jpserver_extensions.update({"gpu_quota_ext": True})  # noqa: F821
c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"  # noqa: F821
c.StaticInventory.devices = [  # noqa: F821
    {"name": "Test GPU 0", "total": "80GiB"},
    {"name": "Test GPU 1", "total": "80GiB"},
]
c.GpuQuota.nvml_class = "ui_scenario.ScenarioNvml"  # noqa: F821
c.GpuQuota.checkpoint_class = "gpu_quota_ext.parking.fake_checkpoint.FakeCheckpoint"  # noqa: F821
