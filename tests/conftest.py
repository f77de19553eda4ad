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
