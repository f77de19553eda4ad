"""The tests' kernels talk over IPC sockets they bound themselves (tests/kernel_transport.py), and still do
everything a TCP kernel does for the extension: a cell, the parker's word on the control channel."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from ..kernel_transport import SOCKET_PATH_LIMIT, short_directory
from .kernels import execute, shutdown_kernel, start_kernel, static_devices_config
from .servers import Server

CHANNELS = ("shell", "iopub", "stdin", "control", "hb")


def ipc_sockets(connection_file) -> list:
    """The paths of a kernel's five sockets; fails unless its connection file says IPC."""
    info = json.loads(Path(connection_file).read_text())
    assert info["transport"] == "ipc", info
    return [f"{info['ip']}-{info[f'{channel}_port']}" for channel in CHANNELS]


def assert_bound(paths) -> None:
    for path in paths:
        assert len(os.fsencode(path)) <= SOCKET_PATH_LIMIT, path
        assert stat.S_ISSOCK(os.stat(path).st_mode), path


@pytest.fixture
def jp_server_config():
    return static_devices_config("16GiB")


async def test_a_fixture_servers_kernel_runs_cells_over_ipc_sockets(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    kernel = jp_serverapp.kernel_manager.get_kernel(kernel_id)
    assert (await execute(jp_serverapp, kernel_id, "print(6 * 7)")).strip() == "42"
    paths = ipc_sockets(kernel.connection_file)
    assert_bound(paths)
    # The parker asks a kernel through a client of the kernel manager, which takes the connection's transport.
    assert kernel.client().transport == "ipc"
    await shutdown_kernel(jp_fetch, kernel_id)
    assert not any(os.path.exists(path) for path in paths)  # jupyter_client removes them with the kernel


@pytest.mark.slow
def test_a_server_processs_kernel_runs_cells_over_ipc_sockets(short_tmp):
    server = Server(short_directory(short_tmp), ["--GpuQuota.inventory_class=gpu_quota_ext.devices.StaticInventory"])
    try:
        server.wait_serving()
        kernel_id = server.start_kernel()
        assert server.run(kernel_id, "print(6 * 7)").strip() == "42"
        assert_bound(ipc_sockets(server.runtime / f"kernel-{kernel_id}.json"))
    finally:
        server.kill()


@pytest.mark.slow
def test_a_server_whose_port_was_taken_before_it_listened_is_started_again(short_tmp):
    """jupyter_server's own window (servers.Server._serving): its first start here says what jupyter_server says
    when the port it picked was taken, and exits; the second is a real server."""
    runtime = short_directory(short_tmp)
    first = runtime / "started-once"
    script = runtime / "python"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ ! -e "{first}" ]; then\n'
        f'  touch "{first}"; echo "[C] ERROR: The port 8888 is already in use." >&2; exit 1\n'
        "fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    script.chmod(0o755)

    class TakenOnce(Server):
        python = str(script)

    server = TakenOnce(runtime, ["--GpuQuota.inventory_class=gpu_quota_ext.devices.StaticInventory"])
    try:
        server.wait_serving()
        assert server.starts == 2
        assert "devices" in server.api("/api/gpu-quota/status")  # this server, with the extension
    finally:
        server.kill()


def test_a_runtime_folder_too_long_for_a_unix_socket_is_refused_before_a_server_starts(tmp_path):
    deep = tmp_path / ("d" * 60)
    with pytest.raises(ValueError, match="over the 107 of a Unix socket's path"):
        Server(deep, [])
