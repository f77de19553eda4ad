"""The broker's decisions (parking/broker.py), pure: examples a person can read, then properties over random
devices, kernels and demands: never two holders of the same bytes, never a restore without room, victims only
among idle parkable kernels idle long enough and only while the host can take them, least recently active
first; a fast resume that goes while the parks making its room still copy only where those parks release as they
copy, and never on bytes promised to another; and, over simulated time, every kernel that waits is served or told
by the limit."""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_quota_ext.parking.broker import (
    BrokerSettings,
    Demand,
    DeviceView,
    HostView,
    KernelView,
    Reservation,
    host_left,
    plan,
    room,
)

from .broker_views import device_view, kernel_view

GiB = 1 << 30
GPU = DeviceView(key=0, name="GPU 0", total=140 * GiB, used=None)
SETTINGS = BrokerSettings(device_margin=GiB, host_margin=2 * GiB, min_idle=60, wait_limit=300)


def device(used: int, total: int = 140 * GiB, key=0) -> DeviceView:
    return device_view(used, total, key)


def kernel(kernel_id, state, used=0, cap=63 * GiB, idle_for=None, parkable=True, key=0) -> KernelView:
    return kernel_view(kernel_id, state, used, cap, idle_for, parkable, key)


# --- the three-kernel scenario of the issue, as the broker sees it -----------------------------------------


def test_a_resume_that_does_not_fit_parks_the_least_recently_active_idle_kernel_first():
    # A parked (56 GiB); B and C hold 56 GiB each, idle; caps 63 GiB; the device has 140 GiB.
    kernels = [
        kernel("A", "waiting"),
        kernel("B", "idle", used=56 * GiB, idle_for=600),
        kernel("C", "idle", used=56 * GiB, idle_for=90),
    ]
    demand = Demand("A", {0: 56 * GiB}, since=1000.0)
    decided = plan([device(113 * GiB)], kernels, [demand], [], HostView(120 * GiB), SETTINGS, now=1001.0)
    assert decided.go == ()
    assert decided.park == (("B", "A"),)  # B has been idle longest; one park covers the need
    assert "making room" in decided.waiting["A"] and "kernel B" in decided.waiting["A"]


def test_while_the_victim_parks_nothing_more_parks_and_the_resume_waits_for_it():
    kernels = [
        kernel("A", "waiting"),
        kernel("B", "parking", used=56 * GiB),
        kernel("C", "idle", used=56 * GiB, idle_for=90),
    ]
    decided = plan(
        [device(113 * GiB)], kernels, [Demand("A", {0: 56 * GiB}, 1000.0)], [], HostView(120 * GiB), SETTINGS, 1010.0
    )
    assert decided.go == () and decided.park == ()
    assert "kernel B parking" in decided.waiting["A"]


# --- a swap: both copies at once (the fast path only) ----------------------------------------------------------


def swap_scene(releases_as_copied: bool):
    """The issue's swap: A parked (56 GiB) wants back in; B (56 GiB) parks for it and is copying; the device has
    140 GiB and 113 GiB of it used."""
    parking = replace(kernel("B", "parking", used=56 * GiB), releases_as_copied=releases_as_copied)
    return [kernel("A", "waiting"), parking, kernel("C", "idle", used=56 * GiB, idle_for=90)]


def test_a_fast_resume_goes_while_the_fast_park_that_makes_its_room_is_still_copying():
    demand = Demand("A", {0: 56 * GiB}, 1000.0, may_wait=True)
    decided = plan([device(113 * GiB)], swap_scene(True), [demand], [], HostView(120 * GiB), SETTINGS, 1010.0)
    assert decided.go == ("A",) and decided.park == () and decided.waiting == {}, decided
    # 26 GiB are free now (140 - 113 - the 1 GiB margin): its restore waits for the other 30, which B is freeing.
    assert decided.freeing == {"A": {0: 30 * GiB}}


