"""Which running kernels are short of room (parking/headroom.py), pure: a kernel under its cap whose headroom idle
kernels hold is short where parking them would free it; never where nothing could (a process outside the quota,
a cap larger than the device, nothing idle and parkable), and an unreadable device decides nothing. Bad, huge and
missing numbers never raise and never make a kernel short."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_quota_ext.parking.broker import BrokerSettings, DeviceView, HostView, KernelView, Reservation, Round
from gpu_quota_ext.parking.headroom import UNKNOWN, headroom, short_kernels, short_on

from .broker_views import device_view, kernel_view

GiB = 1 << 30
SETTINGS = BrokerSettings(device_margin=GiB, host_margin=2 * GiB, min_idle=60, wait_limit=300)


def gpu(used, total=16 * GiB, key=0):
    return device_view(used, total, key)


def kernel(kernel_id, state="idle", used=0, cap=7 * GiB, idle_for=600.0, parkable=True, key=0):
    return kernel_view(kernel_id, state, used, cap, idle_for, parkable, key)


def round_of(devices, kernels, reservations=()):
    return Round(
        devices=tuple(devices),
        kernels=tuple(kernels),
        demands=(),
        reservations=tuple(reservations),
        host=HostView(64 * GiB),
        settings=SETTINGS,
        now=1000.0,
    )


# --- the integration test's scenario, as the decision sees it ----------------------------------------------


def test_a_kernel_whose_headroom_an_idle_kernel_holds_is_short_and_the_idle_one_is_not():
    # A idles holding 12 GiB of 16; B holds 2 GiB of its 7 GiB cap: 16 - 14 - 1 margin = 1 GiB free for B's 5.
    a, b = kernel("A", used=12 * GiB, cap=13 * GiB), kernel("B", used=2 * GiB, idle_for=1.0)
    shorts = short_kernels(round_of([gpu(14 * GiB)], [a, b]))
    assert shorts == {"A": None, "B": 0}  # A's own 1 GiB of headroom is free (exactly: 1 GiB)


def test_not_short_when_the_headroom_is_free():
    b = kernel("B", used=2 * GiB)
    assert short_on(b, round_of([gpu(4 * GiB)], [b, kernel("A", used=2 * GiB)])) is None


def test_a_kernel_that_never_used_the_device_is_short_of_its_whole_cap():
    b = kernel("B", used=0)
    assert headroom(b, 0) == 7 * GiB
    assert short_on(b, round_of([gpu(12 * GiB)], [b, kernel("A", used=12 * GiB, cap=13 * GiB)])) == 0


def test_a_busy_kernels_claimed_headroom_and_reservations_count_as_taken():
    # 16 - 6 used - 3 claimed by C's running cell - 2 reserved for D's restore - 1 margin = 4 GiB for B's 5 GiB;
    # parking idle E would give 2 GiB more.
    b = kernel("B", used=2 * GiB)
    c = kernel("C", state="busy", used=2 * GiB, cap=5 * GiB)
    a = kernel("A", used=0)  # nothing held: nothing to park
    d = kernel("D", state="resuming", used=0)
    e = kernel("E", used=2 * GiB, cap=2 * GiB)
    one = round_of([gpu(6 * GiB)], [b, c, a, d, e], [Reservation("D", {0: 2 * GiB})])
    assert short_on(b, one) == 0
    assert short_on(b, round_of([gpu(6 * GiB)], [b, c, a, d, e])) is None  # without the reservation: 6 GiB free
    idle_c = round_of(
        [gpu(6 * GiB)], [b, kernel("C", used=2 * GiB, cap=5 * GiB), a, d, e], [Reservation("D", {0: 2 * GiB})]
    )
    assert short_on(b, idle_c) is None  # an idle kernel's headroom is claimed by nobody: 7 GiB free


def test_its_own_reservation_is_not_held_against_it():
    b = kernel("B", used=2 * GiB)
    assert short_on(b, round_of([gpu(4 * GiB)], [b], [Reservation("B", {0: 9 * GiB})])) is None


def test_never_short_where_parking_could_not_free_the_room():
    b = kernel("B", used=2 * GiB)
    outside = round_of([gpu(14 * GiB)], [b])  # 12 GiB held by a process outside the quota: nothing to park
    assert short_on(b, outside) is None
    busy = round_of([gpu(14 * GiB)], [b, kernel("A", state="busy", used=12 * GiB, cap=12 * GiB)])
    assert short_on(b, busy) is None  # a busy kernel is never parked
    unparkable = round_of([gpu(14 * GiB)], [b, kernel("A", used=12 * GiB, parkable=False)])
    assert short_on(b, unparkable) is None  # an MPS client, another user's process, no driver
    too_little = round_of([gpu(14 * GiB)], [b, kernel("A", used=2 * GiB, cap=2 * GiB)])  # 10 GiB outside the quota
    assert short_on(b, too_little) is None  # 1 GiB free + 2 GiB from parking A: short of 5 GiB still


def test_a_park_under_way_counts_as_room_coming():
    b = kernel("B", used=2 * GiB)
    assert short_on(b, round_of([gpu(14 * GiB)], [b, kernel("A", state="parking", used=12 * GiB)])) == 0


def test_an_idle_kernel_not_yet_idle_for_min_idle_still_counts_as_room_that_can_be_made():
    b = kernel("B", used=2 * GiB)
    assert short_on(b, round_of([gpu(14 * GiB)], [b, kernel("A", used=12 * GiB, idle_for=0.0)])) == 0


def test_on_two_gpus_it_is_short_on_the_one_whose_room_is_held():
    b = KernelView("B", "idle", used={0: GiB, 1: GiB}, caps={0: 4 * GiB, 1: 4 * GiB}, idle_for=1.0, parkable=True)
    a = kernel("A", used=12 * GiB, cap=13 * GiB, key=1)
    assert short_on(b, round_of([gpu(GiB, key=0), gpu(13 * GiB, key=1)], [b, a])) == 1


def test_an_unreadable_device_decides_nothing():
    b = kernel("B", used=2 * GiB)
    assert short_on(b, round_of([gpu(None)], [b, kernel("A", used=12 * GiB)])) is UNKNOWN


def test_parked_and_waiting_kernels_are_not_asked():
    kernels = [kernel("P", state="parked"), kernel("W", state="waiting"), kernel("L", state="lost")]
    assert short_kernels(round_of([gpu(15 * GiB)], kernels)) == {}


def test_only_the_kernels_asked_for():
    kernels = [kernel("A", used=12 * GiB), kernel("B", used=2 * GiB)]
    assert list(short_kernels(round_of([gpu(14 * GiB)], kernels), ["B"])) == ["B"]


# --- bad, huge and missing values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cap, used",
    [(None, 2 * GiB), ("7GiB", 2 * GiB), (True, 0), (-5, 0), (7 * GiB, -3), (7 * GiB, None), (7 * GiB, 2.5e9)],
)
def test_bad_numbers_of_a_kernel_never_raise(cap, used):
    b = KernelView("B", "idle", used={0: used}, caps={0: cap}, idle_for=1.0, parkable=True)
    got = short_on(b, round_of([gpu(14 * GiB)], [b, kernel("A", used=12 * GiB, cap=13 * GiB)]))
    assert got in (None, 0)
    if not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0:
        assert got is None  # no cap that can be read: no headroom to make room for


def test_a_cap_larger_than_the_device_is_never_short():
    b = kernel("B", used=2 * GiB, cap=1 << 60)
    assert short_on(b, round_of([gpu(14 * GiB)], [b, kernel("A", used=12 * GiB)])) is None


@pytest.mark.parametrize("total", [0, -1, None, "16GiB"])
def test_a_device_without_a_usable_total_decides_nothing(total):
    b = kernel("B", used=2 * GiB)
    assert short_on(b, round_of([DeviceView(0, "GPU 0", total, 14 * GiB)], [b, kernel("A", used=12 * GiB)])) is UNKNOWN


def test_a_grant_on_a_device_the_round_does_not_know_is_not_short():
    b = kernel("B", used=2 * GiB, key=7)
    assert short_on(b, round_of([gpu(14 * GiB)], [b])) is None


sizes = st.integers(min_value=-(1 << 40), max_value=1 << 62)


@given(
    total=sizes,
    used=st.one_of(st.none(), sizes),
    caps=st.lists(sizes, min_size=1, max_size=4),
    uses=st.lists(sizes, min_size=4, max_size=4),
    states=st.lists(
        st.sampled_from(["idle", "busy", "pending", "parking", "parked", "waiting", "lost"]), min_size=4, max_size=4
    ),
)
def test_any_numbers_give_an_answer_and_short_means_its_headroom_is_not_free(total, used, caps, uses, states):
    kernels = [
        KernelView(f"K{i}", states[i], used={0: uses[i]}, caps={0: cap}, idle_for=100.0, parkable=True)
        for i, cap in enumerate(caps)
    ]
    one = round_of([DeviceView(0, "GPU 0", total, used)], kernels)
    for kernel_id, device in short_kernels(one).items():
        assert device in (None, 0, UNKNOWN)
        if device == 0 and device is not UNKNOWN:
            me = next(k for k in kernels if k.kernel_id == kernel_id)
            assert headroom(me, 0) > 0 and used is not None and total > 0
