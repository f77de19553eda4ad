"""Shared by every test folder: pytest-jupyter's real server fixtures, with kernels on IPC sockets. The
slowest tests (whole servers or CLI runs started per test) carry @pytest.mark.slow in their files:
`-m "not slow and not gpu"` is the quick round; `./run test` and CI run everything."""

import copy
import shutil

import pytest
from traitlets.config import Config

from .kernel_transport import TRANSPORT_SETTINGS, short_directory

pytest_plugins = ["pytest_jupyter.jupyter_server"]


@pytest.fixture(scope="session")
def short_tmp():
    """A folder with a short path for the session (Unix sockets live under it), removed at its end."""
    directory = short_directory()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def jp_runtime_dir(short_tmp):
    """The in-process server's runtime directory, short: its kernels' IPC sockets are named after their
    connection files in it (kernel_transport). Removed with short_tmp, after every server's own cleanup."""
    return short_directory(short_tmp, prefix="")


@pytest.fixture
def jp_configurable_serverapp(jp_configurable_serverapp, jp_server_config):
    """pytest-jupyter's server factory, its kernels on IPC unless the test's config names a transport (a test
    of jupyter_client's TCP port cache needs TCP)."""

    def start(config=None, **kwargs):
        config = copy.deepcopy(Config(jp_server_config if config is None else config))
        if "transport" not in config.KernelManager:
            config.merge(Config(TRANSPORT_SETTINGS))
        return jp_configurable_serverapp(config=config, **kwargs)

    return start


@pytest.fixture
def service(tmp_path, monkeypatch):
    """The host service's web app in this process, its hub down (nothing answers the hub's API URL): what a caller
    gets without a token, or when the hub cannot check it (tests/unit/test_host_service_app.py; through a real
    proxy: tests/hub/test_bodies_through_the_proxy.py)."""
    from gpu_quota_ext.hub.service.app import GpuQuotaService
    from tests.hub.hubtools import unused_port

    closed = unused_port()  # nothing listens there: the hub is down
    monkeypatch.setenv("JUPYTERHUB_API_URL", f"http://127.0.0.1:{closed}/hub/api")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "service-token-for-the-test")
    monkeypatch.setenv("JUPYTERHUB_CLIENT_ID", "service-gpu-quota")
    config = Config()
    config.GpuQuotaService.state_dir = str(tmp_path / "state")
    config.GpuQuotaService.inventory_class = "gpu_quota_ext.devices.StaticInventory"
    config.StaticInventory.devices = [{"total": "80GiB", "uuid": "GPU-a"}]
    app = GpuQuotaService(config=config)
    app.build()
    app.connect_hub()
    yield app
    app.store.close()
