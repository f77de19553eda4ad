"""Issue 4 on a real GPU: the watchdog catches a CuPy allocation the in-process caps do not stop, and the
status API's `used` agrees with nvidia-smi.

    python -m pytest tests/gpu/test_watchdog_gpu.py -m gpu -s
Prints `FIGURE` lines (see conftest.record): time from the allocation to the action, and API vs nvidia-smi.
"""

import json
import subprocess
import time

import pytest
from traitlets.config import Config

from ..integration.fake_gpu import next_samples
from ..integration.kernels import execute, start_kernel
from .conftest import kernel_pid, record

pytestmark = pytest.mark.gpu

POLL = 1.0  # the default poll interval: the figures are what an admin gets out of the box

# The user undoes CuPy's limit (what layer 1 cannot prevent), then takes 0.3 of the device: cap is 0.2.
# The timestamps go to a file, not stdout: a restart or kill may land before the cell's output is sent.
# The cell then keeps running, as a training loop holding its memory would, so strong actions meet a busy kernel.
OVER_CAP = """
import os, time
os.environ.pop("CUPY_GPU_MEMORY_LIMIT", None)
import cupy
total = cupy.cuda.runtime.memGetInfo()[1]
cupy.get_default_memory_pool().set_limit(size=0)  # 0 = no limit
began = time.time()
hog = cupy.empty(int(0.3 * total), dtype=cupy.uint8)
hog.fill(1)
cupy.cuda.runtime.deviceSynchronize()
with open({stamp!r}, "w") as out:
    out.write(f"{{began}} {{time.time()}}")
time.sleep({hold})
"""

WITHIN_CAP = """
import cupy
held = cupy.empty(int({fraction} * cupy.cuda.runtime.memGetInfo()[1]), dtype=cupy.uint8)
held.fill(1)
cupy.cuda.runtime.deviceSynchronize()
print("held")
"""


def server_config(enforce: str) -> Config:
    # Real inventory and real NVML: the defaults.
    return Config(
        {
            "ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}},
            "GpuQuota": {"default_cap": "0.2", "enforce": enforce, "poll_interval": POLL},
        }
    )


@pytest.fixture
def enforce():
    return "warn"


@pytest.fixture
def jp_server_config(enforce):
    return server_config(enforce)


async def status(jp_fetch) -> dict:
    return json.loads((await jp_fetch("api", "gpu-quota", "status")).body)


async def wait_for_action(jp_fetch, kernel_id, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = await status(jp_fetch)
        done = [a for a in state["actions"] if a["kernel_id"] == kernel_id and a["outcome"] != "pending"]
        if done:
            return done[0], state
        await _sleep(0.05)
    raise AssertionError(f"no watchdog action on kernel {kernel_id} within {timeout} s")


async def _sleep(seconds):
    import asyncio

    await asyncio.sleep(seconds)


def smi_used_by_pid() -> dict:
    """pid -> bytes, from nvidia-smi's per-process figure (MiB)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout
    used = {}
    for line in out.strip().splitlines():
        pid, mib = (part.strip() for part in line.split(","))
        used[int(pid)] = used.get(int(pid), 0) + int(mib) * (1 << 20)
    return used


@pytest.mark.parametrize("enforce", ["warn", "interrupt", "restart", "kill"])
async def test_watchdog_catches_cupy_over_its_cap(jp_fetch, jp_serverapp, enforce, tmp_path):
    import asyncio

    kernel_id = await start_kernel(jp_fetch)
    pid = kernel_pid(jp_serverapp, kernel_id)
    stamp = tmp_path / "allocated"
    hold = 0 if enforce == "warn" else 60
    cell = asyncio.ensure_future(
        execute(jp_serverapp, kernel_id, OVER_CAP.format(stamp=str(stamp), hold=hold), timeout=180)
    )
    action, state = await wait_for_action(jp_fetch, kernel_id, timeout=120)
    for _ in range(50):  # the cell writes it a few ms after the memory shows in NVML
        if stamp.exists() and stamp.read_text():
            break
        await _sleep(0.1)
    record(f"{enforce}: cap bytes", action["cap"])
    record(f"{enforce}: used at action (NVML) bytes", action["used"])
    record(f"{enforce}: outcome", action["outcome"])
    assert action["action"] == enforce and action["outcome"] == "done"
    assert action["used"] > action["limit"] > action["cap"]
    if stamp.exists() and stamp.read_text():
        began, allocated = map(float, stamp.read_text().split())
        record(f"{enforce}: seconds from allocation done to action", round(action["time"] - allocated, 3))
        record(f"{enforce}: seconds from allocation start to action", round(action["time"] - began, 3))
        # How soon is a figure (recorded above), not a pass condition: a busy machine delays any poll.
    else:  # acted between the allocation and the write: sooner than any timing could show
        record(f"{enforce}: seconds from allocation done to action", "under a few ms (before the cell's next line)")
    if enforce == "warn":
        await asyncio.wait_for(cell, 60)  # the cell finishes undisturbed
    elif enforce == "interrupt":
        with pytest.raises(AssertionError, match="KeyboardInterrupt"):
            await asyncio.wait_for(cell, 30)
    else:  # the process that ran the cell is gone: no reply will come
        cell.cancel()
        deadline = time.monotonic() + 30
        while pid in smi_used_by_pid() and time.monotonic() < deadline:
            await _sleep(0.1)
        record(f"{enforce}: memory released (pid gone from nvidia-smi)", pid not in smi_used_by_pid())
        assert pid not in smi_used_by_pid()
    if enforce == "kill":
        assert kernel_id not in jp_serverapp.kernel_manager.list_kernel_ids()
    else:
        assert (await execute(jp_serverapp, kernel_id, "print('alive')", timeout=60)).strip() == "alive"
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


async def test_status_used_matches_nvidia_smi(jp_fetch, jp_serverapp):
    kernels = []
    for fraction in (0.05, 0.1):
        kernel_id = await start_kernel(jp_fetch)
        assert (
            await execute(jp_serverapp, kernel_id, WITHIN_CAP.format(fraction=fraction), timeout=180)
        ).strip() == "held"
        kernels.append(kernel_id)
    await next_samples(jp_serverapp, 2)  # two fresh samples
    state = await status(jp_fetch)
    smi = smi_used_by_pid()
    by_id = {k["id"]: k for k in state["kernels"]}
    for kernel_id in kernels:
        api_used = by_id[kernel_id]["devices"][0]["used"]
        smi_used = smi.get(kernel_pid(jp_serverapp, kernel_id))
        record(f"kernel {kernel_id[:8]} used: status API / nvidia-smi bytes", f"{api_used} / {smi_used}")
        assert smi_used, "nvidia-smi lists the kernel's process"
        assert abs(api_used - smi_used) <= 0.01 * smi_used
    device = state["devices"][0]
    record("device used (status API) bytes", device["used"])
    record("monitor state", state["monitor"]["state"])
    assert state["monitor"]["state"] == "ok"
    for kernel_id in kernels:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")
