"""Parking on a real server with real kernels, the driver faked (gpu_quota_ext.parking.fake_checkpoint, tied to the
fake NVML: a parked process shows 0 B, and a restore into a full device breaks the process for good, as the
real driver does). What a user and an admin see: the idle timer parks, a cell resumes, the routes answer, the
broker parks idle kernels to make room for a resume and never restores into a full device, a cell that waits
says why in the notebook and ends at the limit, a failed restore is said plainly, refusals say why, restart /
shutdown / interrupt of a parked kernel work and leave nothing behind, a hung driver call hangs nothing."""

import asyncio
import dataclasses
import json
import logging
import re

import psutil
import pytest
from tornado.httpclient import HTTPClientError

from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
from gpu_quota_ext.shared.contract import KERNEL_TOKEN_HEADER, PARK_FIELDS
from gpu_quota_ext.shared.sizes import GiB

from .fake_gpu import fake_gpu_config, kernel_entry, kernel_pid, manager_of, next_samples, status, uses_gpu, wait_for
from .kernels import (
    execute,
    restart_kernel,
    run_cell,
    shutdown_kernel,
    start_child_process,
    start_kernel,
)

FAKE_DRIVER = "gpu_quota_ext.parking.fake_checkpoint.FakeCheckpoint"
WAIT = 30.0  # seconds a state may take to come on a busy 2-core machine (a deadline, not a threshold)


@pytest.fixture
def park():
    """GpuQuota settings of the test's server; a test overrides it with @pytest.mark.parametrize("park", ...)."""
    return {"checkpoint_class": FAKE_DRIVER}


@pytest.fixture
def jp_server_config(park):
    return fake_gpu_config("warn", **park)


def parker_of(serverapp):
    return manager_of(serverapp).parker


async def park_state(jp_fetch, kernel_id) -> dict:
    return kernel_entry(await status(jp_fetch), kernel_id)["park"]


async def wait_state(jp_fetch, kernel_id, *states, timeout=WAIT) -> dict:
    async def check():
        park = await park_state(jp_fetch, kernel_id)
        return park if park["state"] in states else None

    return await wait_for(check, timeout=timeout)


async def holding_gpu(serverapp, kernel_id, nbytes=2 * GiB, pid=None) -> int:
    """The kernel's process 'uses' nbytes on its device (fake NVML) and the parker has seen it."""
    pid, _ = await uses_gpu(serverapp, kernel_id, nbytes, pid)
    parker, monitor = parker_of(serverapp), manager_of(serverapp).monitor
    await wait_for(lambda: pid in monitor.gpu_pids(kernel_id) and parker.driver_problem is None, timeout=WAIT)
    return pid


async def post(jp_fetch, kernel_id, action, body="{}", headers=None):
    response = await jp_fetch(
        "api", "gpu-quota", "kernels", kernel_id, action, method="POST", body=body, headers=headers or {}
    )
    return response.code, json.loads(response.body)


async def post_error(jp_fetch, kernel_id, action, body="{}", headers=None):
    with pytest.raises(HTTPClientError) as error:
        await post(jp_fetch, kernel_id, action, body, headers)
    return error.value.code, json.loads(error.value.response.body)


def calls(name):
    return [pid for call, pid in FakeCheckpoint.calls if call == name]


# --- on demand ----------------------------------------------------------------------------------------


async def test_park_route_moves_the_memory_to_the_host_and_resume_brings_it_back(jp_fetch, jp_serverapp, fake_driver):
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "x = 41")
    pid = await holding_gpu(jp_serverapp, kernel_id)
    grant = manager_of(jp_serverapp).ledger.get(kernel_id)
    before = await park_state(jp_fetch, kernel_id)
    assert set(before) == set(PARK_FIELDS) and before["state"] == "idle" and before["parkable"] is True

    code, answer = await post(jp_fetch, kernel_id, "park")
    assert code == 202 and answer["park"]["state"] in ("parking", "parked")
    parked = await wait_state(jp_fetch, kernel_id, "parked")
    assert parked["host_bytes"] == 2 * GiB and parked["parkable"] is True
    assert pid not in FakeNvml.usage  # NVML: 0 B for the parked process
    assert FakeCheckpoint.parked_pids() == {pid: {f"static-{grant.devices[0]}": 2 * GiB}}
    assert manager_of(jp_serverapp).ledger.get(kernel_id).caps == grant.caps  # the grant is kept

    code, answer = await post(jp_fetch, kernel_id, "park")  # again: nothing more to do
    assert code == 202 and answer["park"]["state"] == "parked"

    code, answer = await post(jp_fetch, kernel_id, "resume", body="")
    assert code == 202
    back = await wait_state(jp_fetch, kernel_id, "idle")
    assert back["host_bytes"] is None
    assert FakeNvml.usage[pid] and FakeCheckpoint.parked_pids() == {}
    assert calls("cuCheckpointProcessUnlock") == [pid]  # locked through the park, unlocked once restored
    assert (await execute(jp_serverapp, kernel_id, "print(x + 1)")).strip() == "42"


