"""The configs of a real hub whose users' servers and host service share one fake GPU (the hub end-to-end tests of
the host's broker): every server on the file-driven fake NVML (devices.FileFakeNvml) and the file-backed fake
checkpoint driver (parking.fake_file_checkpoint), so the service sees every park and resume as NVML would; the
hub spawns each user's server as its own Unix user (LocalProcessSpawner) and runs the host service."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Mapping, Sequence

# Caps of 0.45 of the device, at most 0.5, a full host refused: two kernels fit, a third overcommits.
DEFAULT = {"default_cap": "0.45", "max_cap": "0.5", "on_full": "refuse"}

SINGLE_USER_CONFIG = """
c.ServerApp.jpserver_extensions = {{"gpu_quota_ext": True}}
c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"
c.StaticInventory.devices = {devices!r}
c.GpuQuota.nvml_class = "gpu_quota_ext.devices.fake_nvml.FileFakeNvml"
c.GpuQuota.checkpoint_class = "gpu_quota_ext.parking.fake_file_checkpoint.FileFakeCheckpoint"
c.GpuQuota.poll_interval = {poll}
c.GpuQuota.park_idle_after = "off"
"""

HUB_CONFIG = """
c.JupyterHub.spawner_class = "jupyterhub.spawner.LocalProcessSpawner"
c.LocalProcessSpawner.env_keep = ["LANG", "LC_ALL"]  # no PYTHONPATH: the users' servers run their own install
c.Spawner.cmd = [{python!r}, "-m", "jupyterhub.singleuser"]
c.Spawner.args = ["--config={single_user_config}"]
from gpu_quota_ext.hub.service.configure import configure_host_service

entry = configure_host_service(
    c,
    default={default!r},
    port={port},
    args=["--config={service_config}"],
    admin_roles=["hub-test-admin"],
)
entry["environment"]["GPU_QUOTA_FAKE_NVML_FILE"] = {nvml_file!r}
c.Spawner.environment["GPU_QUOTA_FAKE_NVML_FILE"] = {nvml_file!r}
c.Spawner.environment["PATH"] = {path!r}
"""


def write_single_user_config(path: Path, devices: Sequence[dict], poll: float, extra: str = "") -> Path:
    """Every user's server config (readable by them), `extra` lines after the shared ones."""
    path.write_text(SINGLE_USER_CONFIG.format(devices=list(devices), poll=poll) + textwrap.dedent(extra))
    path.chmod(0o644)
    return path


def hub_config(
    python: str, single_user_config: Path, service, nvml_file: Path, default: Mapping[str, str] = DEFAULT
) -> str:
    """The hub's config: users' servers on `python` (an install they can run), the host service with `default`."""
    return textwrap.dedent(
        HUB_CONFIG.format(
            python=python,
            single_user_config=single_user_config,
            default=dict(default),
            port=service.port,
            service_config=service.config_path,
            nvml_file=str(nvml_file),
            path=os.path.dirname(python) + ":/usr/local/bin:/usr/bin:/bin",
        )
    )