def test_a_checkpoint_restore_waits_for_the_park_to_end_even_when_that_park_releases_as_it_copies():
    # Its restore into a full device would lose the process: it never starts before the room is there.
    demand = Demand("A", {0: 56 * GiB}, 1000.0)
    decided = plan([device(113 * GiB)], swap_scene(True), [demand], [], HostView(120 * GiB), SETTINGS, 1010.0)
    assert decided.go == () and decided.park == ()
    assert "kernel B parking" in decided.waiting["A"]


def test_a_fast_resume_waits_for_a_park_that_frees_nothing_until_it_ends():
    # The checkpoint path's park (or a fast park of an older library) frees its bytes only once it is done.
    demand = Demand("A", {0: 56 * GiB}, 1000.0, may_wait=True)
    decided = plan([device(113 * GiB)], swap_scene(False), [demand], [], HostView(120 * GiB), SETTINGS, 1010.0)
    assert decided.go == () and decided.park == () and "kernel B parking" in decided.waiting["A"]


def test_the_bytes_of_a_releasing_park_are_counted_once_for_the_first_fast_resume_only():
    # 26 GiB free now (140 - 113 - 1), B frees 56 GiB as it copies. A (56 GiB) takes the 26 free and 30 of B's;
    # D (30 GiB), a fast resume too, finds only 26 of B's left: it waits. E (2 GiB), a checkpoint restore, may not
    # count on B's bytes at all, and A took what is free now: it waits too.
    kernels = swap_scene(True) + [kernel("D", "waiting"), kernel("E", "waiting")]
    demands = [
        Demand("A", {0: 56 * GiB}, 1000.0, may_wait=True),
        Demand("D", {0: 30 * GiB}, 1001.0, may_wait=True),
        Demand("E", {0: 2 * GiB}, 1002.0),
    ]
    decided = plan([device(113 * GiB)], kernels, demands, [], HostView(120 * GiB), SETTINGS, 1010.0)
    assert decided.go == ("A",) and set(decided.waiting) == {"D", "E"}, decided
    assert decided.freeing == {"A": {0: 30 * GiB}}
    alone = plan([device(113 * GiB)], kernels, demands[1:], [], HostView(120 * GiB), SETTINGS, 1010.0)
    assert alone.go == ("D",) and set(alone.waiting) == {"E"}, alone  # 26 free + 4 of B's; E's 2 GiB are not free
    assert alone.freeing == {"D": {0: 4 * GiB}}


def test_a_second_swap_waits_for_no_more_than_its_own_need_and_both_for_no_more_than_the_park_frees():
    # 35 GiB, 4 used by others and B's 30 parking as it copies: 0 free now (35 - 34 - 1). A (15) borrows 15 of B's
    # bytes; D (10) finds the room 15 below zero, but only its own 10 are for it to wait for (not 25).
    kernels = [
        kernel("A", "waiting"),
        kernel("D", "waiting"),
        replace(kernel("B", "parking", used=30 * GiB), releases_as_copied=True),
    ]
    demands = [Demand("A", {0: 15 * GiB}, 1000.0, may_wait=True), Demand("D", {0: 10 * GiB}, 1001.0, may_wait=True)]
    decided = plan([device(34 * GiB, total=35 * GiB)], kernels, demands, [], HostView(120 * GiB), SETTINGS, 1010.0)
    assert decided.go == ("A", "D"), decided
    assert decided.freeing == {"A": {0: 15 * GiB}, "D": {0: 10 * GiB}}


def test_a_fast_resume_that_a_releasing_park_cannot_cover_makes_room_as_before():
    demand = Demand("A", {0: 100 * GiB}, 1000.0, may_wait=True)
    kernels = swap_scene(True)
    kernels[2] = kernel("C", "idle", used=56 * GiB, idle_for=600)
    decided = plan([device(113 * GiB)], kernels, [demand], [], HostView(120 * GiB), SETTINGS, 1010.0)
    assert decided.go == () and decided.park == (("C", "A"),)