async def test_every_cuda_process_of_the_kernel_parks_and_resumes_together(jp_fetch, jp_serverapp, fake_driver):
    kernel_id = await start_kernel(jp_fetch)
    child = await start_child_process(jp_serverapp, kernel_id)
    pid = await holding_gpu(jp_serverapp, kernel_id)
    await holding_gpu(jp_serverapp, kernel_id, GiB, pid=child)
    await post(jp_fetch, kernel_id, "park")
    parked = await wait_state(jp_fetch, kernel_id, "parked")
    assert parked["host_bytes"] == 3 * GiB
    assert set(FakeCheckpoint.parked_pids()) == {pid, child}
    # All locked before any is checkpointed.
    order = [call for call, _ in FakeCheckpoint.calls]
    assert order[:4] == ["cuCheckpointProcessLock"] * 2 + ["cuCheckpointProcessCheckpoint"] * 2
    await post(jp_fetch, kernel_id, "resume")
    await wait_state(jp_fetch, kernel_id, "idle")
    assert set(FakeNvml.usage) >= {pid, child}


async def test_a_cell_sent_to_a_parked_kernel_resumes_it_and_runs(jp_fetch, jp_serverapp, fake_driver):
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "x = 41")
    pid = await holding_gpu(jp_serverapp, kernel_id)
    await post(jp_fetch, kernel_id, "park")
    await wait_state(jp_fetch, kernel_id, "parked")
    assert (await execute(jp_serverapp, kernel_id, "print(x + 1)")).strip() == "42"
    await wait_state(jp_fetch, kernel_id, "idle", "busy")
    assert calls("cuCheckpointProcessRestore") == [pid]
    assert pid in FakeNvml.usage


async def test_park_while_a_cell_runs_waits_for_the_cell_to_finish(jp_fetch, jp_serverapp, fake_driver, tmp_path):
    kernel_id = await start_kernel(jp_fetch)
    await holding_gpu(jp_serverapp, kernel_id)
    go = tmp_path / "go"
    cell = asyncio.ensure_future(
        execute(
            jp_serverapp,
            kernel_id,
            f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)\nprint('done')",
        )
    )
    km = jp_serverapp.kernel_manager.get_kernel(kernel_id)
    await wait_for(lambda: km.execution_state == "busy", timeout=WAIT)
    code, answer = await post(jp_fetch, kernel_id, "park")
    assert code == 202 and answer["park"]["state"] == "pending"
    assert calls("cuCheckpointProcessLock") == []  # nothing parks under a running cell
    go.write_text("")
    assert (await cell).strip() == "done"
    await wait_state(jp_fetch, kernel_id, "parked")


async def test_resume_calls_off_a_pending_park(jp_fetch, jp_serverapp, fake_driver, tmp_path):
    kernel_id = await start_kernel(jp_fetch)
    await holding_gpu(jp_serverapp, kernel_id)
    go = tmp_path / "go"
    cell = asyncio.ensure_future(
        execute(jp_serverapp, kernel_id, f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)")
    )
    km = jp_serverapp.kernel_manager.get_kernel(kernel_id)
    await wait_for(lambda: km.execution_state == "busy", timeout=WAIT)
    assert (await post(jp_fetch, kernel_id, "park"))[1]["park"]["state"] == "pending"
    assert (await post(jp_fetch, kernel_id, "resume"))[1]["park"]["state"] == "busy"
    go.write_text("")
    await cell
    await wait_for(lambda: km.execution_state == "idle", timeout=WAIT)
    await next_samples(jp_serverapp, 2)
    assert (await park_state(jp_fetch, kernel_id))["state"] == "idle"
    assert FakeCheckpoint.calls == []


# --- the routes' authorization and bodies ------------------------------------------------------------


async def test_a_kernel_may_park_itself_with_its_secret_but_not_another(jp_fetch, jp_serverapp, fake_driver):
    mine, other = await start_kernel(jp_fetch), await start_kernel(jp_fetch)
    await holding_gpu(jp_serverapp, mine)
    service = manager_of(jp_serverapp)
    code, answer = await post(jp_fetch, mine, "park", headers={KERNEL_TOKEN_HEADER: service.token_for(mine)})
    assert code == 202
    await wait_state(jp_fetch, mine, "parked")
    for action in ("park", "resume"):
        code, error = await post_error(jp_fetch, mine, action, headers={KERNEL_TOKEN_HEADER: service.token_for(other)})
        assert code == 403 and "does not belong" in error["message"]
    assert (await park_state(jp_fetch, mine))["state"] == "parked"  # nothing changed


