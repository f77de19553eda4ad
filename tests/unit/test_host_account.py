"""The host's memory as one account for every park (parking/host_account.py): the check, the promise, the
landing and the release; a host that runs short anyway; the broker's view of it; and the parker checking two
parks in the same tick (the idle timers that fired together on the H200 and cost a user's kernel)."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpu_quota_ext.devices import Device
from gpu_quota_ext.parking import ParkSettings
from gpu_quota_ext.parking.broker import (
    BrokerSettings,
    Demand,
    DeviceView,
    HostView,
    KernelView,
    Plan,
    host_left,
    plan,
)
from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
from gpu_quota_ext.parking.host_account import HostAccount, HostReading, host_short
from gpu_quota_ext.parking.parker import Parker
from gpu_quota_ext.usage import Sample
from gpu_quota_ext.usage.sampling import DeviceReading
from tests.waiting import wait_for

from .fakes import Grants, ParkerKernels, StillMonitor, grant

GiB = 1 << 30


# --- the check --------------------------------------------------------------------------------------------------


def test_a_park_needs_its_bytes_plus_the_margin_on_the_host_and_in_the_cgroup():
    account = HostAccount()
    assert account.refusal("a", 10 * GiB, HostReading(13 * GiB), 2 * GiB) is None
    assert "the host has 11.0 GiB" in account.refusal("a", 10 * GiB, HostReading(11 * GiB), 2 * GiB)
    assert "cgroup has room for 4.0 GiB" in account.refusal("a", 10 * GiB, HostReading(100 * GiB, 4 * GiB), 2 * GiB)
    assert account.refusal("a", 10 * GiB, HostReading(), 2 * GiB) is None  # unknown: the driver answers for itself


@given(
    st.integers(0, 1 << 45),
    st.integers(0, 1 << 45),
    st.one_of(st.none(), st.integers(0, 1 << 45)),
    st.integers(0, 1 << 35),
    st.integers(0, 1 << 44),
)
def test_a_park_is_refused_exactly_when_host_or_cgroup_cannot_hold_it_beside_parks_under_way(
    gpu, available, room, margin, coming
):
    account = HostAccount().promise("other", coming)
    refused = account.refusal("a", gpu, HostReading(available, room), margin) is not None
    assert refused == (available - coming < gpu + margin or (room is not None and room - coming < gpu + margin))


def test_the_refusal_names_what_parks_under_way_will_still_bring():
    account = HostAccount().promise("b", 56 * GiB)
    words = account.refusal("c", 56 * GiB, HostReading(100 * GiB), 2 * GiB)
    assert words == (
        "did not park: the host has 100.0 GiB of memory available and parking needs 56.0 GiB plus a margin of "
        "2.0 GiB, and parks under way will still bring 56.0 GiB"
    )


def test_what_has_landed_counts_once_and_a_release_ends_the_promise():
    account = HostAccount().promise("b", 56 * GiB).landing({"b": 20 * GiB})
    assert account.outstanding() == 36 * GiB
    assert account.landing({"b": 80 * GiB}).outstanding() == 0  # resident memory grew for other reasons too
    assert account.landing({"b": -5}).outstanding() == 56 * GiB  # it shrank: nothing has landed
    assert account.release("b").outstanding() == 0 and account.release("b").kernels() == frozenset()
    again = account.refusal("b", GiB, HostReading(1 << 50), 0)
    assert again == "did not park: a park of this kernel is already under way"


# --- any interleaving: never more host memory promised than the host has --------------------------------------


class Host(RuleBasedStateMachine):
    """A host whose parks' bytes land over time, whose kernels die, and whose memory another program may take.
    Parks go through the account exactly as the parker does: check, then promise in the same step. With nothing
    taken outside the account, what is available less what is promised never falls below the margin, so every
    park under way can land; taken outside, the episode is seen before the host is out of memory."""

    MARGIN = 2 * GiB

    @initialize(total=st.integers(8 * GiB, 256 * GiB))
    def start(self, total):
        self.total = total
        self.account = HostAccount()
        self.landed = {}  # kernel -> bytes on the host (under way or parked)
        self.moving = {}  # kernel -> bytes its park will bring in all
        self.outside = 0  # taken by a program outside the quota
        self.count = 0

    def available(self):
        return self.total - sum(self.landed.values()) - self.outside

    def reading(self):
        return HostReading(self.available())

    @rule(nbytes=st.integers(0, 80 * GiB))
    def park(self, nbytes):
        self.count += 1
        kernel = f"k{self.count}"
        refused = self.account.refusal(kernel, nbytes, self.reading(), self.MARGIN)
        if refused is None:
            self.account = self.account.promise(kernel, nbytes)
            self.moving[kernel] = nbytes
            self.landed[kernel] = 0
        else:
            assert self.available() - self.account.outstanding() < nbytes + self.MARGIN

    @precondition(lambda self: self.moving)
    @rule(data=st.data())
    def copy(self, data):
        kernel = data.draw(st.sampled_from(sorted(self.moving)))
        more = data.draw(st.integers(0, self.moving[kernel] - self.landed[kernel]))
        self.landed[kernel] += more
        self.account = self.account.landing({k: self.landed[k] for k in self.moving})

    @precondition(lambda self: self.moving)
    @rule(data=st.data())
    def done(self, data):
        kernel = data.draw(st.sampled_from(sorted(self.moving)))
        self.landed[kernel] = self.moving.pop(kernel)
        self.account = self.account.release(kernel)

    @precondition(lambda self: self.landed)
    @rule(data=st.data())
    def dies(self, data):
        kernel = data.draw(st.sampled_from(sorted(self.landed)))
        self.landed.pop(kernel)
        self.moving.pop(kernel, None)
        self.account = self.account.release(kernel)

    @rule(nbytes=st.integers(0, 16 * GiB))
    def taken_outside(self, nbytes):
        self.outside += nbytes

    @invariant()
    def every_park_under_way_can_land(self):
        if not hasattr(self, "account"):
            return
        room = self.available() - self.account.outstanding() + self.outside
        parked_or_moving = bool(self.landed)
        assert not parked_or_moving or room >= self.MARGIN or self.total < self.MARGIN

    @invariant()
    def a_host_run_short_is_seen_before_it_is_empty(self):
        if not hasattr(self, "account"):
            return
        parked = sum(self.landed.values())
        if parked and self.available() < self.MARGIN // 2:
            assert host_short(self.reading(), parked, self.MARGIN)


Host.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_no_interleaving_promises_more_than_the_host_has = Host.TestCase


def test_an_episode_begins_below_half_the_margin_and_ends_at_the_whole_margin():
    margin = 2 * GiB
    assert not host_short(HostReading(1.5 * GiB), 10 * GiB, margin)
    assert host_short(HostReading(0.9 * GiB), 10 * GiB, margin)
    assert host_short(HostReading(1.5 * GiB), 10 * GiB, margin, was_short=True)
    assert not host_short(HostReading(2 * GiB), 10 * GiB, margin, was_short=True)
    assert not host_short(HostReading(0), 0, margin)  # nothing parked: nothing to bring back
    assert host_short(HostReading(0), 0, margin, was_short=True)  # all back: still short until the margin is free
    assert not host_short(HostReading(), 10 * GiB, margin)


# --- the broker ---------------------------------------------------------------------------------------------------


def test_the_broker_counts_a_promised_park_once_and_anothers_park_whole():
    parking = [KernelView("a", "parking", used={0: 30 * GiB}), KernelView("b", "parking", used={0: 20 * GiB})]
    host = HostView(available=100 * GiB, promised=10 * GiB, promised_for=frozenset({"a"}))
    assert host_left(host, parking) == 100 * GiB - 10 * GiB - 20 * GiB


def test_host_short_resumes_go_where_the_device_has_room_largest_first_and_after_anyone_waiting():
    device = DeviceView(0, "GPU 0", total=100 * GiB, used=40 * GiB)
    kernels = (
        KernelView("waits", "waiting"),
        KernelView("small", "parked"),
        KernelView("large", "parked"),
        KernelView("huge", "parked"),
        KernelView("idle", "idle", used={0: 40 * GiB}, caps={0: 40 * GiB}, idle_for=600, parkable=True),
    )
    demands = (
        Demand("small", {0: 5 * GiB}, since=0, background=True),
        Demand("huge", {0: 70 * GiB}, since=0, background=True),
        Demand("large", {0: 20 * GiB}, since=0, background=True),
        Demand("waits", {0: 30 * GiB}, since=50),
    )
    decided = plan((device,), kernels, demands, (), HostView(), BrokerSettings(device_margin=GiB), 100)
    # 59 GiB of room: the waiting cell first (30), then the largest that fits (20), then 5; "huge" fits nowhere
    # and parks nobody (the idle kernel stays), and no background resume is told or said to wait.
    assert decided.go == ("waits", "large", "small")
    assert decided.park == ()
    assert set(decided.waiting) == set() and decided.told == {}


# --- the parker: two idle timers in the same tick ----------------------------------------------------------------


@pytest.fixture
def two_processes():
    children = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
                for _ in range(2)]
    try:
        yield [c.pid for c in children]
    finally:
        for child in children:
            child.kill()
            child.wait()


@pytest.fixture
def fake_driver():
    FakeCheckpoint.reset()
    yield FakeCheckpoint
    FakeCheckpoint.reset()


async def test_two_parks_checked_in_the_same_tick_never_promise_more_than_the_host_has(two_processes, fake_driver):
    a, b = two_processes
    sample = Sample(
        state="ok",
        time=1e12,  # taken "after" every request: no fresh sample is awaited
        devices={0: DeviceReading(0, 113 * GiB)},
        kernels={"A": {0: 56 * GiB}, "B": {0: 56 * GiB}},
        pids={"A": (a,), "B": (b,)},
    )
    held = fake_driver.hang("cuCheckpointProcessCheckpoint")  # A's copy takes its time, as 56 GiB do
    parker = Parker(
        ParkSettings(idle_after=6, fresh_sample_wait=0),
        fake_driver(),
        ParkerKernels({"A": "idle", "B": "idle"}, idle_for=600),
        Grants(grant(k, {0: 63 * GiB}) for k in ("A", "B")),
        {0: Device(index=0, name="GPU", uuid="GPU-0", total=140 * GiB, nvml_index=0)},
        StillMonitor(sample),
        host=lambda: (70 * GiB, None),  # one kernel parked already; the reading does not move while A copies
    )
    parker.driver_problem = None
    try:
        parker.on_sample(sample)  # both timers are due on the same sample
        await wait_for(lambda: all(r.pids or r.state != "parking" for r in parker.records.values())
                       and len(parker.records) == 2, "both parks checked")
        states = {k: (r.state, r.reason) for k, r in parker.records.items()}
        parking = [k for k, (state, _) in states.items() if state == "parking"]
        refused = [k for k, (state, _) in states.items() if state == "running"]
        assert len(parking) == 1 and len(refused) == 1, states
        assert "parks under way will still bring 56.0 GiB" in states[refused[0]][1]
        # Promised whole, less what its process's resident memory grew by since (a few pages of a real process).
        assert parker.host_account.kernels() == {parking[0]}
        assert 56 * GiB - (64 << 20) < parker.host_json()["promised"] <= 56 * GiB
    finally:
        held.set()
        await wait_for(lambda: parker.records[parking[0]].state == "parked", "A's park done")
        await parker.stop()
    assert parker.host_account.outstanding() == 0  # its driver call returned: the promise ended with it


class HostService:
    """A broker whose host service refuses every park's host memory (the account of every user's parks is there)."""

    def __init__(self):
        self.asked = []

    async def decide(self, round_):
        return Plan()

    async def promise_host(self, round_, kernel_id, nbytes):
        self.asked.append((kernel_id, nbytes))
        return "did not park: the host has 3.0 GiB of memory available and parking needs 56.0 GiB", Plan()


async def test_on_a_hub_host_the_service_s_word_decides_and_nothing_is_promised_here(two_processes, fake_driver):
    a, _ = two_processes
    sample = Sample(state="ok", time=1e12, devices={0: DeviceReading(0, 56 * GiB)}, kernels={"A": {0: 56 * GiB}},
                    pids={"A": (a,)})
    service = HostService()
    parker = Parker(
        ParkSettings(idle_after=6, fresh_sample_wait=0),
        fake_driver(),
        ParkerKernels({"A": "idle"}, idle_for=600),
        Grants([grant("A", {0: 63 * GiB})]),
        {0: Device(index=0, name="GPU", uuid="GPU-0", total=140 * GiB, nvml_index=0)},
        StillMonitor(sample),
        host=lambda: (500 * GiB, None),  # this server's own reading has room: the service's account has not
        broker=service,
    )
    parker.driver_problem = None
    try:
        parker.on_sample(sample)
        await wait_for(lambda: "A" in parker.records and parker.records["A"].state == "running", "A's park refused")
        assert service.asked == [("A", 56 * GiB)]
        assert parker.records["A"].reason.startswith("did not park: the host has 3.0 GiB")
        assert fake_driver.calls == [] and parker.host_account.outstanding() == 0
    finally:
        await parker.stop()