def test_once_the_room_is_there_the_resume_goes_and_a_second_one_must_wait_for_it():
    kernels = [
        kernel("A", "waiting"),
        kernel("B", "parked"),
        kernel("C", "idle", used=56 * GiB, idle_for=10),
        kernel("D", "waiting"),
    ]
    demands = [Demand("A", {0: 56 * GiB}, 1000.0), Demand("D", {0: 56 * GiB}, 1005.0)]
    decided = plan([device(57 * GiB)], kernels, demands, [], HostView(120 * GiB), SETTINGS, 1020.0)
    assert decided.go == ("A",)
    # D: C is idle for 10 s only (min_idle 60): nothing may park for it yet; it is told why.
    assert decided.park == () and "D" in decided.waiting
    assert "parking the kernels idle for 60 s or more" in decided.waiting["D"]


def test_running_kernels_keep_what_their_caps_still_allow_them():
    # 60 GiB free by NVML, but the running kernel may still take 40 GiB of it under its cap.
    kernels = [kernel("A", "waiting"), kernel("B", "busy", used=20 * GiB, cap=60 * GiB)]
    decided = plan(
        [device(80 * GiB)], kernels, [Demand("A", {0: 30 * GiB}, 0.0)], [], HostView(None), SETTINGS, now=1.0
    )
    assert decided.go == ()  # 140 - 80 - 40 (B's headroom) - 1 (margin) = 19 GiB < 30 GiB
    assert room(device(80 * GiB), kernels, [], GiB) == 19 * GiB


def test_a_reservation_is_held_until_the_restore_is_seen():
    kernels = [kernel("A", "resuming"), kernel("D", "waiting")]
    held = [Reservation("A", {0: 56 * GiB})]
    decided = plan([device(10 * GiB)], kernels, [Demand("D", {0: 80 * GiB}, 0.0)], held, HostView(None), SETTINGS, 1)
    # 140 - 10 - 1 = 129 GiB would fit 80 GiB; the 56 GiB held for A's restore leave 73 GiB: D waits.
    assert decided.go == ()
    assert room(device(10 * GiB), kernels, held, GiB) == 73 * GiB


def test_the_host_guard_keeps_a_victim_from_parking_and_says_so():
    kernels = [kernel("A", "waiting"), kernel("B", "idle", used=56 * GiB, idle_for=600)]
    decided = plan(
        [device(113 * GiB)], kernels, [Demand("A", {0: 56 * GiB}, 0.0)], [], HostView(50 * GiB), SETTINGS, 1.0
    )
    assert decided.park == () and "host's memory cannot take 1 idle kernel" in decided.waiting["A"]


def test_a_kernel_that_kept_its_pinned_arena_parks_where_the_host_could_take_no_other():
    # The three-kernel scene with fast park: A came back and kept its 56 GiB arena (pinned, already out of the
    # host's available memory); the host has 12 GiB left. C, idle longest, would need 56 GiB more of the host:
    # refused. A's park takes nothing more from the host: it is the one that parks for B.
    kept = replace(kernel("A", "idle", used=56 * GiB, idle_for=90), host_cost=0)
    kernels = [kernel("B", "waiting"), kernel("C", "idle", used=56 * GiB, idle_for=600), kept]
    decided = plan(
        [device(113 * GiB)], kernels, [Demand("B", {0: 56 * GiB}, 0.0)], [], HostView(12 * GiB), SETTINGS, 1.0
    )
    assert decided.park == (("A", "B"),)
    assert kept.host_need == 0 and kernels[1].host_need == 56 * GiB
    # What it says it would take is never more than what it holds.
    assert replace(kept, host_cost=80 * GiB).host_need == 56 * GiB


