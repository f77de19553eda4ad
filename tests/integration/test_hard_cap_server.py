"""Issue 12, whole servers as subprocesses: the managed MPS daemon lives exactly as long as its server
(stopped at shutdown, after SIGTERM, and by its watcher after SIGKILL: no process left), and
hard_cap = "mps" without a usable daemon stops the server at start with one line."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import pytest

from .fake_mps import FAKE_CONTROL, alive, control, fake_processes, wait_until
from .servers import Server

pytestmark = pytest.mark.slow  # whole servers started and stopped, each test

DEVICES = '[{"name": "Test GPU", "total": "80GiB", "uuid": "GPU-0000-test"}]'
STATIC = ["--GpuQuota.inventory_class=gpu_quota_ext.devices.StaticInventory", f"--StaticInventory.devices={DEVICES}"]


@pytest.fixture
def runtime(short_tmp):
    return Path(tempfile.mkdtemp(dir=short_tmp))


@pytest.fixture
def servers():
    started = []

    def start(runtime, args, env_extra=None):
        started.append(Server(runtime, STATIC + list(args), env_extra))
        return started[-1]

    yield start
    for server in started:
        server.kill()


def watchers(directory: str):
    return [pid for pid, argv in fake_processes().items() if "--watch" in argv and directory in argv]


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "shutdown"])
def test_the_managed_daemon_lives_exactly_as_long_as_its_server(servers, runtime, how):
    server = servers(
        runtime, ["--GpuQuota.hard_cap=mps", f"--GpuQuota.mps_control={FAKE_CONTROL}", "--GpuQuota.mps_timeout=2"]
    )
    server.wait_serving()
    hard_cap = server.api("/api/gpu-quota/status")["hard_cap"]
    assert (hard_cap["mode"], hard_cap["state"]) == ("mps", "on")
    pipe = hard_cap["pipe_directory"]
    directory = str(Path(pipe).parent)
    assert directory == str(runtime / f"gpu-quota-mps-{server.process.pid}")
    daemon = int((Path(pipe) / "nvidia-cuda-mps-control.pid").read_text())
    assert alive(daemon) and len(watchers(directory)) == 1
    # A kernel, and an MPS server of this user on the daemon (as a kernel's first CUDA call would start).
    kernel = server.api("/api/kernels", "POST", {"name": "python3"})
    assert server.api(f"/api/gpu-quota/kernels/{kernel['id']}")["layers"]["hard_limit"]["mps"]["0"] > 0
    seen = server.run(kernel["id"], "import os; print(os.environ['CUDA_MPS_PIPE_DIRECTORY'])").strip()
    assert seen == pipe
    control(pipe, f"start_server -uid {os.getuid()}\n")
    (mps_server,) = [int(p) for p in control(pipe, "get_server_list\n").split()]

    if how == "shutdown":
        server.api("/api/shutdown", "POST")
    else:
        server.process.send_signal(getattr(signal, how))
    server.exit_code()
    # SIGKILL leaves it to the watcher, which notices the server's end of its pipe closing.
    wait_until(lambda: not alive(daemon) and not alive(mps_server) and not watchers(directory), timeout=30)
    wait_until(lambda: not Path(pipe).exists())
    wait_until(lambda: not Path(directory).exists())


def test_a_daemon_that_ignores_quit_is_killed(servers, runtime):
    server = servers(
        runtime, ["--GpuQuota.hard_cap=mps", f"--GpuQuota.mps_control={FAKE_CONTROL}", "--GpuQuota.mps_timeout=1"]
    )
    server.wait_serving()
    pipe = server.api("/api/gpu-quota/status")["hard_cap"]["pipe_directory"]
    daemon = int((Path(pipe) / "nvidia-cuda-mps-control.pid").read_text())
    (Path(pipe) / "fake-ignore-quit").touch()  # it ignores `quit` and SIGTERM: only SIGKILL ends it
    server.process.send_signal(signal.SIGTERM)
    server.exit_code()
    assert not alive(daemon)
    assert not Path(pipe).exists()


REFUSAL = "gpu-quota-ext: invalid configuration: c.GpuQuota.hard_cap = 'mps' needs a usable NVIDIA MPS control daemon"


@pytest.mark.parametrize(
    "args, env_extra, words",
    [
        (
            ["--GpuQuota.mps_control=/nonexistent/nvidia-cuda-mps-control"],
            {},
            "was found neither on PATH nor in /usr/local/nvidia/bin",
        ),
        (
            [],
            {"FAKE_MPS_FAIL_START": "1"},
            "the managed MPS control daemon did not start: nvidia-cuda-mps-control -d exited with status 1",
        ),
        (
            [],
            {"FAKE_MPS_HANG": "1"},
            "the managed MPS control daemon did not start: nvidia-cuda-mps-control -d did not return within 1 s",
        ),
        (
            ["--GpuQuota.mps_daemon=external"],
            {"CUDA_MPS_PIPE_DIRECTORY": "{runtime}/no-daemon"},
            "Cannot find MPS control daemon process",
        ),
    ],
    ids=["no-program", "start-fails", "start-hangs", "no-external-daemon"],
)
def test_required_hard_cap_without_a_usable_daemon_refuses_to_start(servers, runtime, args, env_extra, words):
    before = set(fake_processes())
    env_extra = {k: v.format(runtime=runtime) for k, v in env_extra.items()}
    control_arg = [] if any("mps_control" in a for a in args) else [f"--GpuQuota.mps_control={FAKE_CONTROL}"]
    # The timeout must expire only where the control program hangs; elsewhere it only bounds the wait (a
    # loaded machine can take over a second to start the fake control program).
    timeout = 1 if "FAKE_MPS_HANG" in env_extra else 30
    server = servers(
        runtime, ["--GpuQuota.hard_cap=mps", f"--GpuQuota.mps_timeout={timeout}", *control_arg, *args], env_extra
    )
    code = server.exit_code()
    log = "".join(server.lines)
    assert code not in (None, 0), log
    ours = [line for line in log.splitlines() if "gpu-quota-ext: invalid configuration" in line]
    assert len(ours) == 1 and ours[0].startswith(REFUSAL) and words in ours[0], log
    assert "Traceback" not in log and server.url() is None
    assert set(fake_processes()) <= before  # a launch that hung was killed, nothing left running
    assert not list(runtime.glob("gpu-quota-mps-*"))


@pytest.mark.parametrize(
    "arg, named",
    [
        ("--GpuQuota.hard_cap=yes", "c.GpuQuota.hard_cap = 'yes'"),
        ("--GpuQuota.mps_daemon=system", "c.GpuQuota.mps_daemon = 'system'"),
        ("--GpuQuota.hard_limit=budget", "c.GpuQuota.hard_limit = 'budget'"),
        ("--GpuQuota.mps_context_allowance=10%", "c.GpuQuota.mps_context_allowance = '10%'"),
        ("--GpuQuota.mps_timeout=-1", "c.GpuQuota.mps_timeout = '-1'"),
    ],
)
def test_invalid_hard_cap_settings_stop_the_server_with_one_line(servers, runtime, arg, named):
    server = servers(runtime, [arg])
    code = server.exit_code()
    log = "".join(server.lines)
    ours = [line for line in log.splitlines() if "gpu-quota-ext: invalid configuration" in line]
    assert code not in (None, 0) and len(ours) == 1 and named in ours[0], log
    assert "Traceback" not in log
