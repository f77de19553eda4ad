"""Issue 12: the hard limit through NVIDIA MPS, decided at each kernel start (real server, real kernels,
the fake MPS control program of tests/fake_mps standing in for NVIDIA's)."""

import asyncio
import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest

from gpu_quota_ext.shared.sizes import GiB, MiB
from gpu_quota_ext.usage import KernelManagerView

from .fake_gpu import manager_of, status, wait_for
from .fake_mps import FAKE_CONTROL, MPS_VARIABLES, alive, control, fake_processes, mps_config, other_user, start_daemon
from .kernels import (
    execute,
    kernel_env,
    restart_kernel,
    shutdown_kernel,
    start_kernel,
    write_kernelspec,
)

CONTEXT = 640 * MiB
LIMIT_40 = f"{(40 * GiB + CONTEXT) // MiB}M"  # max_cap 0.5 of 80 GiB, plus the context allowance


@pytest.fixture
def jp_server_config():
    return mps_config(
        "80GiB", "80GiB", default_cap="0.25", max_cap="0.5",
        caps=[{"kernelspec": "two", "cap": "0.25", "devices": 2}],
        # A checkpoint driver, so that what keeps an MPS client from parking is MPS (the fake stands in).
        checkpoint_class="gpu_quota_ext.parking.fake_checkpoint.FakeCheckpoint",
    )


@pytest.fixture
def two_gpu_kernelspec(jp_kernel_dir):
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Two GPUs",
        "language": "python",
    }
    return write_kernelspec(jp_kernel_dir, "two", spec)


def entry(state: dict, kernel_id: str) -> dict:
    return next(k for k in state["kernels"] if k["id"] == kernel_id)


async def scrape(jp_fetch) -> dict:
    text = (await jp_fetch("metrics")).body.decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(gpu_quota_kernel_hard_limit_bytes\{[^}]*\}) (\S+)$", text, re.M)
    }


async def gpucap(jp_serverapp, kernel_id: str, line: str = "") -> str:
    return await execute(jp_serverapp, kernel_id, f"%gpucap {line}")


