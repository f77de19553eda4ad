"""The host service's app as the unit tests build it: one static device and a state folder of the test's own, and
the hub's environment pointing at a port where nothing listens (a test that needs users says who is who itself)."""

import asyncio
import os
import pwd
from pathlib import Path
from typing import Awaitable, Callable, Tuple

from tornado.httpclient import AsyncHTTPClient
from traitlets.config import Config

from gpu_quota_ext.hub.service.auth import Who
from gpu_quota_ext.hub.service.user_policy import user_policy
from tests.hub.hubtools import listen_here, unused_port

PREFIX = "/services/gpu-quota/"


def service_config(tmp_path, total: str = "80GiB", uuid: str = "GPU-a", **settings) -> Config:
    """GpuQuotaService's config: its state under tmp_path, one device of `total` bytes, then `settings` (trait name ->
    value) on GpuQuotaService."""
    config = Config()
    config.GpuQuotaService.state_dir = str(tmp_path / "state")
    config.GpuQuotaService.inventory_class = "gpu_quota_ext.devices.StaticInventory"
    config.StaticInventory.devices = [{"total": total, "uuid": uuid}]
    for name, value in settings.items():
        setattr(config.GpuQuotaService, name, value)
    return config


def file_nvml_config(tmp_path, monkeypatch, total: str, uuid: str) -> Tuple[Config, Path]:
    """service_config over the file-driven fake NVML (devices.FileFakeNvml) read from tmp_path/nvml.json (returned:
    the test writes each process's usage there), every hub user's kernel a process of this test's own Unix user,
    the hub down."""
    nvml_file = tmp_path / "nvml.json"
    monkeypatch.setenv("GPU_QUOTA_FAKE_NVML_FILE", str(nvml_file))
    hub_down(monkeypatch)
    config = service_config(tmp_path, total=total, uuid=uuid)
    config.GpuQuotaService.nvml_class = "gpu_quota_ext.devices.fake_nvml.FileFakeNvml"
    config.GpuQuotaService.unix_user_template = pwd.getpwuid(os.getuid()).pw_name
    return config, nvml_file


def hub_down(monkeypatch) -> None:
    """The service's hub environment, the hub's API where nothing answers."""
    monkeypatch.setenv("JUPYTERHUB_API_URL", f"http://127.0.0.1:{unused_port()}/hub/api")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "service-token-for-the-test")
    monkeypatch.setenv("JUPYTERHUB_CLIENT_ID", "service-gpu-quota")


def hub_says(app, monkeypatch, identify: Callable[[str], Awaitable[Who]]) -> None:
    """The hub's part, by hand: `identify` says who a token belongs to; each user's policy is the one the service's
    own settings give them (no groups)."""

    async def policy_for(name, directory=None):
        return user_policy(app.caps, app.host_policy, name, [], app.limits)

    monkeypatch.setattr(app.auth, "_identify", identify)
    monkeypatch.setattr(app.policies, "policy_for", policy_for)


def serve(service, scenario: Callable[[str, AsyncHTTPClient], Awaitable[None]]) -> None:
    """Run `scenario(base URL, client)` against the service's web app on a port of its own, stopped after it."""

    async def run():
        server, port = listen_here(service.web_app(PREFIX))
        try:
            await scenario(f"http://127.0.0.1:{port}{PREFIX}", AsyncHTTPClient())
        finally:
            server.stop()

    asyncio.run(run())
