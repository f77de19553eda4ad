"""A swap through the parker (docs/admin/fast-park.md, "A swap: both copies at once"): D, parked, wants back in; the
device is full; V, idle, parks to make room. Through the fast path D's resume starts while V's park still copies
(V releases each piece as it is copied, D's library waits, bounded, for the pieces); D parked through the
checkpoint path waits for V's park to end, as before; a fast resume whose wait ran out is parked and whole, and
waits for room again; a fast park answered "parked in part" is parked.

The kernels are played by a fake control channel that keeps the order of what it was asked in `events` (V's park
cannot end before D's resume has begun where the two overlap: nothing is timed); the checkpoint path by
FakeCheckpoint over the fake NVML. No server, no GPU: the harness of test_fast_park_parker, with two kernels."""

from __future__ import annotations

import asyncio
import datetime
import os
from typing import Dict, List, Optional, Tuple

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.parking import ParkSettings
from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
from gpu_quota_ext.parking.kernel_channel import KernelChannel
from gpu_quota_ext.parking.pages_driver import E_PARTIAL
from gpu_quota_ext.parking.parker import SWAP_WAIT, Parker, Sampling, room_right_now
from gpu_quota_ext.usage import Sample
from gpu_quota_ext.usage.sampling import DeviceReading

from .fakes import UUID, Grants, ParkerKernels, ParkerOnALoop, grant

GiB, MiB = 1 << 30, 1 << 20
TOTAL = 16 * GiB
SERVED = 6 * GiB  # what each kernel's library maps: what a fast park moves
CONTEXT = 512 * MiB  # stays on the device through a fast park
OUTSIDE = 3 * GiB  # held by a process outside the quota: with both kernels on the device, it is full
HOST = 64 * GiB
D, V = "kd", "kv"
PIDS = {D: os.getpid(), V: os.getppid()}  # live processes: the drivers ask whether they still exist
FALLBACK = 10.0  # seconds a fake waits for the other copy before it gives up: only a broken swap ever reaches it


class TwoKernels(Sampling):
    """The monitor's last sample, made from the fake NVML by `take`: one device, D's and V's processes."""

    def __init__(self) -> None:
        self.latest = Sample(state="starting")

    def sample_soon(self) -> None:
        pass

    def device_used_now(self, index: int) -> Optional[int]:
        return TOTAL - (FakeNvml.free(UUID) or 0)

    def take(self) -> Sample:
        held = {k: FakeNvml.usage.get(pid, {}).get(UUID, 0) for k, pid in PIDS.items()}
        self.latest = Sample(
            state="ok",
            time=datetime.datetime.now().timestamp(),
            devices={0: DeviceReading(0, self.device_used_now(0))},
            kernels={k: {0: n} for k, n in held.items() if n},
            pids={k: (PIDS[k],) for k, n in held.items() if n},
        )
        return self.latest