async def test_each_kernel_gets_its_hard_limit_in_the_ordinals_it_sees(jp_fetch, jp_serverapp, two_gpu_kernelspec):
    one = await start_kernel(jp_fetch)
    two = await start_kernel(jp_fetch, two_gpu_kernelspec)
    state = await status(jp_fetch)
    hard_cap = state["hard_cap"]
    assert (hard_cap["mode"], hard_cap["state"], hard_cap["daemon"], hard_cap["message"]) == (
        "auto",
        "on",
        "managed",
        None,
    )
    pipe = hard_cap["pipe_directory"]
    assert pipe.startswith(str(jp_serverapp.runtime_dir))
    assert stat.S_IMODE(os.stat(Path(pipe).parent).st_mode) == 0o700  # only this server's user reaches the daemon
    # The daemon's default limit, before any client: a process that removes or raises its own variable
    # stays under the largest limit policy can give (measured on an H200: the default is a ceiling).
    limit = 40 * GiB + CONTEXT
    assert hard_cap["ceiling"] == {"0": limit, "1": limit} and hard_cap["ceiling_problem"] is None
    commands = (Path(pipe).parent / "log" / "control.log").read_text()
    assert f"command set_default_device_pinned_mem_limit 0 {LIMIT_40}" in commands
    assert f"command set_default_device_pinned_mem_limit 1 {LIMIT_40}" in commands

    env_one = await kernel_env(jp_serverapp, one, MPS_VARIABLES)
    env_two = await kernel_env(jp_serverapp, two, MPS_VARIABLES)
    device = entry(state, one)["devices"][0]["index"]
    assert env_one["CUDA_VISIBLE_DEVICES"] == f"GPU-{str(device) * 4}-test"
    assert env_one["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={LIMIT_40}"
    assert env_two["CUDA_VISIBLE_DEVICES"] == "GPU-0000-test,GPU-1111-test"
    assert env_two["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={LIMIT_40},1={LIMIT_40}"
    for env in (env_one, env_two):
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        assert env["CUDA_MPS_LOG_DIRECTORY"] == str(Path(pipe).parent / "log")
        assert json.loads(env["GPU_QUOTA_LAYERS"])["hard"] == "mps"

    layers = entry(state, two)["layers"]
    limit = 40 * GiB + CONTEXT
    assert layers["soft"] is True and layers["hard_reason"] is None
    assert layers["hard_limit"] == {"mps": {"0": limit, "1": limit}}
    assert layers["hard_usable"] == {"0": 40 * GiB, "1": 40 * GiB}
    assert "parkable" not in layers  # one answer to "can it park": the kernel's park object
    park = entry(state, two)["park"]
    assert park["parkable"] is False and "MPS client cannot be parked" in park["reason"]

    metrics = await scrape(jp_fetch)
    assert metrics[f'gpu_quota_kernel_hard_limit_bytes{{device="{device}",kernel_id="{one}"}}'] == limit
    assert metrics[f'gpu_quota_kernel_hard_limit_bytes{{device="1",kernel_id="{two}"}}'] == limit

    shown = await gpucap(jp_serverapp, one)
    assert "layers: soft cap + hard limit (NVIDIA MPS)" in shown and "40.0 GiB on cuda:0" in shown, shown

    # max_cap is the number: a raise up to max_cap needs no restart.
    changed = await gpucap(jp_serverapp, one, "0.5")
    assert "granted" in changed and "next restart" not in changed, changed
    assert entry(await status(jp_fetch), one)["layers"]["restart_needed"] is False

    await shutdown_kernel(jp_fetch, one)
    assert not [name for name in await scrape(jp_fetch) if one in name]


async def test_stopping_the_extension_stops_kernels_then_the_daemon(jp_fetch, jp_serverapp):
    """What jupyter_server's shutdown (and its SIGTERM handler) calls, checked without the process exiting:
    atexit and the watcher are only for a server that never gets here."""
    layer = manager_of(jp_serverapp).hard_cap
    pipe = layer.route.pipe_directory
    directory = Path(pipe).parent
    daemon = int((Path(pipe) / "nvidia-cuda-mps-control.pid").read_text())
    control(pipe, f"start_server -uid {os.getuid()}\n")
    (mps_server,) = [int(p) for p in control(pipe, "get_server_list\n").split()]
    watcher = [pid for pid, argv in fake_processes().items() if "--watch" in argv and str(directory) in argv]
    kernel_id = await start_kernel(jp_fetch)
    assert alive(daemon) and alive(mps_server) and len(watcher) == 1

    (app,) = jp_serverapp.extension_manager.extension_apps["gpu_quota_ext"]
    await app.stop_extension()
    assert kernel_id not in jp_serverapp.kernel_manager.list_kernel_ids()  # its clients went first
    assert not alive(daemon) and not alive(mps_server) and not alive(watcher[0])
    assert not directory.exists()
    assert layer.state == "stopped" and (await status(jp_fetch))["hard_cap"]["state"] == "stopped"


class TestLimitIsTheCap:
    @pytest.fixture
    def jp_server_config(self):
        return mps_config("80GiB", default_cap="20GiB", max_cap="0.5", hard_limit="cap")

    async def test_a_raise_above_the_limit_takes_effect_at_the_next_restart(self, jp_fetch, jp_serverapp):
        kernel_id = await start_kernel(jp_fetch)
        env = await kernel_env(jp_serverapp, kernel_id, MPS_VARIABLES)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={(20 * GiB + CONTEXT) // MiB}M"

        said = await gpucap(jp_serverapp, kernel_id, "30GiB")
        assert "granted" in said and "stays 20.0 GiB on cuda:0" in said and "next restart" in said, said
        assert entry(await status(jp_fetch), kernel_id)["layers"]["restart_needed"] is True

        await restart_kernel(jp_fetch, kernel_id)
        env = await kernel_env(jp_serverapp, kernel_id, MPS_VARIABLES)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={(30 * GiB + CONTEXT) // MiB}M"
        layers = entry(await status(jp_fetch), kernel_id)["layers"]
        assert layers["restart_needed"] is False and layers["hard_usable"] == {"0": 30 * GiB}
        assert "30.0 GiB on cuda:0" in await gpucap(jp_serverapp, kernel_id)


class TestAnotherUsersServer:
    @pytest.fixture
    def jp_server_config(self):
        return mps_config("80GiB", default_cap="0.25", max_cap="0.5")

    async def test_a_kernel_is_never_routed_into_another_users_mps_server(self, jp_fetch, jp_serverapp):
        uid = other_user()
        if uid is None:
            pytest.skip("needs root (useradd, and a process run as a second user)")
        layer = manager_of(jp_serverapp).hard_cap
        pipe = layer.route.pipe_directory
        # The daemon runs an MPS server for the other user (as it does when that user's client connects).
        control(pipe, f"start_server -uid {uid}\n")
        (server_pid,) = [int(p) for p in control(pipe, "get_server_list\n").split()]
        assert Path(f"/proc/{server_pid}/status").read_text().count(f"\t{uid}\t") >= 1

        kernel_id = await start_kernel(jp_fetch)
        env = await kernel_env(jp_serverapp, kernel_id, MPS_VARIABLES)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] is None
        # Sent to an empty directory: CUDA finds no daemon there and runs without MPS instead of waiting.
        none = env["CUDA_MPS_PIPE_DIRECTORY"]
        assert none != pipe and os.path.isdir(none) and os.listdir(none) == []
        layers = entry(await status(jp_fetch), kernel_id)["layers"]
        assert layers["hard_limit"] is None and "parkable" not in layers
        assert f"another Unix user (uid {uid}, PID {server_pid})" in layers["hard_reason"]
        shown = await gpucap(jp_serverapp, kernel_id)
        assert (
            f"soft cap only, no hard limit: the MPS server on this daemon runs for another Unix user (uid {uid}"
            in shown
        ), shown

        # That user's work ends: the next kernel gets the hard limit again.
        os.kill(server_pid, 9)
        await wait_for(lambda: control(pipe, "get_server_list\n").strip() == "")
        second = await start_kernel(jp_fetch)
        assert (await kernel_env(jp_serverapp, second, MPS_VARIABLES))["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        assert entry(await status(jp_fetch), second)["layers"]["hard_limit"] is not None

    async def test_our_own_users_server_is_fine(self, jp_fetch, jp_serverapp):
        pipe = manager_of(jp_serverapp).hard_cap.route.pipe_directory
        control(pipe, f"start_server -uid {os.getuid()}\n")
        kernel_id = await start_kernel(jp_fetch)
        env = await kernel_env(jp_serverapp, kernel_id, MPS_VARIABLES)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={LIMIT_40}"


@pytest.mark.slow
class TestHangingControl:
    @pytest.fixture
    def jp_server_config(self):
        return mps_config("80GiB", default_cap="0.25", max_cap="0.5", mps_timeout=3)

    async def test_a_hanging_control_program_costs_its_timeout_and_the_hard_layer_never_the_loop(
        self, jp_fetch, jp_serverapp
    ):
        pipe = manager_of(jp_serverapp).hard_cap.route.pipe_directory
        hang = Path(pipe) / "fake-hang"
        hang.touch()
        starting = asyncio.ensure_future(start_kernel(jp_fetch))

        def probe_running():  # `echo … | nvidia-cuda-mps-control`: the program with no arguments
            return [pid for pid, argv in fake_processes().items() if argv[-1] == str(FAKE_CONTROL)]

        await wait_for(probe_running)
        # The check hangs in its own thread: the server still answers meanwhile.
        state = await status(jp_fetch)
        assert state["hard_cap"]["state"] == "on" and not starting.done()

        kernel_id = await starting
        env = await kernel_env(jp_serverapp, kernel_id, MPS_VARIABLES)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] is None and env["CUDA_MPS_PIPE_DIRECTORY"] != pipe
        reason = entry(await status(jp_fetch), kernel_id)["layers"]["hard_reason"]
        assert "did not answer within 3 s" in reason
        assert "did not answer" in (await status(jp_fetch))["hard_cap"]["last_problem"]
        await wait_for(lambda: not probe_running())  # the hung program was killed, not left behind

        hang.unlink()
        again = await start_kernel(jp_fetch)
        assert (await kernel_env(jp_serverapp, again, MPS_VARIABLES))[
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
        ] == f"0={LIMIT_40}"
        assert (await status(jp_fetch))["hard_cap"]["last_problem"] is None


class TestDaemonRefusesDefaults:
    @pytest.fixture
    def jp_server_config(self, monkeypatch):
        monkeypatch.setenv("FAKE_MPS_REFUSE_LIMITS", "1")
        return mps_config("80GiB", max_cap="0.5")

    async def test_kernels_keep_their_own_limit_and_the_status_says_the_ceiling_is_missing(
        self, jp_fetch, jp_serverapp
    ):
        hard_cap = (await status(jp_fetch))["hard_cap"]
        assert hard_cap["state"] == "on" and hard_cap["ceiling"] == {}
        assert "Operation not supported" in hard_cap["ceiling_problem"]
        kernel_id = await start_kernel(jp_fetch)
        assert (await kernel_env(jp_serverapp, kernel_id, MPS_VARIABLES))[
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
        ] == f"0={LIMIT_40}"


class TestAutoWithoutDaemon:
    @pytest.fixture
    def jp_server_config(self):
        return mps_config("80GiB", mps_control="/nonexistent/nvidia-cuda-mps-control")

    async def test_kernels_start_with_soft_caps_and_the_status_says_why(self, jp_fetch, jp_serverapp):
        state = await status(jp_fetch)
        assert state["hard_cap"]["state"] == "unavailable"
        assert (
            "'/nonexistent/nvidia-cuda-mps-control' (c.GpuQuota.mps_control) was found neither"
            in state["hard_cap"]["message"]
        )
        kernel_id = await start_kernel(jp_fetch)
        env = await kernel_env(jp_serverapp, kernel_id, MPS_VARIABLES)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] is None
        assert env["CUDA_VISIBLE_DEVICES"] == "GPU-0000-test"  # the soft caps are all there
        layers = entry(await status(jp_fetch), kernel_id)["layers"]
        assert layers["soft"] is True and "was found neither" in layers["hard_reason"]


class TestExternalDaemon:
    @pytest.fixture
    def external(self, jp_runtime_dir, monkeypatch):
        pipe = str(jp_runtime_dir / "admin-mps")
        pid = start_daemon(pipe)
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", pipe)
        yield pipe, pid
        control(pipe, "quit\n")

    @pytest.fixture
    def jp_server_config(self, external):
        return mps_config("80GiB", max_cap="0.5", mps_daemon="external")

    async def test_kernels_use_the_admins_daemon_and_the_server_leaves_it_running(
        self, jp_fetch, jp_serverapp, external
    ):
        pipe, pid = external
        kernel_id = await start_kernel(jp_fetch)
        env = await kernel_env(jp_serverapp, kernel_id, MPS_VARIABLES)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe and env["CUDA_MPS_LOG_DIRECTORY"] is None
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={LIMIT_40}"
        assert (await status(jp_fetch))["hard_cap"]["daemon"] == "external"
        await manager_of(jp_serverapp).hard_cap.stop(KernelManagerView(jp_serverapp.kernel_manager).shutdown_all)
        assert alive(pid)  # not ours to stop
        assert not (Path(jp_serverapp.runtime_dir) / f"gpu-quota-mps-{os.getpid()}").exists()


class TestOff:
    @pytest.fixture
    def jp_server_config(self):
        return mps_config("80GiB", hard_cap="off")

    async def test_off_adds_nothing_and_starts_nothing(self, jp_fetch, jp_serverapp):
        before = set(fake_processes())
        kernel_id = await start_kernel(jp_fetch)
        env = await kernel_env(jp_serverapp, kernel_id, MPS_VARIABLES)
        assert env == {**{name: None for name in MPS_VARIABLES}, "CUDA_VISIBLE_DEVICES": "GPU-0000-test"}
        state = await status(jp_fetch)
        assert (state["hard_cap"]["mode"], state["hard_cap"]["state"]) == ("off", "off")
        layers = entry(state, kernel_id)["layers"]
        assert layers["hard_limit"] is None and "off" in layers["hard_reason"]
        assert set(fake_processes()) == before
        assert not list(Path(jp_serverapp.runtime_dir).glob("gpu-quota-mps-*"))
        assert "c.GpuQuota.hard_cap, is off" in await gpucap(jp_serverapp, kernel_id)
        assert FAKE_CONTROL.exists()  # the fake was there to be used, and was not
