"""Issue 12 on a real GPU: the hard limit through NVIDIA MPS (the device machine runs as root and has
/usr/local/nvidia/bin/nvidia-cuda-mps-control).

    bash tests/gpu/run_on_device.sh mps          # these checks only
Every wait has a timeout: a CUDA call routed into another user's MPS server would hang for good.
Each test prints FIGURE lines (conftest.record); they go to $GPU_QUOTA_FIGURES as JSON lines.
"""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from traitlets.config import Config

from gpu_quota_ext.manager import SETTINGS_KEY

from ..integration.fake_gpu import wait_for
from ..integration.fake_mps import alive, other_user, wait_until
from ..integration.kernels import (
    execute,
    kernel_env,
    restart_kernel,
    start_kernel,
    write_kernelspec,
)
from ..integration.servers import Server
from .conftest import gpu_count, kernel_pid, record

pytestmark = pytest.mark.gpu

GiB, MiB = 1 << 30, 1 << 20
CAP = 16 * GiB  # default_cap = max_cap: what the kernel may use
LIMIT = CAP + 640 * MiB  # what the driver enforces (the CUDA context included)
OVER = 20 * GiB  # above the hard limit
UNDER = 15 * GiB  # under the cap, with room for the context
CONTROL = shutil.which("nvidia-cuda-mps-control") or "/usr/local/nvidia/bin/nvidia-cuda-mps-control"
MPS_VARIABLES = [
    "CUDA_VISIBLE_DEVICES",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY",
]