class SwapKernels(KernelChannel):
    """D and V with the library preloaded, as their control channels answer (kernel/fast_park.py's replies). Where
    `hold_park` is on, a park ends only once `park_may_end` is set (D's resume beginning sets it: a swap's V ends
    after D began); where `overlap` is on, D's resume (its library waiting for room) ends only once V's park has."""

    def __init__(self, torch_cuda: Dict[str, bool]):
        super().__init__(kernels=None)
        self.torch_cuda = torch_cuda
        self.state = {k: "running" for k in PIDS}
        self.asked: List[Tuple[str, dict]] = []
        self.events: List[Tuple[str, str]] = []
        self.hold_park = False
        self.overlap = False
        self.park_may_end = asyncio.Event()
        self.park_answer: Dict[str, dict] = {}  # kernel -> its park's answer, where not a plain success
        self.resume_answer: Dict[str, dict] = {}
        self.park_began = asyncio.Event()
        self.park_ended = asyncio.Event()
        for pid in PIDS.values():
            FakeNvml.set_usage(pid, UUID, SERVED + CONTEXT)

    async def ask(self, kernel_id: str, content: dict, timeout: float) -> Optional[dict]:
        self.asked.append((kernel_id, dict(content)))
        action = content.get("action")
        if action == "trim":
            return {"freed": 0}
        if action == "facts":
            torch = self.torch_cuda[kernel_id]
            return {
                "preloaded": True, "library_problem": None, "torch_cuda": torch, "allocator_backend": "native",
                "expandable_segments": False, "served_bytes": SERVED if torch else 0, "arena_bytes": 0,
                "state": self.state[kernel_id],
            }
        if action == "park":
            return await self._park(kernel_id)
        if action == "resume":
            return await self._resume(kernel_id, content)
        return {"error": f"unknown action {action!r}"}

    async def _park(self, kernel_id: str) -> dict:
        self.events.append((kernel_id, "park begins"))
        self.park_began.set()
        if self.hold_park:
            try:
                await asyncio.wait_for(self.park_may_end.wait(), FALLBACK)
            except asyncio.TimeoutError:
                self.events.append((kernel_id, "no resume began while it copied"))
        answer = self.park_answer.get(kernel_id, {"code": 0, "message": "parked", "seconds": 0.5, "bytes": SERVED})
        if answer["code"] in (0, E_PARTIAL):
            self.state[kernel_id] = "parked"
            FakeNvml.set_usage(PIDS[kernel_id], UUID, CONTEXT if answer["code"] == 0 else CONTEXT + SERVED // 2)
        self.events.append((kernel_id, "park ends"))
        self.park_ended.set()
        return answer

    async def _resume(self, kernel_id: str, content: dict) -> dict:
        self.events.append((kernel_id, "resume begins"))
        self.park_may_end.set()
        if self.overlap:  # the library backs its memory as the park under way frees it
            try:
                await asyncio.wait_for(self.park_ended.wait(), FALLBACK)
            except asyncio.TimeoutError:
                self.events.append((kernel_id, "no park ended while it waited"))
        answer = self.resume_answer.get(kernel_id)
        if answer is None:
            self.state[kernel_id] = "running"
            FakeNvml.set_usage(PIDS[kernel_id], UUID, SERVED + CONTEXT)
            answer = {"code": 0, "message": "resumed", "seconds": 0.5, "bytes": SERVED}
        self.events.append((kernel_id, "resume ends"))
        return answer

    def contents(self, kernel_id: str, action: str) -> List[dict]:
        return [c for k, c in self.asked if k == kernel_id and c.get("action") == action]


class Swap(ParkerOnALoop):
    """D parked (through the fast path, or the checkpoint path where `d_torch` is off), V idle and holding as much,
    and a process outside the quota: D's resume does not fit until V has parked."""

    def __init__(self, d_torch: bool = True):
        FakeNvml.reset()
        FakeCheckpoint.reset()
        FakeNvml.totals = {UUID: TOTAL}
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)  # the fake's asyncio.Events bind it on Python 3.9
        self.kernel = SwapKernels({D: d_torch, V: True})
        self.monitor = TwoKernels()
        self.kernels = ParkerKernels({D: "idle", V: "idle"}, idle_for=600)
        self.parker = Parker(
            ParkSettings(fresh_sample_wait=0, min_idle=60, device_margin=GiB // 2, fast_park="on"),
            FakeCheckpoint(),
            self.kernels,
            Grants([grant(D, {0: 8 * GiB}), grant(V, {0: 8 * GiB})]),
            {0: Device(index=0, name="fake", uuid=UUID, total=TOTAL, nvml_index=0)},
            self.monitor,
            host=lambda: (HOST, None),
            channel=self.kernel,
            bootstrapped=lambda kernel_id: True,
        )
        self.start()
        self.run(self.parker.request_park(D))
        self.settle()
        assert self.state(D) == "parked", self.parker.kernel_json(D)
        FakeNvml.other_used = {UUID: OUTSIDE}
        self.kernel.events.clear()
        self.sample()

    def state(self, kernel_id: str) -> str:
        return self.parker.kernel_json(kernel_id)["state"]

    def ask_resume(self) -> None:
        """D's next cell wants it back: the broker parks V for it."""
        self.run(self.parker.request_resume(D))

    def until_vs_park_began_and_was_decided_on(self) -> None:
        """Run the loop until V's park is copying and the broker's decision that its start raised has been applied
        (no settle: V's park does not end on its own here)."""

        async def wait() -> None:
            await asyncio.wait_for(self.kernel.park_began.wait(), FALLBACK)
            while self.parker._deciding is not None and not self.parker._deciding.done():
                await self.parker._deciding

        self.run(wait())


@pytest.fixture
def swap():
    made: List[Swap] = []

    def make(**kwargs) -> Swap:
        made.append(Swap(**kwargs))
        return made[-1]

    yield make
    for one in made:
        one.close()
    asyncio.set_event_loop(None)


def test_a_fast_resume_starts_while_the_fast_park_that_makes_its_room_still_copies(swap):
    s = swap()
    s.kernel.hold_park = s.kernel.overlap = True
    s.ask_resume()
    s.settle()
    assert s.kernel.events == [
        (V, "park begins"), (D, "resume begins"), (V, "park ends"), (D, "resume ends")
    ], s.kernel.events
    assert s.state(V) == "parked" and s.state(D) not in ("parked", "waiting", "resuming", "lost")
    (park,) = s.kernel.contents(V, "park")
    assert park["release_as_copied"] is True
    (resume,) = s.kernel.contents(D, "resume")
    assert resume["wait_for_room"] == min(SWAP_WAIT, s.parker.settings.call_timeout / 2) > 0
    assert FakeCheckpoint.calls == []  # both went through the kernels' own library


def test_a_checkpoint_restore_waits_for_the_fast_park_to_end_before_it_starts(swap):
    s = swap(d_torch=False)  # D parked through the checkpoint path: its restore into a full device would lose it
    s.kernel.hold_park = True
    s.ask_resume()
    s.until_vs_park_began_and_was_decided_on()
    # V releases as it copies, and the broker knows it: D still may not count on those bytes.
    round_ = s.parker.round()
    assert [k.releases_as_copied for k in round_.kernels if k.kernel_id == V] == [True]
    assert [(d.kernel_id, d.may_wait) for d in round_.demands] == [(D, False)]
    assert s.state(D) == "waiting" and "kernel kv" in s.parker.kernel_json(D)["reason"]
    assert not [call for call, pid in FakeCheckpoint.calls if call == "cuCheckpointProcessRestore"]
    s.kernel.park_may_end.set()  # V's park may end now (nothing of D's will end it)
    s.settle()
    for _ in range(2):  # the broker decides on a sample taken after V's park ended
        s.sample()
    assert s.kernel.events == [(V, "park begins"), (V, "park ends")]
    assert "cuCheckpointProcessRestore" in [call for call, _ in FakeCheckpoint.calls]
    assert s.state(D) not in ("parked", "waiting", "resuming", "lost"), s.parker.kernel_json(D)


def test_a_fast_resume_whose_wait_for_room_ran_out_is_parked_and_whole_and_waits_again(swap):
    s = swap()
    s.kernel.hold_park = s.kernel.overlap = True
    # V's park fails before it frees anything (its host memory ran short); D's library waits for the room, in vain.
    s.kernel.park_answer[V] = {"code": -4, "message": "the arena could not be made", "seconds": 0.1}
    s.kernel.resume_answer[D] = {
        "code": 2, "message": "cannot resume: CUDA_ERROR_OUT_OF_MEMORY (2): no memory came free within 60 s",
        "seconds": 60.0,
    }
    s.ask_resume()
    s.settle()
    assert (D, "resume begins") in s.kernel.events
    park = s.parker.kernel_json(D)
    assert park["state"] == "waiting", park  # not lost: every byte is on the host, the kernel parked
    assert "nothing was lost" in park["reason"]
    assert s.kernel.state[D] == "parked" and s.state(V) != "parked"


def test_a_fast_park_answered_parked_in_part_is_parked(swap):
    s = swap()
    words = "piece 2 of 3 not copied: CUDA_ERROR_ILLEGAL_ADDRESS"
    s.kernel.park_answer[V] = {"code": E_PARTIAL, "message": words, "seconds": 0.2}
    s.run(s.parker.request_park(V))
    s.settle()
    park = s.parker.kernel_json(V)
    assert park["state"] == "parked", park  # its library runs no GPU work until a resume brings everything back
    assert s.parker.holds_gpu_state(V)


def test_the_last_check_of_a_fast_resume_counts_what_fast_parks_under_way_free():
    totals = {0: 140 * GiB}
    # 30 GiB free now, 56 GiB being freed by a park under way: a 56 GiB fast resume may start.
    assert room_right_now({0: 56 * GiB}, totals, lambda i: 110 * GiB, {}, GiB, {0: 56 * GiB}) is None
    short = room_right_now({0: 56 * GiB}, totals, lambda i: 110 * GiB, {}, GiB, {0: 20 * GiB})
    assert short and "and 20.0 GiB that parks under way are freeing" in short
    # Without it (the checkpoint path's restore), the same device is too full.
    assert room_right_now({0: 56 * GiB}, totals, lambda i: 110 * GiB, {}, GiB) is not None


# --- on a hub host: the park that makes the room is often another user's, which this server cannot see -----------


class ServiceRooms:
    """The host service's room route as a HostBroker calls it (off the event loop): each body kept; `answer` gives
    what the service says to a body naming demands; a host park (promise_host) is promised."""

    brokers = True

    def __init__(self, answer: Dict[str, object]):
        self.answer = answer
        self.bodies: List[dict] = []

    def room(self, body: dict) -> dict:
        self.bodies.append(body)
        if "host_park" in body:
            return {"host_park": {"kernel_id": body["host_park"]["kernel_id"], "refused": None}}
        return self.answer if body["demands"] else {}


def under_the_host(s: Swap, answer: Dict[str, object]) -> ServiceRooms:
    from gpu_quota_ext.parking import HostBroker

    rooms = ServiceRooms(answer)
    s.parker.broker = HostBroker(rooms, {0: UUID})
    return rooms


@pytest.fixture
def checks(monkeypatch):
    """What each restore's last check (room_right_now) counted as being freed."""
    from gpu_quota_ext.parking import parker as parker_module

    seen: List[Optional[dict]] = []

    def spy(need, totals, used_now, others, margin, freeing=None):
        seen.append(None if freeing is None else dict(freeing))
        return room_right_now(need, totals, used_now, others, margin, freeing)

    monkeypatch.setattr(parker_module, "room_right_now", spy)
    return seen


def test_a_fast_resume_counts_what_the_hosts_go_says_another_users_park_is_freeing_and_a_checkpoint_restore_never(
    swap, checks
):
    # 6 GiB free, D needs 6 GiB and the half-GiB margin: short by half a GiB. Another user's fast park is freeing
    # 2 GiB of it; only the service's go says so (nothing of this server parks).
    freeing = 2 * GiB
    s = swap()
    rooms = under_the_host(s, {"go": [D], "freeing": {D: {UUID: freeing}}})
    s.ask_resume()
    s.settle()
    assert [d.get("may_wait") for body in rooms.bodies for d in body["demands"]] == [True]
    assert checks == [{0: freeing}]
    (resume,) = s.kernel.contents(D, "resume")
    assert resume["wait_for_room"] == min(SWAP_WAIT, s.parker.settings.call_timeout / 2) > 0
    assert s.state(D) not in ("parked", "waiting", "resuming", "lost"), s.parker.kernel_json(D)
    assert s.kernel.contents(V, "park") == [] and s.parker._go_freeing == {}

    # The same go for a D parked through the checkpoint path: its restore into a full device would lose it, so it
    # counts only what is free now, and waits for room again.
    checks.clear()
    c = swap(d_torch=False)
    rooms = under_the_host(c, {"go": [D], "freeing": {D: {UUID: freeing}}})
    c.ask_resume()
    c.settle()
    assert [d.get("may_wait") for d in rooms.bodies[0]["demands"]] == [None]
    assert checks and all(not counted for counted in checks)
    assert not [call for call, pid in FakeCheckpoint.calls if call == "cuCheckpointProcessRestore"]
    assert c.state(D) == "waiting" and "memory was taken since" in c.parker.kernel_json(D)["reason"]


def test_a_fast_park_that_begins_to_release_is_told_to_the_host_at_once_and_in_the_leases_report(swap):
    s = swap()
    rooms = under_the_host(s, {})
    s.kernel.hold_park = True
    s.run(s.parker.request_park(V))
    s.until_vs_park_began_and_was_decided_on()
    # No demand of this server waits: the room call is made for the park's word alone, before the next lease report.
    told = [body for body in rooms.bodies if "host_park" not in body]
    assert len(told) == 1 and told[0]["demands"] == []
    assert [k for k in told[0]["park"] if k["kernel_id"] == V] == [
        {"kernel_id": V, "state": "parking", "idle_for": None, "parkable": False, "releases_as_copied": True}
    ]
    s.parker.publish_host_report()
    assert [k.get("releases_as_copied") for k in s.parker.host_report() if k["kernel_id"] == V] == [True]

    async def decided_again() -> None:  # a sample during the park asks the broker again: nothing new to tell
        s.parker.decide_soon()
        await s.parker._deciding  # type: ignore[misc]

    s.run(decided_again())
    assert len([body for body in rooms.bodies if "host_park" not in body]) == 1
    s.kernel.park_may_end.set()
    s.settle()
    assert s.state(V) == "parked"
    s.sample()  # a reading taken after the park ended: shown parked, its bytes freed, nothing more to release
    s.parker.publish_host_report()
    assert [(k["state"], k.get("releases_as_copied")) for k in s.parker.host_report() if k["kernel_id"] == V] == [
        ("parked", None)
    ]