@pytest.mark.parametrize("body", ['{"now": true}', "[]", '"park"', "not json", "1"])
async def test_bad_bodies_are_refused_and_change_nothing(jp_fetch, jp_serverapp, fake_driver, body):
    kernel_id = await start_kernel(jp_fetch)
    code, error = await post_error(jp_fetch, kernel_id, "park", body=body)
    assert code == 400 and error["message"]
    assert FakeCheckpoint.calls == [] and parker_of(jp_serverapp).records == {}


async def test_host_bytes_are_what_the_kernel_holds_when_it_parks_not_the_sample_before(
    jp_fetch, jp_serverapp, fake_driver
):
    # The GPU run: a 20 GiB tensor made just before the park; the server said 14 MiB (the sample before
    # the tensor existed) while NVML showed 19.97 GB returned. The park reads the kernel's usage again.
    kernel_id = await start_kernel(jp_fetch)
    pid = await holding_gpu(jp_serverapp, kernel_id, nbytes=14 * 1024 * 1024)
    monitor = manager_of(jp_serverapp).monitor
    await wait_for(lambda: sum(monitor.latest.kernels.get(kernel_id, {}).values()) == 14 * 1024 * 1024, timeout=WAIT)
    device = manager_of(jp_serverapp).ledger.get(kernel_id).devices[0]
    FakeNvml.set_usage(pid, f"static-{device}", 6 * GiB)  # the tensor, made right before the request
    code, _ = await post(jp_fetch, kernel_id, "park")
    assert code == 202
    parked = await wait_state(jp_fetch, kernel_id, "parked")
    moved = sum(FakeCheckpoint.parked_pids()[pid].values())
    assert moved == 6 * GiB and parked["host_bytes"] == moved


async def test_unknown_kernel_is_404(jp_fetch, fake_driver):
    for action in ("park", "resume"):
        code, error = await post_error(jp_fetch, "no-such-kernel", action)
        assert code == 404 and "no-such-kernel" in error["message"]


# --- refusals, with reasons ---------------------------------------------------------------------------


async def test_a_kernel_without_gpu_memory_is_refused_with_the_reason(jp_fetch, jp_serverapp, fake_driver):
    kernel_id = await start_kernel(jp_fetch)
    await next_samples(jp_serverapp, 2)
    park = await park_state(jp_fetch, kernel_id)
    assert park["parkable"] is False and park["reason"] == "this kernel holds no GPU memory"
    code, answer = await post_error(jp_fetch, kernel_id, "park")
    assert code == 409 and answer["message"] == "this kernel holds no GPU memory" and answer["park"]["state"] == "idle"
    assert FakeCheckpoint.calls == []


async def test_an_mps_client_the_driver_refuses_with_801_stays_running_with_the_reason(
    jp_fetch, jp_serverapp, fake_driver, caplog
):
    kernel_id = await start_kernel(jp_fetch)
    pid = await holding_gpu(jp_serverapp, kernel_id)
    FakeCheckpoint.refuse(801)
    caplog.set_level(logging.INFO, "gpu_quota_ext")
    await post(jp_fetch, kernel_id, "park")

    async def refused():
        park = await park_state(jp_fetch, kernel_id)
        return park if park["state"] == "idle" and park["reason"] else None

    park = await wait_for(refused, timeout=WAIT)
    assert "MPS" in park["reason"] and "CUDA_ERROR_NOT_SUPPORTED" in park["reason"]
    assert pid in FakeNvml.usage  # still on the GPU, untouched
    assert (await execute(jp_serverapp, kernel_id, "print(6 * 7)")).strip() == "42"


async def test_another_users_process_is_refused_and_the_kernel_keeps_running(jp_fetch, jp_serverapp, fake_driver):
    kernel_id = await start_kernel(jp_fetch)
    pid = await holding_gpu(jp_serverapp, kernel_id)
    FakeCheckpoint.foreign.add(pid)
    await post(jp_fetch, kernel_id, "park")

    async def refused():
        park = await park_state(jp_fetch, kernel_id)
        return park if park["reason"] and "another Unix user" in park["reason"] else None

    park = await wait_for(refused, timeout=WAIT)
    assert park["state"] == "idle"
    assert all(call == "cuCheckpointProcessLock" for call, _ in FakeCheckpoint.calls)


