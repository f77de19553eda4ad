"""Module paths from before the package had one folder per concern stay importable, as the same module
objects, with a DeprecationWarning that names the new path; the documented config values and imports work."""

import importlib
import subprocess
import sys
import warnings

import pytest
from traitlets.utils.importstring import import_item

from gpu_quota_ext.shared.moved import MOVED

# What the docs, the admins' configs and the hub recipes of earlier releases name.
DOCUMENTED = {
    "gpu_quota_ext.devices.StaticInventory": "gpu_quota_ext.devices.inventory.StaticInventory",
    "gpu_quota_ext.devices.NvmlInventory": "gpu_quota_ext.devices.inventory.NvmlInventory",
    "gpu_quota_ext.devices.HamiInventory": "gpu_quota_ext.devices.inventory.HamiInventory",
    "gpu_quota_ext.fake_nvml.FakeNvml": "gpu_quota_ext.devices.fake_nvml.FakeNvml",
    "gpu_quota_ext.nvml.PynvmlBackend": "gpu_quota_ext.devices.nvml.PynvmlBackend",
    "gpu_quota_ext.checkpoint.CudaCheckpointDriver": "gpu_quota_ext.parking.checkpoint.CudaCheckpointDriver",
    "gpu_quota_ext.fake_checkpoint.FakeCheckpoint": "gpu_quota_ext.parking.fake_checkpoint.FakeCheckpoint",
    "gpu_quota_ext.hub.configure_hub_caps": "gpu_quota_ext.hub.caps.configure_hub_caps",
    "gpu_quota_ext.kube.configure_kubespawner_gpu": "gpu_quota_ext.hub.kube.configure_kubespawner_gpu",
    "gpu_quota_ext.host_service.configure.configure_host_service":
        "gpu_quota_ext.hub.service.configure.configure_host_service",
    "gpu_quota_ext.host_service.spec.register_service": "gpu_quota_ext.hub.service.spec.register_service",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_module_path_is_the_new_module_with_a_warning(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


@pytest.mark.parametrize("written, meant", sorted(DOCUMENTED.items()))
def test_documented_names_are_the_same_objects(written, meant):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert import_item(written) is import_item(meant)


def test_a_name_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("gpu_quota_ext.no_such_module")


def test_python_dash_m_of_an_old_path_runs_the_new_module():
    # A hand-written c.JupyterHub.services entry of an earlier release: `python -m gpu_quota_ext.host_service.app`.
    done = subprocess.run(
        [sys.executable, "-m", "gpu_quota_ext.host_service.app", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "jupyter-gpu-quota-service" in done.stdout or "GpuQuotaService" in done.stdout
