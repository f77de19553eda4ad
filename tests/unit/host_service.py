"""The host service's app as the unit tests build it: one static device and a state folder of the test's own, and
the hub's environment pointing at a port where nothing listens (a test that needs users says who is who itself)."""

from traitlets.config import Config

from tests.hub.hubtools import unused_port


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


def hub_down(monkeypatch) -> None:
    """The service's hub environment, the hub's API where nothing answers."""
    monkeypatch.setenv("JUPYTERHUB_API_URL", f"http://127.0.0.1:{unused_port()}/hub/api")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "service-token-for-the-test")
    monkeypatch.setenv("JUPYTERHUB_CLIENT_ID", "service-gpu-quota")
