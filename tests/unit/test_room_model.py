"""One model of room, host memory included, under any interleaving (issue 28, issue 32 item 1).

A host of a few kernels on one GPU, run by the project's pure parts exactly as the parker and the host service
call them: each kernel's record through states.transition, what the broker sees through shown.shown_as, the
broker's decide, the host's memory through HostAccount (a server's own parks) or the host service's HostRoom
(`host_park` promises, ended by its servers' reports). Around them the world, drawn by hypothesis: idle timers
firing, users asking to park and resume, cells starting and ending (a busy kernel allocating up to its cap), the
broker's and the host service's parks, samples taken late, the driver's calls landing bit by bit, returning or
failing, and processes dying.

What must hold whatever the order:
- never more host memory promised than there is: every park under way can land with the margin still free;
- every promise ends exactly once, whatever the path (parked, refused, called off, failed, process dead): a
  kernel holds one while its driver call is out, and no longer (on a hub host: no longer than its server's
  reports still say its park is under way, until the next sample);
- never two holders of the same device bytes: what kernels hold, and what is reserved for restores under way,
  fits the device; and no restore ever finds too little room (a restore into a full device loses the kernel).

What the model assumes, as the design does: a kernel that was not running a cell when the broker last decided
allocates only room nobody was granted (its room check before the cell knows the latest grants). Without that,
the model found (2026-12-04) an idle kernel whose headroom no park could cover (headroom.short_on said "not
short" then) starting a cell while a restore granted into its unclaimed headroom was still copying: the allocator
had those bytes free, the restore then found too little and the kernel being restored was lost. Since then
short_on says "short" while a restore under way holds room on the device (the cell waits until it has landed, then
the broker lets it run: broker._room_may_come), and the parker pushes the room flags right after a grant as well as
at each sample. The last test below states it on headroom.short_on itself.

Deterministic in CI: hypothesis derandomized (the same examples every run), a few seconds in all.
"""

from __future__ import annotations

import sys
from typing import Dict, Optional, Tuple

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpu_quota_ext.devices import Device
from gpu_quota_ext.hub.service.room import HostRoom, ParkReport
from gpu_quota_ext.parking import BrokerSettings, HostReading, HostView, Said, decide, park_time, shown_as
from gpu_quota_ext.parking.broker import Demand, DeviceView, KernelView, Reservation, Round
from gpu_quota_ext.parking.headroom import short_on
from gpu_quota_ext.parking.host_account import HostAccount
from gpu_quota_ext.parking.parker import room_right_now
from gpu_quota_ext.parking.states import (
    AskPark,
    AskResume,
    Busy,
    Checkpoint,
    Decide,
    Idle,
    ParkChecked,
    ParkDone,
    ParkRecord,
    Restore,
    RestoreDeferred,
    ResumeDone,
    RoomGranted,
    RoomTold,
    RoomWait,
    Sampled,
    StartPark,
    transition,
)
from gpu_quota_ext.shared.park_state import CLAIMING, ParkState
from gpu_quota_ext.shared.sizes import GiB

KERNELS = ("k0", "k1", "k2")
DEVICE = Device(0, "Test GPU", "GPU-model-0", 16 * GiB)  # less than the caps together: room is short
SETTINGS = BrokerSettings(device_margin=GiB, host_margin=2 * GiB, min_idle=30.0, wait_limit=300.0)
IDLE_AFTER = 60.0  # the idle timer
MARGIN = SETTINGS.host_margin