@pytest.mark.parametrize("park", [{"checkpoint_class": FAKE_DRIVER, "park_host_margin": "4GiB"}])
async def test_host_memory_run_short_stops_parking_and_brings_parked_kernels_back_largest_first(
    jp_fetch, jp_serverapp, fake_driver
):
    # Another program takes the host's memory while kernels are parked (no CI machine can be made to run out of
    # memory, so the parker's reading of the host is what the test sets; everything else is the real server).
    small, large = await start_kernel(jp_fetch), await start_kernel(jp_fetch)
    await holding_gpu(jp_serverapp, small, 1 * GiB)
    await holding_gpu(jp_serverapp, large, 3 * GiB)
    for kernel_id in (small, large):
        assert (await post(jp_fetch, kernel_id, "park"))[0] == 202
        await wait_state(jp_fetch, kernel_id, "parked")
    answer = await status(jp_fetch)
    assert answer["host_memory"]["short"] is False and answer["host_memory"]["parked"] == 4 * GiB
    parker = parker_of(jp_serverapp)
    real_host = parker.host
    parker.host = lambda: (GiB, None)  # below half the margin
    try:
        await wait_state(jp_fetch, large, "idle")
        await wait_state(jp_fetch, small, "idle")
        host = (await status(jp_fetch))["host_memory"]
        assert host["short"] is True and host["short_episodes"] == 1 and "host memory is short" in host["reason"]
        restores = calls("cuCheckpointProcessRestore")
        assert restores[0] == await kernel_pid(jp_serverapp, large), restores  # the largest came back first
        metrics = (await jp_fetch("metrics", method="GET")).body.decode()
        assert "gpu_quota_host_memory_short 1.0" in metrics
        assert "gpu_quota_host_memory_short_episodes_total 1.0" in metrics
        code, refused = await post_error(jp_fetch, small, "park")  # nothing parks meanwhile
        assert code == 409 and refused["message"].startswith("did not park: host memory is short"), refused
    finally:
        parker.host = real_host
    await wait_for(lambda: not parker.host_json()["short"], "the episode to end", timeout=WAIT)


@pytest.mark.parametrize("park", [{"checkpoint_class": FAKE_DRIVER, "park_host_margin": "60TiB"}])
async def test_the_host_guard_refuses_when_host_memory_cannot_hold_it(jp_fetch, jp_serverapp, fake_driver):
    kernel_id = await start_kernel(jp_fetch)
    await holding_gpu(jp_serverapp, kernel_id)
    code, answer = await post_error(jp_fetch, kernel_id, "park")
    assert code == 409
    assert answer["message"].startswith("did not park: the host has") and "margin of 60.0 TiB" not in answer["message"]
    assert answer["park"]["state"] == "idle"
    assert FakeCheckpoint.calls == []


