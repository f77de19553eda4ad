"""The usage history (usage/history.py): bounded per kernel and in memory, kernels that are gone forgotten,
incremental reads by `since`, and a point's sums over a kernel's devices."""

import gc
import json
import tracemalloc
from types import SimpleNamespace

import pytest

from gpu_quota_ext.shared.contract import HISTORY_FIELDS, HISTORY_POINT_FIELDS, KERNEL_HISTORY_FIELDS
from gpu_quota_ext.usage.history import (
    POINTS_MAX,
    HistoryPoint,
    UsageHistory,
    history_text,
    kernel_history_text,
    point_for,
)

GiB = 1 << 30


def point(t, used=1, park="idle"):
    return HistoryPoint(t=t, used=used, allocated=None, reserved=None, cap=20 * GiB, hard_limit=None, park=park)


def feed(history, samples, kernels, start=0):
    """`samples` rounds, each adding one point for each of `kernels` kernels, as the manager does per sample."""
    ids = [f"kernel-{k}" for k in range(kernels)]
    for round_ in range(start, start + samples):
        history.forget_all_but(ids)
        for kernel_id in ids:
            history.add(kernel_id, point(float(round_), used=round_))
    return ids


def test_ten_thousand_samples_of_fifty_kernels_keep_fifty_times_n_points():
    history = UsageHistory()
    ids = feed(history, 10_000, 50)
    assert history.point_count() == 50 * POINTS_MAX
    for kernel_id in ids:
        points = history.kernel(kernel_id)
        assert len(points) == POINTS_MAX
        # The newest are kept, oldest first.
        assert [p.t for p in points] == [float(t) for t in range(10_000 - POINTS_MAX, 10_000)]


def test_memory_stays_flat_however_many_samples_come():
    def measured(samples):
        gc.collect()
        tracemalloc.start()
        try:
            history = UsageHistory()
            feed(history, samples, 50)
            gc.collect()
            size, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return size

    full = measured(POINTS_MAX)  # every kernel's history just full
    much_later = measured(10_000)
    assert much_later < full * 1.1, (full, much_later)


def test_kernels_that_are_gone_are_forgotten():
    history = UsageHistory(points_max=10)
    feed(history, 20, 50)
    assert history.point_count() == 500
    history.forget_all_but([f"kernel-{k}" for k in range(5)])
    assert sorted(history.kernels()) == [f"kernel-{k}" for k in range(5)]
    assert history.point_count() == 50
    assert history.kernel("kernel-7") is None


def test_since_gives_only_newer_points_and_every_kernel():
    history = UsageHistory(points_max=10)
    history.add("a", point(1.0))
    history.add("a", point(2.0))
    history.add("a", point(3.0))
    history.add("b", point(1.5))
    assert [p.t for p in history.kernel("a", since=1.0)] == [2.0, 3.0]
    assert [p.t for p in history.kernel("a", since=3.0)] == []
    assert [p.t for p in history.kernel("a")] == [1.0, 2.0, 3.0]
    # Every kept kernel is listed, with nothing newer as an empty list: the reader learns who is still there.
    assert {k: [p.t for p in v] for k, v in history.kernels(since=2.0).items()} == {"a": [3.0], "b": []}


def test_a_point_no_later_than_the_last_is_dropped():
    history = UsageHistory(points_max=10)
    history.add("a", point(5.0, used=1))
    history.add("a", point(5.0, used=2))
    history.add("a", point(4.0, used=3))
    assert [p.used for p in history.kernel("a")] == [1]


def test_a_history_keeps_at_least_one_point():
    with pytest.raises(ValueError):
        UsageHistory(points_max=0)


def report(allocated, reserved):
    return SimpleNamespace(allocated=allocated, reserved=reserved)


def test_a_point_sums_the_kernels_devices_and_says_unknown_as_none():
    p = point_for(
        10.0, (0, 1), {0: 2 * GiB, 1: 3 * GiB}, {0: report(1 * GiB, 2 * GiB)}, {0: 20 * GiB, 1: 20 * GiB}, {}, "busy"
    )
    assert (p.used, p.allocated, p.reserved, p.cap, p.hard_limit) == (5 * GiB, GiB, 2 * GiB, 40 * GiB, None)
    assert p.park == "busy"
    # One device NVML could not read: the kernel's NVML figure is unknown, not the other device's alone.
    unread = point_for(10.0, (0, 1), {0: 2 * GiB, 1: None}, {}, {0: GiB, 1: GiB}, {0: GiB, 1: GiB}, "idle")
    assert unread.used is None and unread.allocated is None and unread.reserved is None
    assert unread.hard_limit == 2 * GiB
    # An allocator report that gives no figure for a field.
    partial = point_for(10.0, (0,), {0: 0}, {0: report(None, GiB)}, {0: GiB}, {}, "parked")
    assert (partial.used, partial.allocated, partial.reserved, partial.park) == (0, None, GiB, "parked")


def test_the_answers_are_json_with_the_contracts_fields():
    history = UsageHistory(points_max=3)
    history.add("a", point(1.0))
    history.add('b "quoted"', point(2.0, used=None))
    answer = json.loads(history_text(history, 1.0, None))
    assert tuple(answer) == HISTORY_FIELDS
    assert answer["points_max"] == 3 and answer["interval"] == 1.0
    assert tuple(answer["kernels"]["a"][0]) == HISTORY_POINT_FIELDS
    assert answer["kernels"]["a"] == [point(1.0).to_json()]
    assert answer["kernels"]['b "quoted"'][0]["used"] is None
    newer = json.loads(history_text(history, 1.0, 5.0))
    assert newer == {"interval": 1.0, "points_max": 3, "kernels": {"a": [], 'b "quoted"': []}}
    one = json.loads(kernel_history_text(history.kernel("a"), history, 1.0))
    assert tuple(one) == KERNEL_HISTORY_FIELDS
    assert one["points"] == answer["kernels"]["a"]