def test_at_the_limit_the_kernel_is_told_and_no_longer_holds_up_the_others():
    kernels = [kernel("A", "waiting"), kernel("D", "waiting"), kernel("B", "busy", used=100 * GiB, cap=100 * GiB)]
    demands = [Demand("A", {0: 60 * GiB}, 0.0), Demand("D", {0: 20 * GiB}, 100.0)]
    decided = plan([device(101 * GiB)], kernels, demands, [], HostView(None), SETTINGS, now=301.0)
    assert "waited 300 s (the park_wait_limit)" in decided.told["A"]
    assert decided.go == ("D",) and "D" not in decided.told


def test_a_wait_names_what_holds_the_room_how_much_and_when_it_may_be_parked():
    # The third scene, and the states around it: who holds the device A waits for, and until when.
    kernels = [
        kernel("A", "waiting"),
        kernel("B", "busy", used=40 * GiB, cap=63 * GiB),
        kernel("C", "idle", used=50 * GiB, idle_for=20),
        kernel("D", "idle", used=30 * GiB, idle_for=600, parkable=False),
        kernel("E", "idle", used=2 * GiB, idle_for=5),
    ]
    reserved = [Reservation("F", {0: 5 * GiB})]
    decided = plan(
        [device(127 * GiB)], kernels, [Demand("A", {0: 56 * GiB}, 0.0)], reserved, HostView(120 * GiB), SETTINGS, 1.0
    )
    words = decided.waiting["A"]
    held = words.split("; held: ", 1)[1]
    assert held == (
        "kernel B holds 40.0 GiB and claims 23.0 GiB more of its cap (running a cell: not parked while it runs), "
        "kernel C holds 50.0 GiB (idle 20 s: parkable after 60 s idle), "
        "kernel D holds 30.0 GiB (idle, cannot be parked), "
        "1 more hold 2.0 GiB, 5.0 GiB reserved for resumes under way"
    ), words


def test_an_unknown_device_decides_nothing():
    decided = plan([GPU], [kernel("A", "waiting")], [Demand("A", {0: GiB}, 0.0)], [], HostView(None), SETTINGS, 1)
    assert decided.go == () and "unknown" in decided.waiting["A"]


def test_a_running_kernel_that_found_the_device_full_gets_room_up_to_its_cap():
    kernels = [
        kernel("A", "busy", used=20 * GiB, cap=60 * GiB),
        kernel("B", "idle", used=100 * GiB, cap=100 * GiB, idle_for=600),
    ]
    demand = Demand("A", {0: 40 * GiB}, 0.0, running=True)
    decided = plan([device(120 * GiB)], kernels, [demand], [], HostView(None), SETTINGS, 1.0)
    assert decided.park == (("B", "A"),)


def test_two_devices_a_demand_parks_where_it_needs_room_and_nowhere_else():
    gpus = [device(130 * GiB, key=0), device(130 * GiB, key=1)]
    kernels = [
        kernel("A", "waiting", key=1),
        kernel("X", "idle", used=100 * GiB, cap=100 * GiB, idle_for=900, key=0),  # longest idle, on GPU 0
        kernel("Y", "idle", used=100 * GiB, cap=100 * GiB, idle_for=600, key=1),
    ]
    decided = plan(gpus, kernels, [Demand("A", {1: 50 * GiB}, 0.0)], [], HostView(None), SETTINGS, 1.0)
    assert decided.park == (("Y", "A"),)


# --- properties over random situations --------------------------------------------------------------------

STATES = ("busy", "idle", "pending", "parking", "parked", "waiting", "resuming")


