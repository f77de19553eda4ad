"""The service's per-user limits, decided (rate.py): token buckets, open requests, trusted tokens, once-a-period
lines. Clocks are given: no sleeps."""

import pytest

from gpu_quota_ext.hub.service.rate import (
    Buckets,
    OncePer,
    OpenRequests,
    Rate,
    Trusted,
    refusal_words,
    retry_after,
)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def test_a_burst_passes_then_calls_wait_for_the_refill_and_are_told_how_long():
    buckets = Buckets({"room": Rate.of(10, 2)})  # 10 a second, bursts of 20
    assert [buckets.take("room", "bob", 100.0) for _ in range(20)] == [0.0] * 20
    assert buckets.take("room", "bob", 100.0) == pytest.approx(0.1)
    assert buckets.take("room", "bob", 100.05) == pytest.approx(0.05)  # half a token back, nothing taken
    assert buckets.take("room", "bob", 100.1) == 0.0
    assert buckets.take("room", "carol", 100.1) == 0.0  # one user's flood is theirs alone
    assert buckets.take("grants", "bob", 100.1) == 0.0  # a route without a rate is not limited


def test_a_rate_of_zero_is_no_limit_and_a_burst_is_at_least_one_call():
    buckets = Buckets({"room": Rate.of(0, 5)})
    assert all(buckets.take("room", "bob", 0.0) == 0.0 for _ in range(10_000))
    assert Rate.of(0.1, 1).burst == 1.0


def test_empty_looks_without_taking():
    buckets = Buckets({"auth": Rate.of(1, 2)})
    assert buckets.empty("auth", "10.0.0.1", 0.0) == 0.0
    buckets.take("auth", "10.0.0.1", 0.0)
    buckets.take("auth", "10.0.0.1", 0.0)
    assert buckets.empty("auth", "10.0.0.1", 0.0) == pytest.approx(1.0)
    assert buckets.empty("auth", "10.0.0.1", 0.0) == pytest.approx(1.0)


def test_the_table_of_buckets_stays_bounded_and_forgets_only_what_a_fresh_bucket_would_say():
    buckets = Buckets({"room": Rate.of(1, 1)}, max_keys=100)
    for i in range(1000):
        buckets.take("room", f"user{i}", float(i))  # each bucket is full again a second later
    assert len(buckets) <= 101
    buckets = Buckets({"room": Rate.of(1, 1)}, max_keys=100)
    for i in range(1000):
        buckets.take("room", f"user{i}", 0.0)  # none full again: the oldest half goes
    assert len(buckets) <= 101


@settings(max_examples=200, deadline=None)
@given(
    per_second=st.floats(0.5, 100),
    burst_seconds=st.floats(0.1, 10),
    gaps=st.lists(st.floats(0, 2), min_size=1, max_size=200),
)
def test_no_user_gets_more_than_the_burst_plus_the_refill(per_second, burst_seconds, gaps):
    rate = Rate.of(per_second, burst_seconds)
    buckets = Buckets({"room": rate})
    now, passed = 0.0, 0
    for gap in gaps:
        now += gap
        wait = buckets.take("room", "bob", now)
        assert wait >= 0.0
        if wait == 0.0:
            passed += 1
        else:
            # told the truth: a call after the wait it was given passes (checked on a copy: nothing changes)
            assert wait <= 1.0 / per_second + 1e-9
    assert passed <= rate.burst + now * per_second + 1e-6


@settings(max_examples=100, deadline=None)
@given(st.floats(0.5, 50), st.floats(0.5, 5), st.integers(1, 50))
def test_a_caller_who_waits_as_told_is_served(per_second, burst_seconds, extra):
    buckets = Buckets({"room": Rate.of(per_second, burst_seconds)})
    now = 0.0
    for _ in range(int(Rate.of(per_second, burst_seconds).burst) + extra):
        wait = buckets.take("room", "bob", now)
        if wait:
            now += wait
            assert buckets.take("room", "bob", now + 1e-9) == 0.0


def test_open_requests_are_bounded_per_user_and_the_most_are_named():
    open_ = OpenRequests(3)
    assert [open_.enter("bob") for _ in range(4)] == [True, True, True, False]
    assert open_.enter("carol")
    assert open_.most() == [("bob", 3), ("carol", 1)] and open_.total() == 4
    open_.leave("bob")
    assert open_.enter("bob") and open_.held("bob") == 3
    for _ in range(3):
        open_.leave("bob")
    open_.leave("bob")  # one leave too many counts nothing below zero
    assert open_.held("bob") == 0 and open_.most() == [("carol", 1)]
    assert all(OpenRequests(0).enter("bob") for _ in range(1000))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20), st.lists(st.tuples(st.sampled_from(["bob", "carol"]), st.booleans()), max_size=300))
def test_open_requests_never_pass_the_limit_and_count_what_entered(limit, steps):
    open_ = OpenRequests(limit)
    held = {"bob": 0, "carol": 0}
    for who, enter in steps:
        if enter:
            if open_.enter(who):
                held[who] += 1
        elif held[who]:
            open_.leave(who)
            held[who] -= 1
        assert open_.held(who) == held[who] <= limit


def test_a_confirmed_token_is_trusted_for_a_while_and_the_table_is_bounded():
    trusted = Trusted(60.0, max_keys=10)
    trusted.confirm("d1", 0.0)
    assert ("d1", 59.0) in trusted and ("d1", 60.0) not in trusted and ("d2", 0.0) not in trusted
    for i in range(100):
        trusted.confirm(f"x{i}", 1.0)
    assert len(trusted._until) <= 10 and ("x99", 2.0) in trusted


def test_once_per_period_per_key():
    said = OncePer(60.0)
    assert said.due("bob", 0.0) and not said.due("bob", 59.0) and said.due("carol", 59.0)
    assert said.due("bob", 60.0)


def test_retry_after_is_whole_seconds_never_zero_and_the_refusal_says_the_rate():
    assert [retry_after(s) for s in (0.0001, 0.5, 1.0, 1.2, 7.0)] == [1, 1, 1, 2, 7]
    assert refusal_words("room", Rate.of(20, 5)) == (
        "too many room calls: this service takes 20 a second from one user (bursts of 100)"
    )