@pytest.mark.parametrize("park", [{}])  # the real driver: this machine has no CUDA driver
async def test_no_checkpoint_driver_is_said_and_nothing_raises(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    await parker_of(jp_serverapp).ready()
    park = await park_state(jp_fetch, kernel_id)
    assert park["parkable"] is False and park["reason"].startswith("no checkpoint driver: ")
    code, answer = await post_error(jp_fetch, kernel_id, "park")
    assert code == 409 and answer["message"].startswith("no checkpoint driver: ")
    # A full device under its cap (park_on_device_full "auto": on without admission control): no kernel can park
    # for it, so the answer says so at once, not at the wait limit.
    code, answer = await post_error(jp_fetch, kernel_id, "room")
    assert code == 409 and answer["message"].startswith("this server cannot park kernels: "), answer


# --- the broker: room made for a resume, never a restore into a full device ------------------------------

BROKER = {
    "checkpoint_class": FAKE_DRIVER,
    "default_cap": "7GiB",
    "max_cap": "7GiB",
    "overcommit": 2.0,
    "placement": "pack",  # all on GPU 0: three 7 GiB caps on a 16 GiB device
    "park_min_idle": "0",
}


async def three_kernels(jp_fetch, jp_serverapp):
    """A parked with 6 GiB; B, then C, holding 6 GiB each and idle (B idle longer): the issue's scenario."""
    kernels = {}
    for name in "ABC":
        kernel_id = await start_kernel(jp_fetch)
        await execute(jp_serverapp, kernel_id, f"x = {ord(name)}")
        kernels[name] = (kernel_id, await holding_gpu(jp_serverapp, kernel_id, 6 * GiB))
        assert manager_of(jp_serverapp).ledger.get(kernel_id).devices == (0,)
        if name == "A":
            await post(jp_fetch, kernel_id, "park")
            await wait_state(jp_fetch, kernel_id, "parked")
    return kernels


@pytest.mark.parametrize("park", [BROKER])
async def test_a_parked_kernels_cell_parks_the_least_recently_active_idle_kernel_and_then_runs(
    jp_fetch, jp_serverapp, full_devices
):
    kernels = await three_kernels(jp_fetch, jp_serverapp)
    (a, a_pid), (b, b_pid), (c, _) = kernels["A"], kernels["B"], kernels["C"]
    # A's cell: 16 GiB - 12 held - 2 that B's and C's caps may still take - 1 margin = 1 GiB free for 6 GiB.
    # B's checkpoint is held until the server says A has waited a while, so the cell has something to say.
    release = FakeCheckpoint.hang("cuCheckpointProcessCheckpoint")
    cell = asyncio.ensure_future(run_cell(jp_serverapp, a, "print(x + 1)"))

    async def a_waited():
        park = await park_state(jp_fetch, a)
        return park if park["state"] == "waiting" and (park["waited"] or 0) >= 1.6 else None

    waiting = await wait_for(a_waited, timeout=WAIT)
    assert f"needs 6.0 GiB on GPU 0; making room: idle kernel kernel {b[:8]} parking" == waiting["reason"], waiting
    assert (await park_state(jp_fetch, b))["state"] == "parking"
    release.set()
    ran = await cell
    # The cell's stdout is the user's own output only; what the wait said is on its stderr (issue 31).
    assert ran["status"] == "ok" and ran["stdout"] == f"{ord('A') + 1}\n", ran
    said = ran["stderr"].splitlines()
    assert said[0].startswith("gpu-quota: waiting for device memory (waited 1 s of at most 5 min): needs 6.0 GiB"), said
    assert said[-1].startswith("gpu-quota: back on the GPU after") and said[-1].endswith("; the cell runs now"), said
    assert (await park_state(jp_fetch, b))["state"] == "parked"  # B had been idle longest
    assert (await park_state(jp_fetch, c))["state"] == "idle"
    order = [(call, pid) for call, pid in FakeCheckpoint.calls if call != "cuCheckpointProcessGetState"]
    assert order.index(("cuCheckpointProcessCheckpoint", b_pid)) < order.index(("cuCheckpointProcessRestore", a_pid))
    # Then B's cell: C (idle longer than A, which just ran) parks for it.
    ran = await run_cell(jp_serverapp, b, "print(x + 1)")
    assert ran["status"] == "ok" and ran["stdout"].splitlines()[-1] == str(ord("B") + 1), ran
    assert (await park_state(jp_fetch, c))["state"] == "parked"
    assert (await park_state(jp_fetch, a))["state"] in ("idle", "busy")
    assert FakeCheckpoint.broken == set()  # no restore ever found the device full
    assert calls("cuCheckpointProcessRestore") == [a_pid, b_pid]  # one restore each, never retried


@pytest.mark.parametrize("park", [{**BROKER, "placement": "spread"}])
async def test_on_two_gpus_room_is_made_on_the_gpu_that_needs_it(jp_fetch, jp_serverapp, full_devices):
    # spread: starts alternate GPU 0, GPU 1. D (GPU 0) is idle longest, but A waits for GPU 1: B parks, D stays.
    d, a, e, b = [await start_kernel(jp_fetch) for _ in range(4)]
    ledger = manager_of(jp_serverapp).ledger
    assert [ledger.get(k).devices for k in (d, a, e, b)] == [(0,), (1,), (0,), (1,)]
    await holding_gpu(jp_serverapp, d, 6 * GiB)
    await holding_gpu(jp_serverapp, e, 6 * GiB)
    await execute(jp_serverapp, a, "x = 41")
    await holding_gpu(jp_serverapp, a, 6 * GiB)
    await post(jp_fetch, a, "park")
    await wait_state(jp_fetch, a, "parked")
    await holding_gpu(jp_serverapp, b, 6 * GiB)
    FakeNvml.other_used = {"static-1": 6 * GiB}  # GPU 1: B's 6 GiB and 6 GiB outside the quota
    ran = await run_cell(jp_serverapp, a, "print(x + 1)")
    assert ran["status"] == "ok" and ran["stdout"].splitlines()[-1] == "42", ran
    assert (await park_state(jp_fetch, b))["state"] == "parked"
    assert {(await park_state(jp_fetch, k))["state"] for k in (d, e)} <= {"idle", "busy"}  # GPU 0 left alone
    assert FakeCheckpoint.broken == set()


@pytest.mark.parametrize("park", [{**BROKER, "park_wait_limit": "2s"}])
async def test_a_cell_that_cannot_get_room_waits_the_limit_and_ends_with_why_the_kernel_still_parked(
    jp_fetch, jp_serverapp, full_devices
):
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "x = 41")
    pid = await holding_gpu(jp_serverapp, kernel_id, 6 * GiB)
    await post(jp_fetch, kernel_id, "park")
    await wait_state(jp_fetch, kernel_id, "parked")
    FakeNvml.other_used = {"static-0": 12 * GiB}  # a process outside the quota: nothing can park it
    ran = await run_cell(jp_serverapp, kernel_id, "print(x + 1)")
    assert ran["status"] == "error" and "42" not in ran["stdout"], ran
    assert ran["stdout"] == "" and "gpu-quota: waiting for device memory" in ran["stderr"], ran
    assert "the cell did not run: waited 2 s (the park_wait_limit)" in ran["error"]
    assert "Nothing is lost: the kernel stays parked" in ran["error"]
    assert "Traceback" not in ran["error"]  # one message, not a traceback of the extension's insides
    park = await wait_state(jp_fetch, kernel_id, "parked")
    assert park["host_bytes"] == 6 * GiB and calls("cuCheckpointProcessRestore") == []
    FakeNvml.other_used = {}  # the memory is free again: the next cell brings it back
    assert (await execute(jp_serverapp, kernel_id, "print(x + 1)")).strip().splitlines()[-1] == "42"
    assert calls("cuCheckpointProcessRestore") == [pid] and FakeCheckpoint.broken == set()


