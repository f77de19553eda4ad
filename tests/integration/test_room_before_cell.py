"""Room before the cell needs it, on a real server with real kernels, the fake NVML and the fake checkpoint driver:
under overcommit, a kernel under its cap whose headroom idle kernels hold is told so on its control channel; its
next cell waits, before any of its code runs, while the broker parks the idle kernel, says why it waited, and
then runs. Where the kernel has its room the cell says nothing more, and a server with park_on_device_full off
tells no kernel anything."""

import asyncio
import time

import pytest

from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
from gpu_quota_ext.shared.sizes import GiB

from .fake_gpu import fake_gpu_config, manager_of, next_samples, wait_for
from .kernels import execute, run_cell, start_kernel
from .test_park import BROKER, WAIT, calls, holding_gpu, park_state, parker_of

ROOM = {**BROKER, "park_on_device_full": "on"}


@pytest.fixture
def jp_server_config(park):
    """test_park.py's server, with the parking settings each test gives (@pytest.mark.parametrize("park", ...))."""
    return fake_gpu_config("warn", **park)


async def a_idle_holding_most_of_the_device(jp_fetch, jp_serverapp):
    """A (idle longest) and C hold 6 GiB each of GPU 0's 16; B holds 2 GiB of its 7 GiB cap: B's 5 GiB of headroom
    has 16 - 14 - 1 (margin) = 1 GiB free, and parking A would give 6."""
    a, c, b = await start_kernel(jp_fetch), await start_kernel(jp_fetch), await start_kernel(jp_fetch)
    for kernel_id in (a, c, b):
        await execute(jp_serverapp, kernel_id, "x = 1")  # the bootstrap has run: it answers on its control channel
    a_pid = await holding_gpu(jp_serverapp, a, 6 * GiB)
    await holding_gpu(jp_serverapp, c, 6 * GiB)
    await holding_gpu(jp_serverapp, b, 2 * GiB)
    return a, a_pid, b, c


@pytest.mark.parametrize("park", [ROOM])
async def test_a_cell_under_its_cap_waits_for_the_idle_kernel_to_park_says_why_and_then_runs(
    jp_fetch, jp_serverapp, full_devices
):
    a, a_pid, b, c = await a_idle_holding_most_of_the_device(jp_fetch, jp_serverapp)
    parker = parker_of(jp_serverapp)
    await wait_for(lambda: parker.room_flags.told.get(b) == (0, True), timeout=WAIT)  # B: short on GPU 0
    assert parker.room_flags.told.get(a) is None and parker.room_flags.told.get(c) is None
    release = FakeCheckpoint.hang("cuCheckpointProcessCheckpoint")  # A's park takes a while: B's cell says why
    cell = asyncio.ensure_future(run_cell(jp_serverapp, b, "print('ran', x)"))

    def b_waited():
        record = parker.records.get(b)
        asked = record.room_asked if record is not None and record.room_need else None
        return asked is not None and time.time() - asked >= 1.6

    await wait_for(b_waited, timeout=WAIT)
    assert (await park_state(jp_fetch, a))["state"] == "parking"
    assert not cell.done()  # none of B's code has run: it waits for A's park
    release.set()
    ran = await cell
    assert ran["status"] == "ok" and ran["stdout"] == "ran 1\n", ran
    said = ran["stderr"].splitlines()
    assert said[0].startswith("gpu-quota: waiting for room before the cell runs (at most 5 min): idle kernels hold"), (
        said
    )
    assert f"needs 5.0 GiB on GPU 0; making room: idle kernel kernel {a[:8]} pa" in said[0], said
    assert said[-1].startswith("gpu-quota: room made after ") and said[-1].endswith("; the cell runs now"), said
    assert (await park_state(jp_fetch, a))["state"] == "parked" and calls("cuCheckpointProcessCheckpoint") == [a_pid]
    assert (await park_state(jp_fetch, c))["state"] in ("idle", "busy")  # one park was enough
    # B has its room now: it is told so, and its next cell says nothing more.
    await wait_for(lambda: parker.room_flags.told.get(b) == (None, False), timeout=WAIT)
    again = await run_cell(jp_serverapp, b, "print('ran', x + 1)")
    assert again == {"status": "ok", "stdout": "ran 2\n", "stderr": "", "error": ""}, again
    assert FakeCheckpoint.broken == set()


@pytest.mark.parametrize("park", [{**BROKER, "park_on_device_full": "off"}])
async def test_with_park_on_device_full_off_no_kernel_is_told_and_a_cell_adds_nothing(
    jp_fetch, jp_serverapp, full_devices
):
    a, _, b, _ = await a_idle_holding_most_of_the_device(jp_fetch, jp_serverapp)
    await next_samples(jp_serverapp, 3)
    assert parker_of(jp_serverapp).room_flags.told == {}
    ran = await run_cell(jp_serverapp, b, "print('ran', x)")
    assert ran == {"status": "ok", "stdout": "ran 1\n", "stderr": "", "error": ""}, ran
    assert (await park_state(jp_fetch, a))["state"] in ("idle", "busy") and FakeCheckpoint.calls == []


@pytest.mark.parametrize("park", [ROOM])
async def test_a_kernel_whose_room_a_process_outside_the_quota_holds_is_not_told_to_wait(
    jp_fetch, jp_serverapp, full_devices
):
    b = await start_kernel(jp_fetch)
    await execute(jp_serverapp, b, "x = 1")
    await holding_gpu(jp_serverapp, b, 2 * GiB)
    FakeNvml.other_used = {"static-0": 12 * GiB}  # nothing to park could free it: waiting would be for nothing
    await next_samples(jp_serverapp, 3)
    assert parker_of(jp_serverapp).room_flags.told == {}
    ran = await run_cell(jp_serverapp, b, "print('ran', x)")
    assert ran == {"status": "ok", "stdout": "ran 1\n", "stderr": "", "error": ""}, ran
    assert manager_of(jp_serverapp).parker.records.get(b) is None  # it asked for no room


@pytest.mark.parametrize("park", [ROOM])
async def test_a_flag_sent_while_a_notebook_client_starts_a_cell_takes_none_of_its_output(
    jp_fetch, jp_serverapp, full_devices
):
    # Clients of one kernel manager share a session id; with it, the flag's message ids were the notebook client's,
    # and the kernel's busy and idle for one were taken for the other's: the cell's output never came.
    b = await start_kernel(jp_fetch)
    await execute(jp_serverapp, b, "x = 1")
    flags = parker_of(jp_serverapp).room_flags
    for i in range(4):
        for delay in (0, 0.002, 0.005, 0.01, 0.02):

            async def push(delay, device):
                await asyncio.sleep(delay)
                await flags.tell(b, device, False)

            cell = run_cell(jp_serverapp, b, "print('ran', x)", timeout=10)
            ran, _ = await asyncio.gather(cell, push(delay, None if i % 2 else 1))
            assert ran["stdout"] == "ran 1\n", (i, delay, ran)
