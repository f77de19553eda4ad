"""The host quota service under a real hub, for tests: `quota_service_config(folder, ...)` writes the
service's own config into the hub's folder and returns the jupyterhub_config.py lines that register it
(configure_host_service: a hub-managed service, its role, the admin scope, access for users' tokens).
Its GPUs are a static inventory; NVML is the fake (empty; a test that needs usage sets
nvml_class to FileFakeNvml and writes the file it reads: tests/hub/test_host_service_trust.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from .hubtools import unused_port

DEFAULT_DEVICES = ({"name": "Test GPU", "total": "80GiB", "uuid": "GPU-hubtest-0"},)


class QuotaService:
    """Where the service of one hub test is: its URL through the hub's proxy, its state, its PID file."""

    def __init__(self, folder: Path, port: int, name: str):
        self.folder, self.port, self.name = folder, port, name
        self.prefix = f"/services/{name}/"
        self.state_dir = folder / "gpu-quota-state"
        self.config_path = folder / "gpu_quota_service_config.py"

    def path(self, rest: str) -> str:
        return self.prefix + rest

    def pid(self) -> Optional[int]:
        """The service process's PID, found by its config file's path in its command line."""
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if "gpu_quota_ext.hub.service.app" in cmdline and str(self.config_path) in cmdline:
                    return int(entry.name)
        return None


def quota_service_config(
    folder: Path,
    users: Optional[Mapping[str, Any]] = None,
    groups: Optional[Mapping[str, Any]] = None,
    default: Optional[Mapping[str, Any]] = None,
    devices: Sequence[Mapping[str, str]] = DEFAULT_DEVICES,
    settings: Optional[Mapping[str, Any]] = None,
    admin_roles: Sequence[str] = (),
    name: str = "gpu-quota",
) -> tuple:
    """(hub config lines, QuotaService). `settings`: more c.GpuQuotaService values (lease_seconds, ...)."""
    service = QuotaService(folder, unused_port(), name)
    lines = [
        "c.GpuQuotaService.inventory_class = 'gpu_quota_ext.devices.StaticInventory'",
        f"c.StaticInventory.devices = {list(devices)!r}",
        "c.GpuQuotaService.nvml_class = 'gpu_quota_ext.devices.fake_nvml.FakeNvml'",
        f"c.GpuQuotaService.state_dir = {str(service.state_dir)!r}",
    ]
    lines += [f"c.GpuQuotaService.{key} = {value!r}" for key, value in (settings or {}).items()]
    service.config_path.write_text("\n".join(lines) + "\n")
    # As an admin's jupyterhub_config.py does: the service, and access to it for users' and servers' tokens.
    hub_lines = f"""
from gpu_quota_ext.hub.service.configure import configure_host_service
configure_host_service(
    c, name={name!r}, port={service.port}, users={dict(users or {})!r}, groups={dict(groups or {})!r},
    default={dict(default or {})!r}, args=["--config={service.config_path}"], admin_roles={list(admin_roles)!r},
)
"""
    return hub_lines, service