@pytest.mark.parametrize("park", [BROKER])
async def test_a_restore_the_driver_fails_is_lost_said_plainly_never_retried_and_a_restart_recovers(
    jp_fetch, jp_serverapp, full_devices
):
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "x = 41")
    pid = await holding_gpu(jp_serverapp, kernel_id, 2 * GiB)
    caps = manager_of(jp_serverapp).ledger.get(kernel_id).caps
    await post(jp_fetch, kernel_id, "park")
    await wait_state(jp_fetch, kernel_id, "parked")
    FakeCheckpoint.fail_restores(1)  # what the driver does however careful we are: the broker cannot stop it
    ran = await run_cell(jp_serverapp, kernel_id, "print(x + 1)")
    assert ran["status"] == "error" and "could not be brought back" in ran["error"], ran
    assert "save what you need" in ran["error"] and "restart the kernel" in ran["error"]
    park = await wait_state(jp_fetch, kernel_id, "lost")
    assert park["parkable"] is False and "CUDA_ERROR_OUT_OF_MEMORY" in park["reason"]
    # The kernel's Python still runs; a cell says the same at once and asks the driver nothing.
    again = await run_cell(jp_serverapp, kernel_id, "print('still here')")
    assert again["status"] == "error" and "could not be brought back" in again["error"]
    assert (await execute(jp_serverapp, kernel_id, "%gpucap")) and calls("cuCheckpointProcessRestore") == [pid]
    code, answer = await post_error(jp_fetch, kernel_id, "resume")
    assert code == 409 and answer["park"]["state"] == "lost"
    assert manager_of(jp_serverapp).ledger.get(kernel_id).caps == caps  # the grant is kept for the restart
    await restart_kernel(jp_fetch, kernel_id)
    assert (await execute(jp_serverapp, kernel_id, "print('fresh')")).strip() == "fresh"
    assert (await park_state(jp_fetch, kernel_id))["state"] in ("idle", "busy")


DEVICE_FULL = (
    "import torch\n"
    "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of "
    "16.00 GiB of which 1.50 GiB is free. Of the allocated memory 2.00 GiB is allocated by PyTorch')"
)


@pytest.mark.parametrize("park", [{**BROKER, "park_on_device_full": "on"}])
async def test_a_kernel_whose_allocation_found_the_device_full_gets_room_made_up_to_its_cap(
    jp_fetch, jp_serverapp, full_devices
):
    a, b, c = await start_kernel(jp_fetch), await start_kernel(jp_fetch), await start_kernel(jp_fetch)
    await holding_gpu(jp_serverapp, b, 6 * GiB)  # B idle longest
    await holding_gpu(jp_serverapp, c, 6 * GiB)
    await holding_gpu(jp_serverapp, a, 2 * GiB)  # A: 5 GiB of its 7 GiB cap left, 2 GiB free on the device
    ran = await run_cell(jp_serverapp, a, DEVICE_FULL)
    assert ran["status"] == "error" and "OutOfMemoryError" in ran["error"]
    said = ran["stderr"]
    assert "itself is full" in said and "the broker parks idle kernels to make room" in said, said
    assert "room made after" in said and "run the cell again" in said, said
    assert (await park_state(jp_fetch, b))["state"] == "parked"  # idle longest: B gave its room
    assert (await park_state(jp_fetch, c))["state"] == "idle"
    park = await park_state(jp_fetch, a)
    assert park["room"] == "made" and park["state"] in ("idle", "busy")
    assert (await execute(jp_serverapp, a, "print(1)")).strip() == "1"  # and its next cell runs