def hard_config(**more) -> Config:
    settings = {
        "default_cap": "16GiB",
        "max_cap": "16GiB",
        "hard_cap": "mps",
        "mps_daemon": "managed",
        "enforce": "warn",
        "poll_interval": 0.5,
    }
    settings.update(more)
    return Config({"ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}}, "GpuQuota": settings})


def mps_processes() -> dict:
    """pid -> comm of every nvidia-cuda-mps-* process on the machine."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                comm = Path(f"/proc/{entry}/comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith("nvidia-cuda-mps") and alive(int(entry)):
                found[int(entry)] = comm
    return found


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


# Each over-cap route a user has, in its own kernel: every one must end in an out-of-memory error.
ROUTES = {
    "cupy without CUPY_GPU_MEMORY_LIMIT": """
import os, json
os.environ.pop("CUPY_GPU_MEMORY_LIMIT", None)
import cupy
cupy.get_default_memory_pool().set_limit(size=0)
out = {}
for name, size in (("under", UNDER), ("over", OVER)):
    try:
        x = cupy.empty(size, dtype=cupy.uint8); x.fill(1); cupy.cuda.runtime.deviceSynchronize(); del x
        cupy.get_default_memory_pool().free_all_blocks(); out[name] = "ok"
    except cupy.cuda.memory.OutOfMemoryError as error:
        out[name] = "OOM " + str(error)[:120]
print(json.dumps(out))
""",
    "cupy.cuda.runtime.malloc": """
import json, cupy
from cupy.cuda import runtime
out = {}
for name, size in (("under", UNDER), ("over", OVER)):
    try:
        pointer = runtime.malloc(size); runtime.free(pointer); out[name] = "ok"
    except runtime.CUDARuntimeError as error:
        out[name] = "OOM " + str(error)[:120]
# The largest single allocation that succeeds, to 16 MiB.
low, high = 8 * 2**30, LIMIT + 2**30
while high - low > 16 * 2**20:
    middle = (low + high) // 2
    try:
        runtime.free(runtime.malloc(middle)); low = middle
    except runtime.CUDARuntimeError:
        high = middle
out["largest"] = low
print(json.dumps(out))
""",
    "torch after set_per_process_memory_fraction(1.0)": """
import json, torch
torch.cuda.set_per_process_memory_fraction(1.0, 0)
out = {}
for name, size in (("under", UNDER), ("over", OVER)):
    try:
        x = torch.empty(size, dtype=torch.uint8, device="cuda"); x.fill_(1); torch.cuda.synchronize(); del x
        torch.cuda.empty_cache(); out[name] = "ok"
    except torch.OutOfMemoryError as error:
        torch.cuda.empty_cache(); out[name] = "OOM " + str(error)[:120]
print(json.dumps(out))
""",
    "jax without its fraction variable": """
import os, json
os.environ.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
os.environ.pop("XLA_CLIENT_MEM_FRACTION", None)
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
import jax, jax.numpy as jnp
out = {"backend": jax.default_backend()}
for name, size in (("under", UNDER), ("over", OVER)):
    try:
        x = jnp.ones((size // 4,), jnp.float32); x.block_until_ready(); del x; out[name] = "ok"
    except Exception as error:
        text = str(error)
        out[name] = ("OOM " if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() else "error ") + text[:120]
print(json.dumps(out))
""",
}


@pytest.fixture
def jp_server_config():
    return hard_config()


async def test_over_limit_allocations_are_refused_at_allocation_time_by_every_allocator(jp_fetch, jp_serverapp):
    state = json.loads((await jp_fetch("api", "gpu-quota", "status")).body)
    record("mps hard_cap status", state["hard_cap"])
    assert state["hard_cap"]["state"] == "on", state["hard_cap"]
    results = {}
    for route, code in ROUTES.items():
        kernel_id = await start_kernel(jp_fetch)
        env = await kernel_env(jp_serverapp, kernel_id, MPS_VARIABLES)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={LIMIT // MiB}M", env
        began = time.perf_counter()
        found = last_json(
            await execute(
                jp_serverapp, kernel_id, f"UNDER, OVER, LIMIT = {UNDER}, {OVER}, {LIMIT}\n" + code, timeout=300
            )
        )
        found["seconds"] = round(time.perf_counter() - began, 2)
        record(f"mps {route}", found)
        results[route] = found
        if "largest" in found:
            record("mps largest single cudaMalloc / cap (16 GiB)", round(found["largest"] / CAP, 4))
            record("mps largest single cudaMalloc / hard limit", round(found["largest"] / LIMIT, 4))
            record("mps CUDA context and rounding under the limit, bytes", LIMIT - found["largest"])
        if route.startswith("jax"):
            assert found["backend"] == "gpu", found
        answer = json.loads((await jp_fetch("api", "gpu-quota", "kernels", kernel_id)).body)
        layers = answer["layers"]
        assert layers["hard_limit"] == {"mps": {str(k): LIMIT for k in layers["hard_limit"]["mps"]}}
        assert answer["park"]["parkable"] is False
    for route, found in results.items():
        assert found["under"] == "ok", (route, found)
        assert found["over"].startswith("OOM"), (route, found)


PRELOADED = "import os; print(os.environ.get('LD_PRELOAD', '').split(':')[0])"
# What the library itself says it serves while an allocation under the limit is held: mapped through the virtual
# memory calls, or passed to libcudart (which the limit would refuse the same way, proving nothing of the library).
SERVED = {
    "torch after set_per_process_memory_fraction(1.0)": """
import json, torch
from gpu_quota_ext.kernel import fast_park
x = torch.empty(UNDER, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
p = fast_park.pages()
print(json.dumps({"active": p.active(), "mapped": p.mapped_bytes(), "passthrough": p.passthrough_bytes()}))
del x; torch.cuda.empty_cache()
""",
    "cupy.cuda.runtime.malloc": """
import json
from cupy.cuda import runtime
from gpu_quota_ext.kernel import fast_park
pointer = runtime.malloc(UNDER)
p = fast_park.pages()
print(json.dumps({"active": p.active(), "mapped": p.mapped_bytes(), "passthrough": p.passthrough_bytes()}))
runtime.free(pointer)
""",
}


class TestFastParkLibraryBesideMps:
    """fast_park "on" preloads the fast park library into MPS clients too ("auto", the default, leaves them
    without it: they are never parked). Its cudaMalloc maps memory through the virtual memory calls; the daemon's
    limit must refuse those the same way, at allocation time. The library's own counters say that it served the
    allocations (a pass-through to libcudart would be refused by the limit too, proving nothing of it). CuPy's
    `runtime.malloc` never reaches the library (CuPy carries its own CUDA runtime, linked statically: measured on the
    H200, the counters stayed at 0 while 15 GiB was held), so the limit alone refuses it, as without the library."""

    @pytest.fixture
    def jp_server_config(self, fast_park_library):
        return hard_config(fast_park="on")

    async def test_the_hard_limit_holds_for_allocations_the_library_serves(
        self, jp_fetch, jp_serverapp, fast_park_library
    ):
        results = {}
        for route in ("torch after set_per_process_memory_fraction(1.0)", "cupy.cuda.runtime.malloc"):
            kernel_id = await start_kernel(jp_fetch)
            env = await kernel_env(jp_serverapp, kernel_id, MPS_VARIABLES)
            assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={LIMIT // MiB}M", env
            assert (await execute(jp_serverapp, kernel_id, PRELOADED, timeout=60)).strip() == str(fast_park_library)
            code = f"UNDER, OVER, LIMIT = {UNDER}, {OVER}, {LIMIT}\n" + ROUTES[route]
            results[route] = last_json(await execute(jp_serverapp, kernel_id, code, timeout=300))
            record(f"mps with the fast park library, {route}", results[route])
            served = last_json(await execute(jp_serverapp, kernel_id, f"UNDER = {UNDER}\n" + SERVED[route], timeout=120))
            record(f"mps with the fast park library, {route}: what the library served", served)
            assert served["active"] and served["passthrough"] == 0, (route, served)
            if route.startswith("torch"):
                assert served["mapped"] >= UNDER, (route, served)
            else:  # what stays on the device through a park, and why CuPy kernels take the checkpoint path
                assert served["mapped"] == 0, (route, served)
            answer = json.loads((await jp_fetch("api", "gpu-quota", "kernels", kernel_id)).body)
            assert answer["park"]["parkable"] is False
        for route, found in results.items():
            assert found["under"] == "ok", (route, found)
            assert found["over"].startswith("OOM"), (route, found)


CLEARED_CHILD = (
    """
import json, subprocess, sys
code = '''
import json, time, cupy
from cupy.cuda import runtime
try:
    pointer = runtime.malloc(OVER); result = "ok"
    time.sleep(4)  # held long enough for the watchdog's samples
    runtime.free(pointer)
except runtime.CUDARuntimeError as error:
    result = "OOM " + str(error)[:120]
print(json.dumps({"over": result}))
'''.replace("OVER", str(%d))
done = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/local/bin:/usr/bin:/bin"}, capture_output=True, text=True, timeout=120)
print(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else json.dumps({"over": "error " + done.stderr[-300:]}))
"""
    % OVER
)


async def test_a_subprocess_that_clears_its_environment_is_caught_by_a_layer(jp_fetch, jp_serverapp):
    """A child with an empty environment finds no pipe directory: it is no MPS client of the managed
    daemon. What catches it is recorded: the driver (OOM) or, failing that, the watchdog."""
    kernel_id = await start_kernel(jp_fetch)
    found = last_json(await execute(jp_serverapp, kernel_id, CLEARED_CHILD, timeout=300))
    record("mps subprocess with a cleared environment, 20 GiB against a 16 GiB cap", found)
    if found["over"].startswith("OOM"):
        return
    assert found["over"] == "ok", found

    manager = jp_serverapp.web_app.settings[SETTINGS_KEY]

    def warned():
        action = manager.status.last_action(kernel_id)
        return action if action and action["action"] == "warn" else None

    action = await wait_for(warned, timeout=30)  # async: the monitor samples on this event loop
    record("mps cleared-environment child: caught by the watchdog instead", action)


ESCAPES = """
import json, os, subprocess, sys
code = '''
import json, cupy
from cupy.cuda import runtime
out = {}
for name, size in SIZES:
    try:
        runtime.free(runtime.malloc(size)); out[name] = "ok"
    except runtime.CUDARuntimeError as error:
        out[name] = "OOM"
print(json.dumps(out))
'''
def child(sizes, **changes):
    env = dict(os.environ)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    done = subprocess.run([sys.executable, "-c", code.replace("SIZES", repr(sizes))], env=env, capture_output=True, text=True, timeout=120)
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "error " + done.stderr[-300:]
G = 2**30
print(json.dumps({
    "limit variable removed (pipe kept)": child([("15 GiB", 15 * G), ("17 GiB", 17 * G)], CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=None),
    "limit variable raised to 0=100G": child([("15 GiB", 15 * G), ("17 GiB", 17 * G)], CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=100G"),
    "limit variable lowered to 0=4G": child([("3 GiB", 3 * G), ("6 GiB", 6 * G)], CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=4G"),
}))
"""


async def test_a_process_that_edits_its_limit_variable_stays_under_the_daemons_ceiling(jp_fetch, jp_serverapp):
    """The managed daemon's default limit is the largest hard limit policy can give (here max_cap 16 GiB
    + 640 MiB): a process that removes or raises CUDA_MPS_PINNED_DEVICE_MEM_LIMIT before its CUDA starts
    gets no more than that; one that lowers it gets less."""
    state = json.loads((await jp_fetch("api", "gpu-quota", "status")).body)["hard_cap"]
    record("mps managed daemon ceiling", {"ceiling": state["ceiling"], "problem": state["ceiling_problem"]})
    # One ceiling per device the daemon serves (every GPU of the machine), each the largest hard limit.
    assert state["ceiling"] and set(state["ceiling"].values()) == {LIMIT} and state["ceiling_problem"] is None
    kernel_id = await start_kernel(jp_fetch)
    found = last_json(await execute(jp_serverapp, kernel_id, ESCAPES, timeout=400))
    record("mps processes that edit their limit variable (ceiling 16.6 GiB)", found)
    assert json.loads(found["limit variable removed (pipe kept)"]) == {"15 GiB": "ok", "17 GiB": "OOM"}
    assert json.loads(found["limit variable raised to 0=100G"]) == {"15 GiB": "ok", "17 GiB": "OOM"}
    assert json.loads(found["limit variable lowered to 0=4G"]) == {"3 GiB": "ok", "6 GiB": "OOM"}


HOLD = """
import torch
held = torch.empty(10 * 2**30, dtype=torch.uint8, device="cuda"); held.fill_(1); torch.cuda.synchronize()
print("held")
"""


async def test_the_monitor_sees_an_mps_kernels_memory(jp_fetch, jp_serverapp):
    """The watchdog keeps running: does NVML still attribute an MPS client's memory to its kernel?"""
    import pynvml

    kernel_id = await start_kernel(jp_fetch)
    assert "held" in await execute(jp_serverapp, kernel_id, HOLD, timeout=300)
    pid = kernel_pid(jp_serverapp, kernel_id)
    monitor = jp_serverapp.web_app.settings[SETTINGS_KEY].monitor
    ticks = monitor.ticks
    await wait_for(lambda: monitor.ticks >= ticks + 3, timeout=30)
    state = json.loads((await jp_fetch("api", "gpu-quota", "kernels", kernel_id)).body)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(state["devices"][0]["index"])
    compute = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    try:
        mps = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)}
    except Exception as error:  # an older nvidia-ml-py
        mps = {"error": repr(error)}
    record(
        "mps kernel holding 10 GiB: status used, NVML compute list, NVML MPS list",
        {
            "kernel_pid": pid,
            "status_used": state["devices"][0]["used"],
            "compute": compute,
            "mps_compute": mps,
        },
    )
    assert pid in compute or pid in mps


async def test_a_restart_keeps_the_limit(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    malloc = (
        "import cupy\nfrom cupy.cuda import runtime\ntry:\n    runtime.free(runtime.malloc(%d)); print('ok')\nexcept "
        "runtime.CUDARuntimeError:\n    print('OOM')\n"
        % OVER
    )
    before = (await execute(jp_serverapp, kernel_id, malloc, timeout=300)).strip()
    await restart_kernel(jp_fetch, kernel_id)
    env = await kernel_env(jp_serverapp, kernel_id, MPS_VARIABLES)
    after = (await execute(jp_serverapp, kernel_id, malloc, timeout=300)).strip()
    record("mps 20 GiB malloc before / after restart", [before, after])
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={LIMIT // MiB}M"
    assert before == after == "OOM"


class TestTwoDevices:
    @pytest.fixture
    def jp_server_config(self):
        return hard_config(caps=[{"kernelspec": "two", "cap": "24GiB", "max_cap": "24GiB", "devices": 2}])

    @pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
    async def test_two_kernels_on_two_devices_each_with_its_own_limit(self, jp_fetch, jp_serverapp, jp_kernel_dir):
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "2 GPUs",
            "language": "python",
        }
        one = await start_kernel(jp_fetch)
        two = await start_kernel(jp_fetch, write_kernelspec(jp_kernel_dir, "two", spec))
        probe = (
            "import json, cupy\nfrom cupy.cuda import runtime\nout = {}\n"
            "for d in range(runtime.getDeviceCount()):\n"
            "    runtime.setDevice(d)\n"
            "    for name, size in SIZES:\n"
            "        try:\n            runtime.free(runtime.malloc(size)); out[f'{d} {name}'] = 'ok'\n"
            "        except runtime.CUDARuntimeError:\n            out[f'{d} {name}'] = 'OOM'\n"
            "print(json.dumps(out))\n"
        )
        small = last_json(
            await execute(
                jp_serverapp, one, probe.replace("SIZES", repr([("15 GiB", UNDER), ("19 GiB", 19 * GiB)])), timeout=300
            )
        )
        big = last_json(
            await execute(
                jp_serverapp,
                two,
                probe.replace("SIZES", repr([("23 GiB", 23 * GiB), ("27 GiB", 27 * GiB)])),
                timeout=300,
            )
        )
        record("mps two devices: 16 GiB kernel", small)
        record("mps two devices: 24 GiB x 2 kernel", big)
        assert small == {"0 15 GiB": "ok", "0 19 GiB": "OOM"}
        assert big == {"0 23 GiB": "ok", "0 27 GiB": "OOM", "1 23 GiB": "ok", "1 27 GiB": "OOM"}


class TestOff:
    @pytest.fixture
    def jp_server_config(self):
        return Config(
            {"ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}}, "GpuQuota": {"default_cap": "0.2"}}
        )

    async def test_off_changes_nothing(self, jp_fetch, jp_serverapp):
        kernel_id = await start_kernel(jp_fetch)
        env = await kernel_env(jp_serverapp, kernel_id, MPS_VARIABLES + ["GPU_QUOTA_LAYERS"])
        soft = (
            await execute(
                jp_serverapp,
                kernel_id,
                (
                    "import torch\ntotal = torch.cuda.get_device_properties(0).total_memory\nout = []\n"
                    "for f in (0.19, 0.21):\n    try:\n        x = torch.empty(int(f * total), dtype=torch.int8, "
                    "device='cuda'); del x; out.append('ok')\n"
                    "    except torch.OutOfMemoryError as e:\n        out.append('OOM (cap)' if 'allowed;' in str(e) "
                    "else 'OOM')\n    torch.cuda.empty_cache()\n"
                    "print(' | '.join(out))\n"
                ),
                timeout=300,
            )
        ).strip()
        record("hard_cap off: kernel MPS variables, 0.19 | 0.21 of the device", [env, soft])
        assert {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"} == {
            k: None for k in MPS_VARIABLES[1:] + ["GPU_QUOTA_LAYERS"]
        }
        assert soft == "ok | OOM (cap)"
        assert mps_processes() == {}


# --- whole servers as subprocesses: lifecycle, and a second Unix user --------------------------------


@pytest.fixture
def runtime(short_tmp):
    short_tmp.chmod(0o755)  # a second Unix user's server lives under it too
    directory = Path(tempfile.mkdtemp(dir=short_tmp))
    directory.chmod(0o755)
    return directory


def readline_within(process: subprocess.Popen, seconds: float) -> str:
    """The next line of the process's stdout, or "" when none came within `seconds` (never blocks longer)."""
    ready, _, _ = select.select([process.stdout], [], [], seconds)
    return process.stdout.readline() if ready else ""


CUDA_TOUCH = "import torch; x = torch.ones(1, device='cuda'); torch.cuda.synchronize(); print('cuda ok', flush=True)"


def test_the_managed_daemon_is_gone_after_the_server_stops(runtime):
    server = Server(runtime, ["--GpuQuota.hard_cap=mps", "--GpuQuota.default_cap=16GiB", "--GpuQuota.max_cap=16GiB"])
    try:
        server.wait_serving(timeout=120)
        pipe = server.api("/api/gpu-quota/status")["hard_cap"]["pipe_directory"]
        daemon = int((Path(pipe) / "nvidia-cuda-mps-control.pid").read_text())
        kernel = server.api("/api/kernels", "POST", {"name": "python3"})
        assert "cuda ok" in server.run(kernel["id"], CUDA_TOUCH, timeout=180)
        from gpu_quota_ext.hard_limit.mps import server_list

        servers = server_list(CONTROL, pipe, 10)
        record("mps processes while a kernel uses CUDA", {"daemon": daemon, "servers": servers, "all": mps_processes()})
        assert alive(daemon) and servers
        began = time.perf_counter()
        server.process.send_signal(signal.SIGTERM)
        server.exit_code(timeout=120)
        wait_until(lambda: not alive(daemon) and not any(alive(p) for p in servers), timeout=60)
        record("mps daemon and server gone after SIGTERM of the server, s", round(time.perf_counter() - began, 2))
        assert not Path(pipe).exists()
        assert not [p for p in mps_processes() if p in servers or p == daemon]
    finally:
        server.kill()


def test_a_second_users_kernel_starts_without_the_hard_layer_and_does_not_hang(runtime):
    """An admin's daemon (external, world-reachable pipe directory) whose MPS server runs for root; a
    second server, run by another Unix user against it: its kernel must start soft-only and use CUDA."""
    uid = other_user()
    if uid is None or shutil.which("runuser") is None:
        pytest.skip("needs root, useradd and runuser")
    shared = runtime / "shared-mps"
    for directory in (shared, runtime / "shared-log"):
        directory.mkdir()
        directory.chmod(0o777)
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(shared), CUDA_MPS_LOG_DIRECTORY=str(runtime / "shared-log"))
    subprocess.run([CONTROL, "-d"], env=env, check=True, timeout=30)
    holder = subprocess.Popen(
        [sys.executable, "-c", CUDA_TOUCH + "; import time; time.sleep(600)"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    user_runtime = runtime / "other-user"
    user_runtime.mkdir()
    shutil.chown(user_runtime, user=uid)
    server = None
    try:
        assert readline_within(holder, 120).strip() == "cuda ok"  # root's client holds the MPS server
        from gpu_quota_ext.hard_limit.mps import process_owner, server_list

        owners = {pid: process_owner(pid) for pid in server_list(CONTROL, str(shared), 10)}
        record("mps shared daemon: server owners", owners)
        assert set(owners.values()) == {0}
        server = Server(
            user_runtime,
            [
                "--GpuQuota.hard_cap=auto",
                "--GpuQuota.mps_daemon=external",
                "--GpuQuota.default_cap=16GiB",
                "--GpuQuota.mps_timeout=5",
            ],
            {
                "CUDA_MPS_PIPE_DIRECTORY": str(shared),
                "JUPYTER_DATA_DIR": str(user_runtime / "data"),
                "IPYTHONDIR": str(user_runtime / "ipython"),
            },
            # runuser sets HOME to the user's (absent) home: give it one it can write.
            prefix=["runuser", "-u", "gq-mps-other", "--", "env", f"HOME={user_runtime}"],
        )
        server.wait_serving(timeout=120)
        hard_cap = server.api("/api/gpu-quota/status")["hard_cap"]
        kernel = server.api("/api/kernels", "POST", {"name": "python3"}, timeout=120)
        layers = server.api(f"/api/gpu-quota/kernels/{kernel['id']}")["layers"]
        record("mps second user: server state, kernel layers", {"hard_cap": hard_cap, "layers": layers})
        assert layers["hard_limit"] is None and layers["hard_reason"]
        began = time.perf_counter()
        out = server.run(kernel["id"], CUDA_TOUCH, timeout=180)  # not hung: it is no MPS client
        record("mps second user's kernel: first CUDA use, s", round(time.perf_counter() - began, 2))
        assert "cuda ok" in out
    except BaseException:
        if server is not None:
            record("mps second user: its server's log (tail)", "".join(server.lines)[-6000:])
        raise
    finally:
        if server is not None:
            server.kill()
        holder.kill()
        holder.wait()
        try:
            subprocess.run([CONTROL], input="quit\n", env=env, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            pass
