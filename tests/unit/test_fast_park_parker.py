"""The parker with fast_park on (issue 29), against a kernel played by a fake control channel: the path chosen per
park from the kernel's facts and the sample's, shown in the status with what stays on the device; the arena
promised in the host's account before the kernel makes it; the kernel's park and resume asked through the
PagesDriver (the checkpoint driver never called for it); a resume that finds no room leaves it parked and whole,
and the next grant brings it back; a kernel without torch on the GPU parks through the checkpoint driver and the
status says why; with fast_park off nothing is asked and nothing is said. No server, no GPU: the harness of
test_parker_states (a stand-in kernel manager, the fake NVML, an event loop)."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import replace
from typing import List, Optional

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.parking import ParkSettings
from gpu_quota_ext.parking.checkpoint import (
    CHECKPOINTED,
    CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_OPERATING_SYSTEM,
    CUDA_ERROR_OUT_OF_MEMORY,
    DRIVER_RUNNING,
    CheckpointError,
)
from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
from gpu_quota_ext.parking.host_account import HostReading
from gpu_quota_ext.parking.kernel_channel import KernelChannel
from gpu_quota_ext.parking.pages_driver import CODE_NAMES, E_PARTIAL, E_REQUEST, PagesDriver, threadsafe_ask
from gpu_quota_ext.parking.parker import Parker
from gpu_quota_ext.parking.path import arena_bytes
from gpu_quota_ext.shared.contract import PARK_PATH_FIELDS

from .fakes import KERNEL, UUID, Grants, NvmlMonitor, ParkerKernels, ParkerOnALoop, grant

GiB, MiB = 1 << 30, 1 << 20
TOTAL = 16 * GiB
PID = os.getpid()  # a live process: the drivers ask whether it still exists
OTHER = PID + 1  # another kernel's process, as the samples name it
SERVED = 4 * GiB
CONTEXT = 600 * MiB
HOST = 64 * GiB


class PagesKernel(KernelChannel):
    """A kernel with the library preloaded, as its control channel answers (kernel/fast_park.py's replies)."""

    def __init__(self, torch_cuda: bool = True):
        super().__init__(kernels=None)  # no kernel manager: every answer is made here
        self.torch_cuda = torch_cuda
        self.state = "running"
        self.arena = 0
        self.asked: List[dict] = []
        self.refuse_resumes = 0  # resumes answered CUDA_ERROR_OUT_OF_MEMORY (a neighbour took the room)
        FakeNvml.set_usage(PID, UUID, SERVED + CONTEXT)

    async def ask(self, kernel_id: str, content: dict, timeout: float) -> Optional[dict]:
        self.asked.append(dict(content))
        action = content.get("action")
        if action == "trim":
            return {"freed": 0}
        if action == "facts":
            return {
                "preloaded": True, "library_problem": None, "torch_cuda": self.torch_cuda,
                "allocator_backend": "native", "expandable_segments": False,
                "served_bytes": SERVED if self.torch_cuda else 0, "arena_bytes": self.arena, "state": self.state,
            }
        if action == "park":
            if self.arena < SERVED:
                self.arena = content["arena"]
            self.state = "parked"
            FakeNvml.set_usage(PID, UUID, CONTEXT)
            return {"code": 0, "message": "parked", "seconds": 0.08, "bytes": SERVED}
        if action == "resume":
            if self.refuse_resumes:
                self.refuse_resumes -= 1
                return {"code": 2, "message": "cannot resume: CUDA_ERROR_OUT_OF_MEMORY (2)", "seconds": 0.01}
            self.state = "running"
            if not content.get("keep_arena"):
                self.arena = 0
            FakeNvml.set_usage(PID, UUID, SERVED + CONTEXT)
            return {"code": 0, "message": "resumed", "seconds": 0.09, "bytes": SERVED, "waited": 0.0}
        if action == "release":
            if self.state != "running":
                return {"code": -1, "message": f"the kernel is {self.state}: its arena holds its GPU memory"}
            freed, self.arena = self.arena, 0
            return {"code": 0, "message": "released", "seconds": None, "bytes": freed}
        return {"error": f"unknown action {action!r}"}

    def actions(self) -> List[str]:
        return [c["action"] for c in self.asked]


class Setup(ParkerOnALoop):
    def __init__(self, fast_park: str = "on", torch_cuda: bool = True, bootstrapped: bool = True):
        FakeNvml.reset()
        FakeCheckpoint.reset()
        FakeNvml.totals = {UUID: TOTAL}
        self.loop = asyncio.new_event_loop()
        self.kernel = PagesKernel(torch_cuda)
        self.monitor = NvmlMonitor((PID,), TOTAL)
        self.promised: List[int] = []
        self.parker = Parker(
            ParkSettings(fresh_sample_wait=0, min_idle=0, device_margin=GiB // 2, fast_park=fast_park),
            FakeCheckpoint(),
            ParkerKernels(),
            Grants([grant(KERNEL, {0: 8 * GiB})]),  # the parker reads grants only
            {0: Device(index=0, name="fake", uuid=UUID, total=TOTAL, nvml_index=0)},
            self.monitor,
            host=lambda: (HOST, None),
            channel=self.kernel,
            bootstrapped=lambda kernel_id: bootstrapped,
        )
        promise = self.parker._promise_host

        def spy(kernel_id, pids):  # what the account holds for this park, right before its driver call
            promise(kernel_id, pids)
            self.promised.append(self.parker.host_account.outstanding())

        self.parker._promise_host = spy  # type: ignore[method-assign]
        self.start()

    def park(self) -> dict:
        self.run(self.parker.request_park(KERNEL))
        self.settle()
        return self.parker.kernel_json(KERNEL)

    def resume(self) -> dict:
        self.run(self.parker.request_resume(KERNEL))
        self.settle()
        for _ in range(3):  # the broker's rounds follow the samples
            self.sample()
        return self.parker.kernel_json(KERNEL)


@pytest.fixture
def setup():
    made: List[Setup] = []

    def make(**kwargs) -> Setup:
        made.append(Setup(**kwargs))
        return made[-1]

    yield make
    for one in made:
        one.close()


def test_a_torch_kernel_with_the_library_parks_its_pages_and_the_status_says_so(setup):
    s = setup()
    park = s.park()
    assert park["state"] == "parked", park
    path = park["path"]
    assert tuple(path) == PARK_PATH_FIELDS
    assert path["path"] == "pages" and path["stays_on_device"] == CONTEXT
    assert "4.0 GiB" in path["reason"] and "600.0 MiB" in path["reason"]
    assert path["park_seconds"] == 0.08 and path["resume_seconds"] is None and path["resume_waited_seconds"] is None
    assert park["host_bytes"] == SERVED  # what moved: the context stays
    assert s.kernel.actions() == ["trim", "facts", "park"]
    park_asked = s.kernel.asked[-1]
    assert park_asked["arena"] == arena_bytes(SERVED)
    assert s.promised == [arena_bytes(SERVED)]  # the arena, in the account before the kernel made it
    assert FakeCheckpoint.calls == []  # the driver's checkpoint calls are not this kernel's path


def test_the_host_service_is_told_what_a_fast_park_left_on_the_device_while_parked_and_nothing_after(setup):
    # On a hub host the service holds up the resume of a kernel its sample still shows on the device: a fast-parked
    # kernel's context stays there, so its server says how much ("stays"), and only while it is parked.
    s = setup()
    assert s.park()["state"] == "parked"
    s.sample()
    assert s.parker.host_report() == []  # no lease reads it here: samples and changes publish nothing
    s.parker.publish_host_report()
    (kernel,) = s.parker.round().kernels
    assert kernel.stays == CONTEXT
    assert s.parker.host_report() == [
        {"kernel_id": KERNEL, "state": "parked", "idle_for": None, "parkable": False, "stays": CONTEXT}
    ]
    assert s.resume()["state"] not in ("parked", "waiting")
    s.parker.publish_host_report()
    assert "stays" not in s.parker.host_report()[0] and s.parker.round().kernels[0].stays == 0


def test_a_resume_without_room_stays_parked_and_whole_and_the_next_grant_brings_it_back(setup):
    s = setup()
    assert s.park()["state"] == "parked"
    s.kernel.refuse_resumes = 1
    s.run(s.parker.request_resume(KERNEL))
    s.settle()  # the broker granted the room it saw; the kernel found none when its resume ran
    park = s.parker.kernel_json(KERNEL)
    assert park["state"] == "waiting", park  # not lost: the library gave back what it took
    assert "no room" in park["reason"] and "nothing was lost" in park["reason"]
    assert s.kernel.state == "parked"
    for _ in range(3):
        s.sample()
    park = s.parker.kernel_json(KERNEL)
    assert park["state"] not in ("parked", "waiting", "lost"), park
    assert s.kernel.state == "running"
    assert park["path"]["resume_seconds"] == 0.09 and park["path"]["resume_waited_seconds"] == 0.0
    assert s.kernel.actions().count("resume") == 2


def test_the_arena_is_kept_for_the_next_park_and_no_host_memory_is_promised_again(setup):
    s = setup()
    s.park()
    assert s.resume()["state"] not in ("parked", "waiting")
    # No park under way frees its room: the resume does not wait for any.
    assert s.kernel.asked[-1] == {"action": "resume", "keep_arena": True, "wait_for_room": 0.0, "timeout": 600.0}
    assert s.kernel.arena == arena_bytes(SERVED)
    s.park()
    assert s.promised == [arena_bytes(SERVED), 0]


def test_an_arena_the_kernel_claims_but_never_kept_does_not_spare_its_park_the_host_promise(setup):
    s = setup()
    s.kernel.arena = arena_bytes(SERVED)  # says so in its facts; this server saw no fast resume keep one
    s.park()
    assert s.promised == [arena_bytes(SERVED)]


def test_a_kernel_that_kept_its_arena_is_shown_to_the_broker_as_costing_the_host_nothing_more(setup):
    s = setup()
    (kernel,) = s.parker.round().kernels
    assert kernel.host_cost is None  # never parked: its park would take all it holds
    s.park()
    assert s.resume()["state"] not in ("parked", "waiting")
    s.sample()
    (kernel,) = s.parker.round().kernels
    assert kernel.host_bytes > 0 and kernel.host_need == 0  # the arena it kept holds every byte it serves


def test_a_kernel_that_gave_its_arena_back_costs_the_host_all_its_bytes_again(setup):
    s = setup()
    s.park()
    # The host has less than the margin beside the arena: the resumed kernel gives it back.
    s.parker.host_reading = lambda: HostReading(available=1 << 20)  # type: ignore[method-assign]
    assert s.resume()["state"] not in ("parked", "waiting")
    assert s.kernel.asked[-1]["keep_arena"] is False
    s.sample()
    (kernel,) = s.parker.round().kernels
    assert kernel.host_cost is None and kernel.host_need == kernel.host_bytes


def test_a_kernel_without_torch_on_the_gpu_parks_through_the_checkpoint_driver_and_says_why(setup):
    s = setup(torch_cuda=False)
    park = s.park()
    assert park["state"] == "parked"
    assert park["path"]["path"] == "checkpoint"
    assert "no torch on the GPU" in park["path"]["reason"]
    assert park["path"]["stays_on_device"] == 0 and park["path"]["park_seconds"] is None
    assert "park" not in s.kernel.actions()
    assert [call for call, _ in FakeCheckpoint.calls] == ["cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint"]


def test_with_fast_park_off_nothing_is_asked_and_nothing_is_said(setup):
    s = setup(fast_park="off")
    park = s.park()
    assert park["state"] == "parked" and park["path"] is None
    assert s.kernel.actions() == ["trim"]
    assert park["host_bytes"] == SERVED + CONTEXT
    assert [call for call, _ in FakeCheckpoint.calls] == ["cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint"]


# --- the driver alone, over a fake channel ---------------------------------------------------------------


def driver_over(answers: dict, **kwargs) -> PagesDriver:
    asked: list = []

    def ask(content, timeout):
        asked.append(content)
        answer = answers.get(content["action"])
        return answer(content) if callable(answer) else answer

    driver = PagesDriver(ask, **kwargs)
    driver.asked = asked  # type: ignore[attr-defined]
    return driver


@pytest.mark.parametrize(
    "seconds, waited, kept",
    [
        (0.5, 0.2, 0.2),  # what the kernel measured
        (0.5, 9.0, 0.5),  # never more than the resume's own seconds: the kernel's process says it
        (0.5, True, None),  # a bool is no number
        (0.5, float("nan"), None),
        (0.5, float("inf"), None),
        (0.5, -1.0, None),
        (0.5, "0.2", None),
        (None, 0.2, None),  # no seconds, nothing to be a share of
        (0.5, 10**400, None),  # a JSON integer too large for a float: no number of seconds, and no error either
        (10**400, 0.2, None),
    ],
)
def test_the_wait_a_resume_reports_is_kept_only_as_a_share_of_its_seconds(seconds, waited, kept):
    driver = driver_over({"resume": {"code": 0, "message": "resumed", "seconds": seconds, "waited": waited}})
    driver.restore(os.getpid())
    assert driver.waited == kept


def test_the_driver_raises_the_kernels_code_and_keeps_its_words():
    driver = driver_over({"resume": {"code": 2, "message": "no room for 1073741824 bytes", "seconds": 0.01}})
    with pytest.raises(CheckpointError) as failed:
        driver.restore(PID)
    assert failed.value.code == CUDA_ERROR_OUT_OF_MEMORY
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(failed.value) and "1073741824" in str(failed.value)
    assert driver.seconds == 0.01


def test_a_lost_answer_is_followed_by_the_librarys_state():
    parked = driver_over({"park": None, "facts": {"state": "parked"}}, arena=5)
    parked.checkpoint(PID)  # the answer was lost, the park was not
    assert parked.asked == [
        {"action": "park", "arena": 5, "release_as_copied": True, "timeout": 600.0}, {"action": "facts"}
    ]
    silent = driver_over({"park": None, "facts": None})
    with pytest.raises(CheckpointError, match="no answer"):
        silent.checkpoint(PID)


def test_a_park_that_ended_parked_in_part_counts_as_parked_and_says_so(caplog):
    # Some pieces are on the host, the rest on the device, and the library runs no GPU work until a resume: taken as
    # a failed park, the kernel would be shown running and hang at its next cell.
    words = "piece 3 of 7 not copied: CUDA_ERROR_ILLEGAL_ADDRESS"
    driver = driver_over({"park": {"code": E_PARTIAL, "message": words, "seconds": 0.4}}, arena=5)
    with caplog.at_level("WARNING", logger="gpu_quota_ext"):
        driver.checkpoint(PID)
    assert driver.seconds == 0.4 and [a["action"] for a in driver.asked] == ["park"]
    assert "parked in part" in caplog.text and words in caplog.text
    assert CODE_NAMES[E_PARTIAL] == "parked in part"


def test_a_park_that_answered_an_error_but_left_the_library_parked_counts_as_parked(caplog):
    # The library parks and then fails to give back a piece (cuMemUnmap): its bytes are in the arena, it stays on the
    # device, and the library is parked and says so with the driver's code. Taken as a failed park, the kernel would
    # be shown running while its library runs no GPU work until a resume: its next cell would tell its user to
    # restart it.
    words = (
        "parked, but 2097152 bytes stayed on the device: cuMemUnmap/cuMemRelease failed: CUDA_ERROR_INVALID_VALUE (1)"
    )
    driver = driver_over({"park": {"code": 1, "message": words, "seconds": 0.4}, "facts": {"state": "parked"}})
    with caplog.at_level("WARNING", logger="gpu_quota_ext"):
        driver.checkpoint(PID)
    assert words in caplog.text
    # A park that failed and left the library running is a failed park, as before.
    running = driver_over({"park": {"code": -2, "message": "no arena"}, "facts": {"state": "running"}})
    with pytest.raises(CheckpointError, match="no arena"):
        running.checkpoint(PID)


def test_the_driver_sends_the_swaps_options():
    driver = driver_over({"park": {"code": 0}, "resume": {"code": 0}}, release_as_copied=False, wait_for_room=12.5)
    driver.checkpoint(PID)
    driver.restore(PID)
    park, resume = driver.asked
    assert park["release_as_copied"] is False and resume["wait_for_room"] == 12.5
    assert PagesDriver(lambda content, timeout: None).release_as_copied is True  # the default: a fast park releases
    assert PagesDriver(lambda content, timeout: None).wait_for_room == 0.0  # ... and a resume does not wait


def test_a_malformed_request_is_a_failure_with_its_words():
    driver = driver_over({"resume": {"code": E_REQUEST, "message": "wait_for_room must be a number of seconds"}})
    with pytest.raises(CheckpointError) as refused:
        driver.restore(PID)
    assert refused.value.code == E_REQUEST and "request: wait_for_room" in str(refused.value)


def test_the_drivers_state_is_the_librarys_and_a_gone_process_is_not_found():
    assert driver_over({"facts": {"state": "parked"}}).state(PID) == CHECKPOINTED
    assert driver_over({"facts": {"state": "running"}}).state(PID) == DRIVER_RUNNING
    with pytest.raises(CheckpointError) as gone:
        driver_over({}).state(2**22 + 12345)  # beyond any pid_max's default: no such process
    assert gone.value.code == CUDA_ERROR_NOT_FOUND


def test_lock_and_unlock_ask_nothing():
    driver = driver_over({})
    driver.lock(PID, 1000)
    driver.unlock(PID)
    assert driver.asked == []


def test_the_channel_is_asked_on_the_loop_from_a_thread():
    class Channel:
        async def ask(self, kernel_id, content, timeout):
            return {"kernel": kernel_id, **content}

    async def main():
        ask = threadsafe_ask(Channel(), "k9", asyncio.get_running_loop())
        return await asyncio.get_running_loop().run_in_executor(None, ask, {"action": "facts"}, 1.0)

    assert asyncio.run(main()) == {"kernel": "k9", "action": "facts"}


def test_a_kernel_without_the_bootstrap_is_not_asked_and_takes_the_checkpoint_path(setup):
    s = setup(bootstrapped=False)
    park = s.park()
    assert park["state"] == "parked" and s.kernel.actions() == []
    assert park["path"]["path"] == "checkpoint" and "started without the fast park library" in park["path"]["reason"]


def test_kept_arenas_are_given_back_when_host_memory_runs_short(setup):
    s = setup()
    s.park()
    assert s.resume()["state"] not in ("parked", "waiting") and s.kernel.arena == arena_bytes(SERVED)
    # Another program takes the host's memory: below half the margin, with this kernel's arena on the host.
    s.parker.host_reading = lambda: HostReading(available=1 << 20)  # type: ignore[method-assign]
    s.sample()
    assert s.kernel.actions()[-1] == "release" and s.kernel.arena == 0
    (kernel,) = s.parker.round().kernels
    assert kernel.host_cost is None  # its next park makes an arena again, and the host account counts it
    assert s.parker.host_json()["short"] is True


def _kept_elsewhere(s, kernel_id: str) -> None:
    """Another running kernel (`kernel_id`, its process OTHER in every sample) kept its arena after a fast resume;
    this kernel holds none now."""
    s.park()
    s.resume()
    s.parker._plans[kernel_id] = replace(s.parker._plans[KERNEL], arena_pids=(OTHER,))
    s.kernel.arena = 0
    take = s.monitor.take

    def take_with_the_other():
        sample = take()
        s.monitor.latest = replace(sample, pids={**sample.pids, kernel_id: (OTHER,)})
        return s.monitor.latest

    s.monitor.take = take_with_the_other
    s.sample()


def test_a_park_short_of_host_memory_asks_a_running_kernel_to_give_back_its_kept_arena_first(setup):
    s = setup()
    _kept_elsewhere(s, "k2")
    need, margin = arena_bytes(SERVED), s.parker.settings.host_margin

    def reading():  # 1 GiB short of this park's arena, until the other kernel's arena comes back
        return HostReading(available=need + margin - GiB + (need if "release" in s.kernel.actions() else 0))

    s.parker.host_reading = reading  # type: ignore[method-assign]
    park = s.park()
    assert park["state"] == "parked", park
    assert s.kernel.actions()[-3:] == ["facts", "release", "park"]
    assert s.parker._plans["k2"].arena_kept == 0


def test_no_arena_is_given_back_where_all_of_them_would_not_make_the_park_fit(setup):
    s = setup()
    _kept_elsewhere(s, "k2")
    need, margin = arena_bytes(SERVED), s.parker.settings.host_margin
    s.parker.host_reading = lambda: HostReading(available=margin - GiB)  # type: ignore[method-assign]
    park = s.park()
    assert park["state"] != "parked" and "did not park" in park["reason"], park
    assert "release" not in s.kernel.actions() and s.parker._plans["k2"].arena_kept == need


def test_a_kernel_restarted_since_its_fast_resume_holds_no_kept_arena(setup):
    s = setup()
    s.park()
    assert s.resume()["state"] not in ("parked", "waiting")
    s.sample()
    assert s.parker.round().kernels[0].host_need == 0  # its arena kept
    # Restarted: another process is the kernel's now, holding memory of its own and no arena.
    restarted = PID + 2
    FakeNvml.set_usage(restarted, UUID, SERVED + CONTEXT)
    s.monitor.pids = (restarted,)
    s.sample()
    (kernel,) = s.parker.round().kernels
    assert kernel.host_cost is None and kernel.host_need == kernel.host_bytes > 0
    assert s.parker._kept_arenas() == {}  # nothing to ask it to give back



def test_a_kernel_whose_process_ended_during_its_restore_is_gone_not_lost(setup, monkeypatch, caplog):
    """The checkpoint path: a kernel shut down (or killed) while its restore ran makes the driver's call fail (304);
    its processes ended, so nothing was lost by the restore and there is nothing left to restore. Said as gone (its
    processes exited), not as a lost GPU state (the error a failed restore into a full device earns)."""
    import gpu_quota_ext.parking.parker as parker_module

    s = setup(fast_park="off")
    assert s.park()["state"] == "parked"
    ended: set = set()
    alive = parker_module.psutil.pid_exists
    monkeypatch.setattr(parker_module.psutil, "pid_exists", lambda pid: pid not in ended and alive(pid))

    def restore_while_the_process_ends(self, pid):
        ended.add(pid)
        raise CheckpointError("cuCheckpointProcessRestore", pid, CUDA_ERROR_OPERATING_SYSTEM)

    monkeypatch.setattr(FakeCheckpoint, "restore", restore_while_the_process_ends)
    with caplog.at_level(logging.INFO, logger="gpu_quota_ext"):
        park = s.resume()
    assert park["state"] in ("idle", "busy"), park  # no longer held: nothing parked, nothing lost
    assert ended == {PID}
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert any("its processes ended during the restore" in text for _, text in said), said
    assert not any(level >= logging.ERROR for level, _ in said), said