@st.composite
def situations(draw):
    total = draw(st.integers(8, 160)) * GiB
    kernels: List[KernelView] = []
    used_total = 0
    for i in range(draw(st.integers(1, 8))):
        state = draw(st.sampled_from(STATES))
        cap = draw(st.integers(1, total // GiB)) * GiB
        used = draw(st.integers(0, cap // GiB)) * GiB if state in ("busy", "idle", "pending", "parking") else 0
        used_total += used
        view = kernel(
            f"k{i}",
            state,
            used=used,
            cap=cap,
            idle_for=draw(st.floats(0, 3600)) if state == "idle" else None,
            parkable=draw(st.booleans()),
        )
        kernels.append(replace(view, releases_as_copied=draw(st.booleans())))
    other = draw(st.integers(0, 4)) * GiB
    gpu = device(min(total, used_total + other), total=total)
    demands = [
        Demand(
            k.kernel_id,
            {0: draw(st.integers(1, total // GiB)) * GiB},
            draw(st.floats(0, 600)),
            may_wait=draw(st.booleans()),
        )
        for k in kernels
        if k.state == "waiting"
    ]
    resuming = [
        Reservation(k.kernel_id, {0: draw(st.integers(1, total // GiB)) * GiB})
        for k in kernels
        if k.state == "resuming"
    ]
    host = HostView(draw(st.one_of(st.none(), st.integers(0, 256).map(lambda g: g * GiB))))
    return gpu, kernels, demands, resuming, host


@settings(max_examples=400, deadline=None)
@given(situations(), st.floats(0, 1000))
def test_never_two_holders_of_the_same_bytes(situation, now):
    gpu, kernels, demands, reservations, host = situation
    decided = plan([gpu], kernels, demands, reservations, host, SETTINGS, now)
    granted = sum(d.need[0] for d in demands if d.kernel_id in decided.go)
    strict = sum(d.need[0] for d in demands if d.kernel_id in decided.go and not d.may_wait)
    if granted:
        # What the resumes take, with everything already used, everything running kernels may still claim
        # under their caps, everything reserved before and the margin, fits in the device: now, for the restores
        # that cannot wait (the checkpoint path's); once the parks that release as they copy have freed their
        # bytes, for every restore (a fast resume waits for them, bounded, and fails recoverably).
        claimed = sum(k.headroom(0) for k in kernels)
        reserved = sum(r.held.get(0, 0) for r in reservations)
        releasing = sum(k.used.get(0, 0) for k in kernels if k.state == "parking" and k.releases_as_copied)
        assert not strict or gpu.used + claimed + reserved + strict + SETTINGS.device_margin <= gpu.total
        assert gpu.used + claimed + reserved + granted + SETTINGS.device_margin <= gpu.total + releasing
    # What the swaps' restores wait for is what they count on beyond the room there is now, at most what the
    # releasing parks still hold; a go that fits now, or any restore that cannot wait, waits for nothing.
    counted_on = [n for per in decided.freeing.values() for n in per.values()]
    releasing = sum(k.used.get(0, 0) for k in kernels if k.state == "parking" and k.releases_as_copied)
    assert set(decided.freeing) <= {d.kernel_id for d in demands if d.kernel_id in decided.go and d.may_wait}
    assert all(n > 0 for n in counted_on) and sum(counted_on) <= releasing


@settings(max_examples=400, deadline=None)
@given(situations(), st.floats(0, 1000))
def test_without_fast_resumes_or_releasing_parks_every_restore_finds_its_room_now(situation, now):
    gpu, kernels, demands, reservations, host = situation
    strict = [replace(d, may_wait=False) for d in demands]
    decided = plan([gpu], kernels, strict, reservations, host, SETTINGS, now)
    granted = sum(d.need[0] for d in strict if d.kernel_id in decided.go)
    claimed = sum(k.headroom(0) for k in kernels)
    reserved = sum(r.held.get(0, 0) for r in reservations)
    assert not granted or gpu.used + claimed + reserved + granted + SETTINGS.device_margin <= gpu.total


@settings(max_examples=400, deadline=None)
@given(situations(), st.floats(0, 1000))
def test_victims_are_idle_parkable_idle_long_enough_least_recent_first_and_fit_the_host(situation, now):
    gpu, kernels, demands, reservations, host = situation
    decided = plan([gpu], kernels, demands, reservations, host, SETTINGS, now)
    by_id = {k.kernel_id: k for k in kernels}
    victims = [by_id[v] for v, _ in decided.park]
    assert len({v.kernel_id for v in victims}) == len(victims)
    for victim in victims:
        assert victim.state == "idle" and victim.parkable and victim.idle_for >= SETTINGS.min_idle
        assert victim.host_bytes > 0
    left = host_left(host, kernels)
    if left is not None and victims:
        assert sum(v.host_bytes for v in victims) + SETTINGS.host_margin <= left
    # Least recently active first: no idle candidate left out was idle longer than one that was chosen,
    # unless the host could not take it.
    if victims:
        shortest = min(v.idle_for for v in victims)
        passed = [
            k
            for k in kernels
            if k.state == "idle" and k.parkable and k.host_bytes > 0 and (k.idle_for or 0) > shortest
            and k.kernel_id not in {v.kernel_id for v in victims}
        ]
        assert all(left is not None and k.host_bytes + SETTINGS.host_margin > left for k in passed)


@settings(max_examples=400, deadline=None)
@given(situations(), st.floats(0, 1000))
def test_every_demand_gets_an_answer_each_round(situation, now):
    gpu, kernels, demands, reservations, host = situation
    decided = plan([gpu], kernels, demands, reservations, host, SETTINGS, now)
    for demand in demands:
        assert demand.kernel_id in decided.go or demand.kernel_id in decided.waiting
        overdue = now - demand.since >= SETTINGS.wait_limit
        assert (demand.kernel_id in decided.told) == (overdue and demand.kernel_id not in decided.go)


# --- over time: a small world where parks finish, kernels go idle, and the broker is asked every round ------


class World:
    """One device, kernels that alternate between busy and idle, parks that take a round, the broker asked
    every round (one second), as the parker does on every sample."""

    def __init__(self, total, caps, margin, limit):
        self.total = total
        self.used: Dict[str, int] = {}
        self.caps = caps
        self.state = {k: "idle" for k in caps}
        self.last_active = {k: 0.0 for k in caps}
        self.parked: Dict[str, int] = {}
        self.waiting_since: Dict[str, float] = {}
        self.settings = BrokerSettings(device_margin=margin, host_margin=0, min_idle=5, wait_limit=limit)
        self.served: List[str] = []
        self.told: List[str] = []
        self.now = 0.0

    def view(self):
        kernels = [
            KernelView(
                k,
                self.state[k],
                used={0: self.used.get(k, 0)} if self.used.get(k) else {},
                caps={0: self.caps[k]},
                idle_for=self.now - self.last_active[k] if self.state[k] == "idle" else None,
                parkable=True,
            )
            for k in self.caps
        ]
        used = sum(self.used.values())
        demands = [Demand(k, {0: self.parked[k]}, since) for k, since in self.waiting_since.items()]
        return device(used, total=self.total), kernels, demands

    def step(self, wakes):
        self.now += 1.0
        for k in list(self.state):  # parks started last round are done now
            if self.state[k] == "parking":
                self.parked[k] = self.used.pop(k, 0)
                self.state[k] = "parked"
        for k in wakes:
            if self.state[k] == "parked" and k not in self.waiting_since:
                self.state[k] = "waiting"
                self.waiting_since[k] = self.now
        gpu, kernels, demands = self.view()
        decided = plan([gpu], kernels, demands, [], HostView(None), self.settings, self.now)
        for victim, _ in decided.park:
            self.state[victim] = "parking"
        for k in decided.go:
            assert gpu.used + self.parked[k] <= self.total  # the restore finds its room
            self.used[k] = self.parked.pop(k)
            self.state[k] = "idle"
            self.last_active[k] = self.now
            del self.waiting_since[k]
            self.served.append(k)
        for k in decided.told:
            if k in self.waiting_since:  # the cell ends: it is parked again and waits no more
                self.state[k] = "parked"
                del self.waiting_since[k]
                self.told.append(k)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 60), min_size=2, max_size=6),
    st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=40),
)
def test_over_time_every_waiting_kernel_is_served_or_told_by_the_limit(sizes, wake_rounds):
    caps = {f"k{i}": n * GiB for i, n in enumerate(sizes)}
    world = World(total=64 * GiB, caps=caps, margin=GiB, limit=30)
    for k, cap in caps.items():  # every kernel starts parked, holding its cap
        world.parked[k] = cap
        world.state[k] = "parked"
    names = sorted(caps)
    for wakes in wake_rounds:
        world.step([names[i % len(names)] for i in wakes])
    for _ in range(40):  # nobody new asks: within the limit everyone who waits has been answered
        world.step([])
    assert world.waiting_since == {}, world.waiting_since
    for k in world.served + world.told:
        assert k in caps
    # A kernel that fits the device alone is never told while the others are idle: someone parks for it.
    assert not [k for k in world.told if caps[k] + GiB <= 64 * GiB and len(caps) == 1]


def test_replace_keeps_the_views_frozen():
    view = kernel("A", "idle", used=GiB)
    assert replace(view, state="busy").headroom(0) == view.caps[0] - GiB


def test_a_kernel_that_holds_nothing_on_a_device_claims_nothing_there():
    # CPU-only notebooks (most kernels) and kernels that never reached a GPU cannot be parked to give a claim
    # back: if their caps counted, one such kernel per cap would keep every parked kernel from coming back.
    idle_cpu = [kernel(f"cpu{i}", "idle", used=0, cap=35 * GiB, idle_for=9e3) for i in range(4)]
    kernels = [kernel("A", "waiting")] + idle_cpu
    decided = plan([device(0)], kernels, [Demand("A", {0: 56 * GiB}, 0.0)], [], HostView(None), SETTINGS, 1.0)
    assert decided.go == ("A",)


def test_a_kernel_that_asked_for_room_is_never_parked_to_make_it():
    # X's allocation found the device full (park_on_device_full); its cell ended, and making room takes a while (the
    # only other idle kernel is too young to park). Idle past min_idle, X must not be chosen to park for itself.
    kernels = [
        kernel("X", "idle", used=20 * GiB, idle_for=120),
        kernel("Y", "idle", used=56 * GiB, idle_for=10),
        kernel("Z", "busy", used=56 * GiB, cap=56 * GiB),
    ]
    demand = Demand("X", {0: 43 * GiB}, since=1000.0, running=True)
    decided = plan([device(132 * GiB)], kernels, [demand], [], HostView(), SETTINGS, now=1130.0)
    assert decided.park == () and decided.go == ()
    assert "X" in decided.waiting


def test_a_running_kernel_waits_while_a_restore_under_way_holds_the_room_then_runs_when_nothing_more_can_come():
    # A's cell found the device full; B's restore was given 60 GiB and is copying. Nothing idle could be parked. While
    # the restore holds its room A waits (its cell would take the restore's bytes); once it has landed nothing more
    # can come, and A's cell runs as it is instead of waiting out the limit for nothing.
    a = kernel("A", "busy", used=20 * GiB, cap=60 * GiB)
    demand = Demand("A", {0: 40 * GiB}, since=1000.0, running=True)
    restoring = [a, kernel("B", "resuming", used=0, cap=60 * GiB), kernel("C", "busy", used=50 * GiB, cap=50 * GiB)]
    during = plan(
        [device(70 * GiB)], restoring, [demand], [Reservation("B", {0: 60 * GiB})], HostView(), SETTINGS, now=1001.0
    )
    assert during.go == () and during.park == () and "A" in during.waiting, during
    landed = [a, kernel("B", "busy", used=60 * GiB, cap=60 * GiB), kernel("C", "busy", used=50 * GiB, cap=50 * GiB)]
    after = plan([device(130 * GiB)], landed, [demand], [], HostView(), SETTINGS, now=1010.0)
    assert after.go == ("A",) and after.park == () and after.waiting == {}, after