@pytest.mark.parametrize("park", [{**BROKER, "park_on_device_full": "off"}])
async def test_room_on_a_full_device_is_the_admins_choice_and_off_means_off(jp_fetch, jp_serverapp, full_devices):
    a = await start_kernel(jp_fetch)
    await holding_gpu(jp_serverapp, a, 2 * GiB)
    code, answer = await post_error(jp_fetch, a, "room")
    assert code == 409 and answer["message"] == "park_on_device_full is off on this server"
    ran = await run_cell(jp_serverapp, a, DEVICE_FULL)
    assert "itself is full" in ran["stderr"] and "broker" not in ran["stderr"]  # the kernel says nothing more
    assert FakeCheckpoint.calls == []


@pytest.mark.parametrize("body", ['{"device": -1}', '{"device": true}', '{"devices": 0}', "[]", '{"device": 9}'])
@pytest.mark.parametrize("park", [{**BROKER, "park_on_device_full": "on"}])
async def test_bad_room_requests_change_nothing(jp_fetch, jp_serverapp, full_devices, body):
    a = await start_kernel(jp_fetch)
    await holding_gpu(jp_serverapp, a, 2 * GiB)
    code, answer = await post_error(jp_fetch, a, "room", body=body)
    assert code in (400, 409) and answer["message"]
    assert (await park_state(jp_fetch, a))["room"] is None and FakeCheckpoint.calls == []


async def test_a_park_first_asks_the_kernel_to_empty_its_caches(jp_fetch, jp_serverapp, fake_driver, caplog):
    caplog.set_level(logging.INFO, "gpu_quota_ext")
    kernel_id = await start_kernel(jp_fetch)
    # A stand-in for CuPy's memory pool, holding 3 GiB of free blocks (no CUDA here).
    await execute(
        jp_serverapp,
        kernel_id,
        "import sys, types\n"
        "class Pool:\n"
        "    held = 3 << 30\n"
        "    def total_bytes(self): return self.held\n"
        "    def free_all_blocks(self): self.held = 0\n"
        "pool = Pool()\n"
        "sys.modules['cupy'] = types.SimpleNamespace(get_default_memory_pool=lambda: pool)",
    )
    await holding_gpu(jp_serverapp, kernel_id)
    await post(jp_fetch, kernel_id, "park")
    await wait_state(jp_fetch, kernel_id, "parked")
    assert f"kernel {kernel_id} emptied {3 << 30} bytes of cached GPU memory before parking" in caplog.text
    # The request was the server's, not the user's: the kernel's activity did not change.
    assert (await park_state(jp_fetch, kernel_id))["idle_seconds"] >= 0
    assert (await execute(jp_serverapp, kernel_id, "print(pool.held)")).strip().splitlines()[-1] == "0"


# --- the idle timer ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("park", [{"checkpoint_class": FAKE_DRIVER, "park_idle_after": "1s"}])
async def test_the_idle_timer_parks_an_idle_kernel_and_its_next_cell_brings_it_back(
    jp_fetch, jp_serverapp, fake_driver, caplog
):
    caplog.set_level(logging.INFO, "gpu_quota_ext")
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "x = 41")
    pid = await holding_gpu(jp_serverapp, kernel_id)
    parked = await wait_state(jp_fetch, kernel_id, "parked")
    assert parked["idle_seconds"] >= 1
    assert (await execute(jp_serverapp, kernel_id, "print(x + 1)")).strip() == "42"
    await wait_for(lambda: calls("cuCheckpointProcessRestore") == [pid], timeout=WAIT)
    lines = [r.getMessage() for r in caplog.records if f"kernel {kernel_id} park state" in r.getMessage()]
    assert lines[:3] == [
        f"gpu-quota-ext: kernel {kernel_id} park state idle -> parking: idle for 1 s",
        f"gpu-quota-ext: kernel {kernel_id} park state parking -> parked: 2.0 GiB of GPU memory moved to host memory "
        f"(processes {pid})",
        f"gpu-quota-ext: kernel {kernel_id} park state parked -> waiting: asking for device memory to come back to",
    ]
    assert f"gpu-quota-ext: kernel {kernel_id} park state waiting -> resuming" in lines


# --- interrupt, restart, shutdown of a parked kernel ------------------------------------------------------


