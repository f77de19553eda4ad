"""Issue 28 on a real GPU: a kernel lost while parked is told. A torch kernel holding 4 GiB is parked by the real
checkpoint driver, then its process is killed (SIGKILL, as the host's out-of-memory killer does); jupyter_server's
restarter starts it again under the same id. The status says the kernel was lost and why, nothing of the dead
process stays on the device or in the host account, and the next cell says it once, on stderr, with the user's
own output alone on stdout. Prints `FIGURE` lines (conftest.record). About a minute on the H200.

    python -m pytest tests/gpu/test_park_lost_gpu.py -m gpu -s
"""

import asyncio
import os
import signal
import time

import pytest
from traitlets.config import Config

from ..integration.fake_gpu import manager_of
from ..integration.kernels import execute, run_cell, shutdown_kernel, start_kernel
from .conftest import kernel_pid, nvml_used_by_pid, record
from .test_park_gpu import HOLD, gone, park, park_of, seen_on_gpu

pytestmark = pytest.mark.gpu

GiB = 1 << 30
WAIT = 120.0  # seconds: a deadline for the restarter and the status, not a threshold
SAID = "gpu-quota: this kernel was restarted at "


@pytest.fixture
def jp_server_config():
    # The real inventory, NVML and checkpoint driver; the restarter polls every half second.
    return Config(
        {
            "ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}},
            "GpuQuota": {"default_cap": "0.2", "max_cap": "1.0", "poll_interval": 0.5, "fast_park": "off"},
            "KernelRestarter": {"time_to_dead": 0.5},
        }
    )


async def until(check, what: str, timeout: float = WAIT):
    """Poll `check` (sync or async) until it gives something true; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)


async def test_a_parked_kernel_killed_on_the_gpu_is_told_once_and_leaves_nothing_behind(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    pid = kernel_pid(jp_serverapp, kernel_id)
    await execute(jp_serverapp, kernel_id, "y = 41", timeout=60)
    await execute(jp_serverapp, kernel_id, HOLD.format(n=4 * GiB), timeout=180)
    await seen_on_gpu(jp_serverapp, kernel_id, [pid], 4 * GiB)
    _, parked = await park(jp_fetch, kernel_id)
    assert parked["host_bytes"] >= 4 * GiB, parked
    assert nvml_used_by_pid().get(pid, 0) == 0

    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)  # what the host's out-of-memory killer does to the largest process

    async def lost():
        return (await park_of(jp_fetch, kernel_id))["lost"]

    notice = await until(lost, "the status says the kernel was lost")
    record("lost while parked: kill to the status saying so, s", round(time.perf_counter() - killed, 3))
    assert "killed by SIGKILL" in notice["why"], notice
    assert notice["words"].startswith(SAID), notice
    await until(lambda: gone(pid), "the killed process is gone")

    manager = jp_serverapp.kernel_manager.get_kernel(kernel_id)
    await until(
        lambda: getattr(manager.provisioner, "process", None) is not None
        and manager.provisioner.process.pid != pid
        and manager.ready.done(),
        "the restarter started a new process",
    )
    record("lost while parked: kill to a new process, s", round(time.perf_counter() - killed, 3))
    parker = manager_of(jp_serverapp).parker
    await until(lambda: kernel_id not in parker.host_account.kernels(), "the host account holds nothing for it")
    assert pid not in nvml_used_by_pid()

    ran = await run_cell(jp_serverapp, kernel_id, "print('mine'); print(globals().get('y'))", timeout=120)
    record("lost while parked: the next cell's stderr", ran["stderr"].strip())
    assert ran["status"] == "ok", ran
    assert ran["stdout"] == "mine\nNone\n", ran  # the user's own output only; the variables are gone
    assert ran["stderr"] == notice["words"] + "\n", ran  # once, on stderr, before the cell's code

    async def said():
        return (await park_of(jp_fetch, kernel_id))["lost"] is None

    await until(said, "the status drops the notice once the cell has said it")
    again = await run_cell(jp_serverapp, kernel_id, "print('again')", timeout=60)
    assert again["stdout"] == "again\n" and again["stderr"] == "", again  # said once, never again
    await shutdown_kernel(jp_fetch, kernel_id)