class Room(RuleBasedStateMachine):
    @initialize(
        hub=st.booleans(),
        host_total=st.integers(4, 64).map(lambda g: g * GiB),
        caps=st.lists(st.integers(4, 12).map(lambda g: g * GiB), min_size=len(KERNELS), max_size=len(KERNELS)),
        shares=st.lists(st.floats(0.1, 0.6), min_size=len(KERNELS), max_size=len(KERNELS)),
    )
    def start(self, hub, host_total, caps, shares):
        self.hub = hub  # the host service holds the host's account (host_park), else the server's own
        self.host_total = host_total
        self.caps = dict(zip(KERNELS, caps))
        self.now = 1000.0
        self.generation = {k: 0 for k in KERNELS}  # a dead kernel's slot starts a new kernel (a new id)
        self.records: Dict[str, ParkRecord] = {}
        self.busy = {k: False for k in KERNELS}
        self.last_active = {k: self.now for k in KERNELS}
        self.used = {k: int(self.caps[k] * share) for k, share in zip(KERNELS, shares)}  # device bytes, the truth
        while sum(self.used.values()) > DEVICE.total:  # what the kernels held before the model began fits the device
            self.used = {k: n // 2 for k, n in self.used.items()}
        self.on_host = {k: 0 for k in KERNELS}  # host bytes of its park (landed), the truth
        self.checks: Dict[str, int] = {}  # a park's look before the driver, still to come: kernel -> op
        self.calls: Dict[str, Tuple[str, int, int, int]] = {}  # kernel -> (call, op, bytes, landed so far)
        self.deadline: Dict[str, float] = {}  # kernel -> when its park's call has returned at the latest
        self.account = HostAccount()
        self.service = HostRoom()
        self.sample_used = dict(self.used)
        self.sample_time: Optional[float] = None
        self.decisions = 0
        self.claimed: Dict[str, int] = {}  # kernel -> the first decision of those since that counted its cap claimed
        self.granted: Dict[str, int] = {}  # kernel -> the decision that granted its restore's room
        self.decide_soon = False

    # --- the world's facts ----------------------------------------------------------------------------------

    def kid(self, k: str) -> str:
        return f"{k}-{self.generation[k]}"

    def record(self, k: str) -> ParkRecord:
        return self.records.get(k) or ParkRecord(since=self.now)

    def host_reading(self) -> HostReading:
        return HostReading(available=self.host_total - sum(self.on_host.values()))

    def reserved(self, k: str) -> int:
        return self.record(k).room.get(0, 0)

    # --- the parker: a record's events and their effects (Parker._handle, _carry_out) ------------------------

    def handle(self, k: str, event) -> None:
        new, effects = transition(self.record(k), event, self.now)
        self.records[k] = new
        for effect in effects:
            if isinstance(effect, StartPark):
                self.checks[k] = effect.op
            elif isinstance(effect, Checkpoint):
                nbytes = sum(new.parked.values())
                if not self.hub:
                    self.account = self.account.promise(self.kid(k), nbytes)
                self.calls[k] = ("checkpoint", effect.op, nbytes, 0)
                self.deadline[k] = self.now + park_time(nbytes)
            elif isinstance(effect, Restore):
                restoring = [o for o in KERNELS if o != k and self.calls.get(o, ("",))[0] == "restore"]
                others = {0: sum(self.reserved(o) for o in restoring)}  # granted, not landed yet
                why = room_right_now(dict(new.parked), {0: DEVICE.total}, lambda i: sum(self.used.values()), others, 0)
                if why is not None:
                    self.handle(k, RestoreDeferred(effect.op, why))
                else:
                    self.calls[k] = ("restore", effect.op, sum(new.parked.values()), 0)
            elif isinstance(effect, Decide):
                self.decide_soon = True  # Parker.decide_soon: once this step is done

    def said(self, k: str) -> Said:
        """Parker._said, on the model's facts."""
        record = self.record(k)
        held = record.shows_park
        state = record.state if held else (ParkState.BUSY if self.busy[k] else ParkState.IDLE)
        taken = self.sample_time
        return Said(
            state=state,
            at=self.now,
            idle_for=None if self.busy[k] else self.now - self.last_active[k],
            parkable=self.sample_used[k] > 0 and not record.refused,
            in_reading=state == ParkState.PARKED and (taken is None or record.since >= taken),
            stuck=False,
        )

    def round_(self) -> Round:
        kernels = []
        demands = []
        reservations = []
        for k in KERNELS:
            view = shown_as(self.said(k), self.now)
            kernels.append(
                KernelView(
                    self.kid(k), view.state, {0: self.sample_used[k]}, {0: self.caps[k]}, view.idle_for, view.parkable
                )
            )
            record = self.record(k)
            if record.state == ParkState.WAITING and record.deferred_at is None:
                demands.append(Demand(self.kid(k), dict(record.parked), record.waiting_since or self.now))
            if record.room:
                reservations.append(Reservation(self.kid(k), dict(record.room)))
        used = sum(self.sample_used.values())
        host = self.host_reading()
        promised = self.account if not self.hub else self.service._host
        return Round(
            (DeviceView(0, "GPU 0", DEVICE.total, used),), tuple(kernels), tuple(demands), tuple(reservations),
            HostView(host.available, None, promised.outstanding(), promised.kernels()), SETTINGS, self.now,
        )

    def slot(self, kernel_id: str) -> Optional[str]:
        return next((k for k in KERNELS if self.kid(k) == kernel_id), None)

    def report(self) -> None:
        """The end of a step: the broker decides if a change asked it to (or a sample came: on_sample); on a hub
        host every server reports its kernels' shown states (leases, room calls): the service's promises end by
        these reports, and with the grants of kernels that are gone."""
        for _ in range(3):
            if not self.decide_soon:
                break
            self.decide_soon = False
            self.decide()
        if not self.hub:
            return
        reports = {}
        for k in KERNELS:
            view = shown_as(self.said(k), self.now)
            reports[self.kid(k)] = ParkReport(view.state, view.idle_for, view.parkable)
        self.service.hear("u", "", reports, self.now, lease=True)
        self.service.expire(self.now, {self.kid(k) for k in KERNELS}, 1e9)

    # --- rules: the world ------------------------------------------------------------------------------------

    @rule(seconds=st.sampled_from([1.0, 5.0, 30.0, 120.0]), sampled=st.booleans())
    def time_passes(self, seconds, sampled):
        """Time passes. A park's driver call returns within park_time (its bytes at PARK_RATE, the slowest measured
        rate halved, plus PARK_MARGIN): the time the host service keeps its promise for at most."""
        for k in sorted(k for k, c in self.calls.items() if c[0] == "checkpoint"):
            if self.deadline[k] <= self.now + seconds:
                self.now = max(self.now, self.deadline[k] - 1)
                self.returns(k, True)
        self.now += seconds
        if sampled:
            self.sample()
            self.decide_soon = True  # Parker.on_sample asks the broker
        self.report()

    def sample(self):
        """The monitor's sample (the parker's, and the host service's of every user's kernels)."""
        self.sample_used = dict(self.used)
        self.sample_time = self.now
        self.service.note_sample(self.now, {self.kid(k): {DEVICE.uuid: n} for k, n in self.used.items() if n})
        for k in list(self.records):
            self.handle(k, Sampled(self.now))
        self.report()

    @rule(k=st.sampled_from(KERNELS), starts=st.booleans(), want=st.integers(0, 12).map(lambda g: g * GiB))
    def cell(self, k, starts, want):
        """A cell starts, and allocates up to the kernel's cap, or ends. The device's allocator gives what is free,
        reserved or not; what keeps a reservation from a kernel's allocation is the broker's count of that kernel's
        cap as claimed (it ran a cell at every decision since, from one made before the grant), or else its room
        check before the cell (headroom.py, kernel/room_check.py), which the model assumes knows every grant (see
        the module's docstring: that assumption is the design's)."""
        self.busy[k] = starts
        self.last_active[k] = self.now
        self.handle(k, Busy() if starts else Idle())
        if starts and self.record(k).state == "running":
            claimed = self.claimed.get(k, float("inf"))
            restoring = [o for o in KERNELS if o != k and self.calls.get(o, ("",))[0] == "restore"]
            unseen = sum(self.reserved(o) for o in restoring if self.granted.get(o, 0) < claimed)
            free = DEVICE.total - sum(self.used.values()) - unseen
            self.used[k] = max(self.used[k], min(want, self.caps[k], self.used[k] + max(0, free)))
        self.report()

    @rule(which=st.integers(0, len(KERNELS) - 1))
    def parked_kernels_cell(self, which):
        """A cell of a kernel the parker holds starts (parked: it waits for room to come back to): the way most
        resumes begin, drawn here among those kernels, so that the search spends its steps where room is granted."""
        held = [k for k in KERNELS if self.record(k).state in (ParkState.PARKED, ParkState.PARKING)]
        if held:
            self.cell(held[which % len(held)], True, 0)

    @rule(k=st.sampled_from(KERNELS), who=st.sampled_from(["idle timer", "user park", "user resume"]))
    def asked(self, k, who):
        """The idle timer fires, or the user asks to park or to resume (the sidebar, %gpucap park)."""
        problem = None if self.used[k] > 0 else "holds no GPU memory"
        if who == "idle timer":
            if self.busy[k] or self.record(k).shows_park or self.now - self.last_active[k] < IDLE_AFTER:
                return
            self.handle(k, AskPark("idle for 1 min", problem, False, automatic=True))
        elif who == "user park":
            self.handle(k, AskPark("user request", problem, self.busy[k]))
        else:
            self.handle(k, AskResume())
        self.report()

    @rule(k=st.sampled_from(KERNELS), ok=st.integers(0, 3).map(bool))
    def parks_at_once(self, k, ok):
        """A user's park that runs through before anything else happens: asked, looked at, its call returned."""
        self.asked(k, "user park")
        if k in self.checks:
            self.park_checked(k)
        if self.calls.get(k, ("",))[0] == "checkpoint":
            self.returns(k, ok)
        self.report()

    @rule()
    def broker_round(self):
        """The broker decides at another's call (the host service decides for every user's servers at once)."""
        self.decide()
        self.report()

    def decide(self) -> None:
        """The broker decides (the server's own, or the host service's for everyone: the same decide) and its plan
        is carried out as Parker.apply does; the parks it asks are the host service's parks on a hub host."""
        round_ = self.round_()
        plan = decide(round_)
        self.decisions += 1
        claiming = {self.slot(v.kernel_id) for v in round_.kernels if v.state in CLAIMING and v.used.get(0, 0) > 0}
        self.claimed = {k: self.claimed.get(k, self.decisions) for k in claiming}
        for victim, _ in plan.park:
            k = self.slot(victim)
            if k is not None and not self.record(k).shows_park and not self.busy[k]:
                problem = None if self.used[k] > 0 else "holds no GPU memory"
                self.handle(k, AskPark("to make room", problem, False, automatic=True))
        for kernel_id in plan.go:
            k = self.slot(kernel_id)
            if k is not None and self.record(k).state == ParkState.WAITING:
                self.granted[k] = self.decisions
                self.handle(k, RoomGranted())
        for kernel_id, message in plan.told.items():
            k = self.slot(kernel_id)
            if k is not None and self.record(k).state == ParkState.WAITING and not self.record(k).told:
                self.handle(k, RoomTold(message))
        for kernel_id, reason in plan.waiting.items():
            k = self.slot(kernel_id)
            if k is not None and self.record(k).state == ParkState.WAITING and not self.record(k).told:
                self.handle(k, RoomWait(reason))

    @precondition(lambda self: self.checks or self.calls)
    @rule(which=st.integers(0, 7), ok=st.integers(0, 3).map(bool))
    def driver(self, which, ok):
        """What waits on the parker's side goes on: a park's look before the driver, or a driver call returns (a
        park or a restore; one in four fails)."""
        waiting = [("check", k) for k in sorted(self.checks)] + [("call", k) for k in sorted(self.calls)]
        step, k = waiting[which % len(waiting)]
        if step == "check":
            self.park_checked(k)
        else:
            self.returns(k, ok)

    def park_checked(self, k: str) -> None:
        """The parker's look right before the driver: what the kernel holds now, the host's memory asked for it
        (the server's own account, or the host service's `host_park`), and the record told in the same step."""
        op = self.checks.pop(k)
        record = self.record(k)
        if record.op != op or record.state != ParkState.PARKING:
            return
        nbytes = self.used[k]
        refused = None if nbytes > 0 else "did not park: holds no GPU memory"
        if refused is None and not self.hub:
            refused = self.account.refusal(self.kid(k), nbytes, self.host_reading(), MARGIN)
        if refused is None and self.hub:
            refused = self.service.promise_host(self.kid(k), nbytes, self.host_reading(), MARGIN, self.now)
        self.handle(k, ParkChecked(op, (1,), {0: nbytes} if nbytes else {}, refused))
        self.report()

    @precondition(lambda self: any(c[0] == "checkpoint" for c in self.calls.values()))
    @rule(which=st.integers(0, 3), share=st.floats(0, 1))
    def bytes_land(self, which, share):
        """Part of a park's bytes reach its processes' host memory (the host's reading shows them)."""
        moving = sorted(k for k, c in self.calls.items() if c[0] == "checkpoint")
        k = moving[which % len(moving)]
        call, op, nbytes, landed = self.calls[k]
        more = int((nbytes - landed) * share)
        self.on_host[k] += more
        self.calls[k] = (call, op, nbytes, landed + more)
        if not self.hub:
            self.account = self.account.landing({self.kid(k): landed + more})

    def returns(self, k: str, ok: bool) -> None:
        call, op, nbytes, landed = self.calls.pop(k)
        if call == "checkpoint":
            if ok:
                self.on_host[k] += nbytes - landed
                self.used[k] -= nbytes
            else:
                self.on_host[k] -= landed  # nothing was moved
            if not self.hub:
                self.account = self.account.release(self.kid(k))  # returned, whatever it returned
            self.handle(k, ParkDone(op, None if ok else "did not park: CUDA_ERROR_UNKNOWN"))
        else:
            free = DEVICE.total - sum(self.used.values())
            assert free >= nbytes, f"a restore of {nbytes} found {free} free: two holders of the same bytes"
            if ok:
                self.used[k] += nbytes
                self.on_host[k] -= nbytes
            self.handle(k, ResumeDone(op, None if ok else "did not resume: CUDA_ERROR_UNKNOWN"))
        self.report()

    @rule(k=st.sampled_from(KERNELS))
    def process_dies(self, k):
        """Its processes end (the OOM killer, a restart): its memory on both sides is freed, a driver call of it
        returns (CUDA_ERROR_NOT_FOUND), the parker forgets it, and its slot starts a new kernel."""
        self.account = self.account.release(self.kid(k))  # the call's end and Parker.forget (on a hub: expire)
        self.calls.pop(k, None)
        self.checks.pop(k, None)
        self.records.pop(k, None)
        self.used[k] = self.on_host[k] = 0
        self.busy[k] = False
        self.claimed.pop(k, None)
        self.granted.pop(k, None)
        self.generation[k] += 1
        self.last_active[k] = self.now
        self.report()

    # --- what must hold ---------------------------------------------------------------------------------------

    def promises(self) -> HostAccount:
        return self.service._host if self.hub else self.account

    @invariant()
    def every_park_under_way_can_land_with_the_margin_free(self):
        if not hasattr(self, "calls"):
            return
        moving = {k: c for k, c in self.calls.items() if c[0] == "checkpoint"}
        if not moving:
            return
        settled = sum(n for k, n in self.on_host.items() if k not in moving)
        coming = sum(c[2] for c in moving.values())
        assert self.host_total - settled - coming >= MARGIN, (self.host_total, settled, coming)

    @invariant()
    def a_promise_is_held_exactly_while_its_driver_call_is_out(self):
        if not hasattr(self, "calls"):
            return
        out = {self.kid(k) for k, c in self.calls.items() if c[0] == "checkpoint"}
        promised = self.promises().kernels()
        assert out <= promised, "a promise ended while its park's bytes were still coming"
        if not self.hub:
            assert promised == out, "a promise outlived its driver call"
            return
        # The host service hears of a park's end from its server's next report. Its server says "parking" while its
        # last sample predates the park's end (shown.py): only until the next sample, then the promise ends.
        said_parking = {self.kid(k) for k in KERNELS if shown_as(self.said(k), self.now).state == ParkState.PARKING}
        assert promised - out <= said_parking, "a promise outlived its park's last report of being under way"

    @invariant()
    def never_two_holders_of_the_same_device_bytes(self):
        if not hasattr(self, "calls"):
            return
        held = sum(max(self.used[k], self.reserved(k)) for k in KERNELS)
        assert held <= DEVICE.total, (self.used, {k: self.reserved(k) for k in KERNELS})


Room.TestCase.settings = settings(
    max_examples=300, stateful_step_count=80, deadline=None, derandomize=True, database=None
)
test_any_interleaving_keeps_host_memory_promises_and_device_bytes_single = Room.TestCase


def test_the_model_runs_the_shown_rule_of_both_callers():
    # The model's kernels are shown through shown.shown_as, as Parker.round() and the host service show them.
    model = Room()
    model.start(hub=False, host_total=8 * GiB, caps=[GiB] * len(KERNELS), shares=[0.5] * len(KERNELS))
    assert {k.state for k in model.round_().kernels} == {ParkState.IDLE}
    model.teardown()


def a_resume_beside_a_growing_kernel(hub: bool) -> Room:
    """k0 (8 GiB) parks and its cell asks it back at once; k1 (4 GiB, cap 12 GiB) then runs a cell that takes all
    its cap allows, whatever the device has free, while k0's restore is under way."""
    model = Room()
    model.start(hub=hub, host_total=48 * GiB, caps=[10 * GiB, 12 * GiB, 4 * GiB], shares=[0.8, 1 / 3, 0.0])
    model.asked("k0", "user park")
    model.driver(0, True)  # its look before the driver: the host's memory promised
    model.driver(0, True)  # the checkpoint returns
    model.time_passes(1.0, True)
    model.cell("k1", True, 0)  # busy at the broker's next round: its headroom claimed, then it grows
    model.time_passes(1.0, True)
    model.cell("k0", True, 0)  # k0 waits for room; the broker grants what k1's claim leaves
    model.cell("k1", True, 12 * GiB)
    for _ in range(3):
        if model.calls:
            model.driver(0, True)
        model.time_passes(1.0, True)
    return model


def check(model: Room) -> None:
    model.every_park_under_way_can_land_with_the_margin_free()
    model.a_promise_is_held_exactly_while_its_driver_call_is_out()
    model.never_two_holders_of_the_same_device_bytes()


def test_a_resume_and_a_growing_kernel_never_hold_the_same_bytes():
    for hub in (False, True):
        model = a_resume_beside_a_growing_kernel(hub)
        check(model)
        # k1 ran a cell when the broker decided: its whole cap is counted, so k0 waits for room, told why.
        assert model.record("k0").state == ParkState.WAITING and "k1-0 holds 12.0 GiB" in model.record("k0").reason
        assert model.used["k1"] == 12 * GiB and not model.calls


def test_the_invariants_catch_a_broker_that_forgets_a_claim(monkeypatch):
    # The same steps with the broker counting no running kernel's headroom, and no fresh look before the restore:
    # the restore is granted the bytes k1's cap still allows it, k1 takes them, and the model says so.
    monkeypatch.setattr(KernelView, "headroom", lambda self, key: 0)
    monkeypatch.setattr(sys.modules[__name__], "room_right_now", lambda *args: None)
    with pytest.raises(AssertionError, match="two holders|<="):
        check(a_resume_beside_a_growing_kernel(False))


def test_a_kernel_its_room_check_lets_run_never_takes_the_bytes_of_a_restore_under_way():
    # k0's restore (8 GiB) was granted and is copying; idle k1 (2 GiB held, cap 12 GiB: its headroom unclaimed) starts
    # a cell. Nothing idle could be parked for it, so its room check lets it run, and the device's allocator has 14 GiB
    # free until the restore has them: k1 may take 10 GiB, and the restore then finds 4 GiB for its 8.
    k0 = KernelView("k0", ParkState.RESUMING, {0: 0}, {0: 10 * GiB})
    k1 = KernelView("k1", ParkState.IDLE, {0: 2 * GiB}, {0: 12 * GiB}, idle_for=5.0, parkable=True)
    round_ = Round(
        (DeviceView(0, "GPU 0", DEVICE.total, 2 * GiB),), (k0, k1), (), (Reservation("k0", {0: 8 * GiB}),),
        HostView(), SETTINGS, 0.0,
    )
    lets_run = short_on(k1, round_) is None
    takes = min(k1.caps[0] - k1.used[0], DEVICE.total - 2 * GiB) if lets_run else 0
    assert takes <= DEVICE.total - 2 * GiB - 8 * GiB, "the restore's reserved bytes went to a kernel its check let run"