async def parked_kernel(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "x = 41")
    pid = await holding_gpu(jp_serverapp, kernel_id)
    await post(jp_fetch, kernel_id, "park")
    await wait_state(jp_fetch, kernel_id, "parked")
    return kernel_id, pid


async def test_shutdown_of_a_parked_kernel_leaves_nothing_behind(jp_fetch, jp_serverapp, fake_driver):
    kernel_id, pid = await parked_kernel(jp_fetch, jp_serverapp)
    await shutdown_kernel(jp_fetch, kernel_id)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert FakeCheckpoint.parked_pids() == {}
    parker = parker_of(jp_serverapp)
    assert kernel_id not in parker.records and kernel_id not in parker._streams
    assert manager_of(jp_serverapp).ledger.get(kernel_id) is None


async def test_restart_of_a_parked_kernel_starts_it_fresh_with_its_grant(jp_fetch, jp_serverapp, fake_driver):
    kernel_id, pid = await parked_kernel(jp_fetch, jp_serverapp)
    caps = manager_of(jp_serverapp).ledger.get(kernel_id).caps
    await restart_kernel(jp_fetch, kernel_id)
    new_pid = await kernel_pid(jp_serverapp, kernel_id)
    assert new_pid != pid
    assert FakeCheckpoint.parked_pids() == {}
    assert kernel_id not in parker_of(jp_serverapp).records
    park = await park_state(jp_fetch, kernel_id)
    assert park["state"] in ("idle", "busy") and park["host_bytes"] is None
    assert manager_of(jp_serverapp).ledger.get(kernel_id).caps == caps
    assert "41" not in await execute(jp_serverapp, kernel_id, "print(globals().get('x'))")


async def test_interrupt_of_a_parked_kernel_keeps_it_parked_and_usable(jp_fetch, jp_serverapp, fake_driver):
    kernel_id, pid = await parked_kernel(jp_fetch, jp_serverapp)
    await jp_fetch("api", "kernels", kernel_id, "interrupt", method="POST", body="{}")
    await next_samples(jp_serverapp, 2)
    assert (await park_state(jp_fetch, kernel_id))["state"] == "parked"
    assert (await execute(jp_serverapp, kernel_id, "print(x + 1)")).strip() == "42"
    await wait_for(lambda: calls("cuCheckpointProcessRestore") == [pid], timeout=WAIT)


# --- a driver call that does not return ---------------------------------------------------------------------


async def test_a_hung_driver_call_hangs_nothing_and_the_state_says_so(jp_fetch, jp_serverapp, fake_driver):
    kernel_id = await start_kernel(jp_fetch)
    pid = await holding_gpu(jp_serverapp, kernel_id)
    parker = parker_of(jp_serverapp)
    parker.settings = dataclasses.replace(parker.settings, call_timeout=0.2)
    release = FakeCheckpoint.hang("cuCheckpointProcessCheckpoint")
    code, answer = await post(jp_fetch, kernel_id, "park")
    assert code == 202 and answer["park"]["state"] == "parking"

    async def says_so():
        park = await park_state(jp_fetch, kernel_id)
        return park if park["reason"] and "has not returned" in park["reason"] else None

    park = await wait_for(says_so, timeout=WAIT)
    assert park["state"] == "parking" and park["parkable"] is False
    other = await start_kernel(jp_fetch)  # the server goes on
    assert (await execute(jp_serverapp, other, "print(1)")).strip() == "1"
    await shutdown_kernel(jp_fetch, kernel_id)  # and a kernel caught in the call can still go
    assert kernel_id not in parker.records
    release.set()
    await wait_for(
        lambda: ("cuCheckpointProcessCheckpoint", pid) in FakeCheckpoint.calls, timeout=WAIT
    )  # the late answer came
    await next_samples(jp_serverapp, 2)
    assert kernel_id not in parker.records  # the late answer did not bring it back
    assert FakeCheckpoint.parked_pids() == {}


# --- what an admin sees --------------------------------------------------------------------------------------


async def test_prometheus_shows_each_kernels_park_state_and_host_bytes(jp_fetch, jp_serverapp, fake_driver):
    kernel_id, pid = await parked_kernel(jp_fetch, jp_serverapp)
    text = (await jp_fetch("metrics")).body.decode()
    assert re.search(r'gpu_quota_kernel_park_state\{kernel_id="%s",state="parked"\} 1\.0' % kernel_id, text)
    assert re.search(r'gpu_quota_kernel_park_state\{kernel_id="%s",state="idle"\} 0\.0' % kernel_id, text)
    host = re.search(r'gpu_quota_kernel_parked_host_bytes\{kernel_id="%s"\} (\S+)' % kernel_id, text)
    assert host and float(host.group(1)) == 2 * GiB
