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


# Every setting of the release before the move, with the environment variable it was read from (the settings
# table at the commit before "One folder per concern"): a config file or a spawner's environment that set one
# still sets it.
SETTINGS_BEFORE_THE_MOVE = {
    "default_cap": "GPU_QUOTA_DEFAULT_CAP", "max_cap": "GPU_QUOTA_MAX_CAP", "caps": None,
    "overcommit": "GPU_QUOTA_OVERCOMMIT", "placement": "GPU_QUOTA_PLACEMENT", "on_full": "GPU_QUOTA_ON_FULL",
    "on_over_max": "GPU_QUOTA_ON_OVER_MAX", "enforce": "GPU_QUOTA_ENFORCE", "slack": "GPU_QUOTA_SLACK",
    "grace": "GPU_QUOTA_GRACE", "poll_interval": "GPU_QUOTA_POLL_INTERVAL", "hard_cap": "GPU_QUOTA_HARD_CAP",
    "mps_daemon": "GPU_QUOTA_MPS_DAEMON", "hard_limit": "GPU_QUOTA_HARD_LIMIT",
    "mps_context_allowance": "GPU_QUOTA_MPS_CONTEXT_ALLOWANCE", "mps_control": "GPU_QUOTA_MPS_CONTROL",
    "mps_timeout": "GPU_QUOTA_MPS_TIMEOUT", "park_idle_after": "GPU_QUOTA_PARK_IDLE_AFTER",
    "park_host_margin": "GPU_QUOTA_PARK_HOST_MARGIN", "inventory_class": None, "nvml_class": None,
    "checkpoint_class": None,
}

# What the README and the docs of that release wrote in jupyter_server_config.py, as written there.
DOCUMENTED_CONFIG = {
    "GpuQuota": {
        "default_cap": "0.25",
        "max_cap": "0.5",
        "on_over_max": "refuse",
        "hard_cap": "auto",
        "park_idle_after": "30min",
        "slack": 2**30,
        "inventory_class": "gpu_quota_ext.devices.StaticInventory",
        "nvml_class": "gpu_quota_ext.fake_nvml.FakeNvml",
        "checkpoint_class": "gpu_quota_ext.fake_checkpoint.FakeCheckpoint",
    },
    "StaticInventory": {"devices": [{"name": "Demo GPU", "total": "80GiB"}]},
    "HamiInventory": {"physical_class": "gpu_quota_ext.devices.StaticInventory"},
    "NvmlInventory": {"pod_share": False},
}


def test_every_setting_of_the_release_before_the_move_is_still_read_from_its_variable():
    from gpu_quota_ext.app import GpuQuota
    from gpu_quota_ext.settings import SETTINGS

    for name, variable in SETTINGS_BEFORE_THE_MOVE.items():
        assert name in SETTINGS and SETTINGS[name].env == variable, name
        assert GpuQuota.class_traits(config=True).get(name) is not None, name


def test_the_documented_config_values_configure_the_extension_as_before(monkeypatch):
    from traitlets.config import Config

    from gpu_quota_ext.app import GpuQuota
    from gpu_quota_ext.devices import HamiInventory, NvmlInventory, StaticInventory
    from gpu_quota_ext.devices.fake_nvml import FakeNvml
    from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
    from gpu_quota_ext.settings import SETTINGS

    for row in SETTINGS.values():
        if row.env:
            monkeypatch.delenv(row.env, raising=False)
    config = Config(DOCUMENTED_CONFIG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the old class paths warn, and work
        extension = GpuQuota(config=config)
        policy, enforcement, hard = extension.validated_settings()
    assert (str(policy.default_cap), str(policy.max_cap), policy.on_over_max) == ("0.25", "0.5", "refuse")
    assert enforcement.slack.nbytes == 2**30 and hard.mode == "auto"
    assert extension.park_idle_after == "30min"
    assert extension.inventory_class is StaticInventory
    assert extension.nvml_class is FakeNvml and extension.checkpoint_class is FakeCheckpoint
    assert [d.total for d in StaticInventory(config=config).list_devices()] == [80 * 2**30]
    assert HamiInventory(config=config).physical_class is StaticInventory
    assert NvmlInventory(config=config).pod_share is False
