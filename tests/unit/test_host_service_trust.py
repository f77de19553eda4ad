"""Issue 19, items 1 and 2, the pure parts: what a user's server says is checked against what the system knows.

- A PID a lease registers counts only while its real uid is the lease owner's Unix user (attribution.verify);
  any other counts for nobody and is never killed (attribution.decide).
- One user's limits (limits.py, book.py): the most kernels, the most bytes per device; a burst of 1,000
  grants from one user leaves the others' next starts admitted and the book and its store bounded.
- A grant no verified live process held for a lease period is idle (book.idle_grants), and released.
The same attacks against a real hub with real Unix users: tests/hub/test_host_service_trust.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_quota_ext.devices import Device
from gpu_quota_ext.hub import configure_hub_caps, hub_caps
from gpu_quota_ext.hub.caps import HOST_KEYS
from gpu_quota_ext.hub.service.attribution import (
    GpuProcess,
    Registration,
    Unmanaged,
    attribute,
    decide,
    verify,
)
from gpu_quota_ext.hub.service.book import PIDS_PER_KERNEL, HostBook, Owned, idle_grants
from gpu_quota_ext.hub.service.store import Store
from gpu_quota_ext.hub.service.user_policy import (
    BUILT_IN_LIMITS,
    UserLimits,
    UserPolicy,
    host_limits,
    user_policy,
)
from gpu_quota_ext.ledger import AdmissionRefused, Grant
from gpu_quota_ext.policy import PolicyDecision, build_policy
from gpu_quota_ext.shared.sizes import GiB, PolicyError, parse_cap

DEVICES = [Device(0, "Test GPU", "GPU-0", 80 * GiB, 0), Device(1, "Test GPU", "GPU-1", 80 * GiB, 1)]
HOST = build_policy("0.25", "1.0", overcommit=1.0)
T0 = 1_000_000.0
UIDS = {"alice": 1001, "bob": 1002}


def policy(limits: UserLimits = BUILT_IN_LIMITS, on_full: str = "cpu-only", cap: str = "0.25") -> UserPolicy:
    return UserPolicy(PolicyDecision(parse_cap(cap), parse_cap("1.0"), 1, "test"), on_full, limits)


# --- item 1: registered PIDs are claims ----------------------------------------------------------------


def test_bob_naming_alices_process_in_his_lease_leaves_her_usage_hers_and_nothing_to_kill():
    """The attack of the issue, as the service's pure parts see it: bob's made-up kernel x holds GPU-1, his
    lease names alice's kernel process (PID 500, on GPU-0)."""
    registrations = [
        Registration("alice", "", "ka", 500),
        Registration("bob", "nb", "x", 500),
    ]
    verified = verify(registrations, {500: UIDS["alice"]}, UIDS)
    assert verified.roots == {500: "ka"}
    (refused,) = verified.refused
    assert refused.registration == Registration("bob", "nb", "x", 500)
    assert (refused.uid, refused.expected) == (1001, 1002) and "not as bob's Unix user" in refused.why

    granted = {"ka": ("alice", ("GPU-0",)), "x": ("bob", ("GPU-1",))}
    process = GpuProcess(500, "GPU-0", 10 * GiB, UIDS["alice"], "alice", verified.roots.get(500))
    result = attribute([process], granted, "{username}", UIDS)
    assert result.kernel_used == {"ka": {"GPU-0": 10 * GiB}} and result.unmanaged == []


def test_without_alices_own_lease_her_process_is_her_unmanaged_usage_never_bobs():
    verified = verify([Registration("bob", "nb", "x", 500)], {500: UIDS["alice"]}, UIDS)
    assert verified.roots == {}
    process = GpuProcess(500, "GPU-0", 10 * GiB, UIDS["alice"], "alice", None)
    (item,) = attribute([process], {"x": ("bob", ("GPU-1",))}, "{username}", UIDS).unmanaged
    assert item.user == "alice" and item.user_uid == UIDS["alice"]


def test_a_gone_pid_is_nobodys_and_no_attempt_and_a_user_without_a_unix_user_is_told():
    verified = verify(
        [Registration("alice", "", "ka", 500), Registration("carol", "", "kc", 600)],
        {500: None, 600: 1003},
        {"alice": 1001, "carol": None},
    )
    assert verified.roots == {}
    (refused,) = verified.refused
    assert refused.registration.user == "carol" and "no Unix user" in refused.why


registration = st.builds(
    Registration,
    user=st.sampled_from(["alice", "bob", "carol"]),
    server=st.sampled_from(["", "nb"]),
    kernel_id=st.sampled_from(["k1", "k2", "k3"]),
    pid=st.integers(2, 12),
)


@settings(max_examples=300, deadline=None)
@given(
    registrations=st.lists(registration, max_size=20),
    real=st.dictionaries(st.integers(2, 12), st.one_of(st.none(), st.sampled_from([0, 1001, 1002, 1003]))),
    users=st.dictionaries(
        st.sampled_from(["alice", "bob", "carol"]), st.one_of(st.none(), st.sampled_from([1001, 1002]))
    ),
)
def test_a_pid_counts_only_for_a_kernel_of_the_user_whose_process_it_is(registrations, real, users):
    verified = verify(registrations, real, users)
    for pid, kernel_id in verified.roots.items():
        owners = [r.user for r in registrations if (r.pid, r.kernel_id) == (pid, kernel_id)]
        assert real[pid] is not None and real[pid] in [users.get(owner) for owner in owners]
    for item in verified.refused:
        assert real[item.registration.pid] is not None
        assert users.get(item.registration.user) != real[item.registration.pid]
    # Every live registration is either believed (for its kernel, or the PID's first claimant) or refused.
    for reg in registrations:
        if real.get(reg.pid) is None:
            assert reg not in [r.registration for r in verified.refused]
        elif users.get(reg.user) == real[reg.pid]:
            assert reg.pid in verified.roots
        else:
            assert reg in [r.registration for r in verified.refused]


unmanaged = st.builds(
    Unmanaged,
    user=st.sampled_from(["alice", "bob", "unix:svc", "pid:7"]),
    pid=st.integers(2, 50),
    uuid=st.sampled_from(["GPU-0", "GPU-1"]),
    used=st.integers(0, 10 * GiB),
    uid=st.one_of(st.none(), st.sampled_from([0, 1001, 1002])),
    why=st.just("test"),
    user_uid=st.one_of(st.none(), st.sampled_from([0, 1001, 1002])),
)


@settings(max_examples=300, deadline=None)
@given(items=st.lists(unmanaged, max_size=10), grace=st.floats(0, 5))
def test_the_host_watchdog_kills_only_a_process_of_the_user_whose_usage_it_is(items, grace):
    _, seen = decide(items, {}, T0, "kill", grace, (0,))
    decisions, _ = decide(items, seen, T0 + 10, "kill", grace, (0,))
    for decision in decisions:
        if decision.action == "kill":
            assert decision.item.uid is not None and decision.item.uid == decision.item.user_uid != 0


# --- item 2: one user's limits ------------------------------------------------------------------------


def test_limits_come_from_the_same_mapping_as_the_caps_and_are_checked_like_them():
    caps = hub_caps(
        default={"max_kernels": 4},
        groups={"big": {"user_budget": "1.0", "max_kernels": "32"}},
        users={"alice": {"user_budget": "20GiB"}},
        extra_keys=HOST_KEYS,
    )
    host = host_limits()
    assert (host.max_kernels, str(host.user_budget)) == (16, "0.5")  # the built-in defaults
    alice = user_policy(caps, HOST, "alice", ["big"], host)
    assert (alice.limits.max_kernels, alice.limits.budget_on(DEVICES[0])) == (32, 20 * GiB)
    assert user_policy(caps, HOST, "eve", [], host).limits == UserLimits(4, parse_cap("0.5"))
    unlimited = hub_caps(default={"user_budget": "none"}, extra_keys=HOST_KEYS)
    assert user_policy(unlimited, HOST, "eve").limits.user_budget is None
    for bad in ({"max_kernels": 0}, {"max_kernels": "2.5"}, {"max_kernels": True}, {"user_budget": "lots"}):
        with pytest.raises(PolicyError, match="default"):
            hub_caps(default=bad, extra_keys=HOST_KEYS)
    with pytest.raises(PolicyError, match="host quota service"):
        configure_hub_caps(_Config(), default={"max_kernels": 4})  # a server alone would ignore it: said so


class _Config(dict):
    """The little of a traitlets Config that configure_hub_caps touches."""

    def __getitem__(self, key):
        return self.setdefault(key, _Section())

    def __getattr__(self, key):
        return self[key]


class _Section(dict):
    def __setattr__(self, key, value):
        self[key] = value

    def __getattr__(self, key):
        return self[key]


def open_book(tmp_path, lease_seconds=60.0, check_gap=30.0):
    store = Store(str(tmp_path), DEVICES)
    return store, HostBook(DEVICES, HOST, store, lease_seconds, 0, host_limits(), check_gap)


def test_a_burst_of_a_thousand_grants_from_one_user_leaves_room_for_the_others(tmp_path):
    store, book = open_book(tmp_path)
    codes = []
    for number in range(1000):
        try:
            book.grant("carol", "made-up", f"c{number}", "python3", policy(host_limits()), None, T0)
            codes.append("granted")
        except AdmissionRefused as refusal:
            codes.append(str(refusal))
    held = [o for o in book.owned() if o.grant.user == "carol"]
    assert len(held) == 16 and codes.count("granted") == 16
    assert "max_kernels 16" in codes[-1]
    on_gpu = [o.grant for o in held if o.grant.devices]
    # Two quarters on each GPU: half of each device is carol's budget; the other 12 are CPU-only.
    assert sorted(g.devices[0] for g in on_gpu) == [0, 0, 1, 1]
    assert all("user_budget 0.5" in o.grant.cpu_only_reason for o in held if not o.grant.devices)
    assert store.counts() == {"grants": 16, "leases": 1, "reservations": 0}
    alice, _ = book.grant("alice", "", "a1", "python3", policy(host_limits(), "refuse"), None, T0)
    assert alice.devices and alice.caps[alice.devices[0]] == 20 * GiB


def test_a_refusing_user_past_their_budget_is_refused_with_the_reason(tmp_path):
    _, book = open_book(tmp_path)
    mine = policy(UserLimits(16, parse_cap("0.3")), "refuse")
    book.grant("bob", "", "b1", "python3", mine, None, T0)
    book.grant("bob", "", "b2", "python3", mine, None, T0)
    with pytest.raises(AdmissionRefused, match=r"would pass your 24(\.0)? GiB \(user_budget 0.3\)"):
        book.grant("bob", "", "b3", "python3", mine, None, T0)
    assert len(book.owned()) == 2


def test_a_cap_raise_stops_at_what_the_users_budget_leaves(tmp_path):
    _, book = open_book(tmp_path)
    limits = UserLimits(16, parse_cap("0.6"))  # 48 GiB of each device
    book.set_limits("bob", limits)
    book.grant("bob", "", "b1", "python3", policy(limits), [0], T0)
    book.grant("bob", "", "b2", "python3", policy(limits), [0], T0)
    outcome = book.change("bob", "b1", False, parse_cap("0.5"), None)
    assert outcome.status == "clamped" and outcome.grant.caps[0] == 28 * GiB, outcome  # 48 GiB less b2's 20
    assert "user_budget" in outcome.message
    outcome = book.change("bob", "b2", False, parse_cap("0.5"), None)
    assert outcome.status == "refused" and outcome.grant.caps[0] == 20 * GiB  # nothing left to raise into
    outcome = book.change("bob", "b2", False, parse_cap("0.1"), None)
    assert outcome.status == "granted" and outcome.grant.caps[0] == 8 * GiB  # lowering always fits
    outcome = book.change("bob", "b1", False, parse_cap("0.5"), None)
    assert outcome.status == "granted" and outcome.grant.caps[0] == 40 * GiB
    assert sum(o.grant.caps[0] for o in book.owned()) <= 48 * GiB


def test_a_raise_refused_by_on_over_max_changes_nothing(tmp_path):
    store = Store(str(tmp_path), DEVICES)
    book = HostBook(DEVICES, build_policy("0.25", "1.0", overcommit=1.0, on_over_max="refuse"), store, 60, 0)
    book.set_limits("bob", UserLimits(16, parse_cap("0.3")))
    grant, _ = book.grant("bob", "", "b1", "python3", policy(UserLimits(16, parse_cap("0.3"))), None, T0)
    outcome = book.change("bob", "b1", False, parse_cap("0.9"), None)
    assert outcome.status == "refused" and outcome.grant == grant and book.get("bob", "b1", False) == grant


# --- a lease keeps only what the user holds; a grant no live process holds is idle ----------------------


def test_a_lease_keeps_only_the_users_own_granted_kernels_and_a_bounded_list_of_pids(tmp_path):
    store, book = open_book(tmp_path)
    book.grant("alice", "", "a1", "python3", policy(), None, T0)
    book.grant("bob", "", "b1", "python3", policy(), None, T0)
    pids = tuple(range(100, 100 + 1000))
    book.lease("bob", "", {"b1": pids, "a1": (5,), **{f"ghost{i}": (6,) for i in range(100)}}, T0)
    (bob,) = [lease for lease in book.leases() if lease.user == "bob"]
    assert list(bob.kernels) == ["b1"] and bob.kernels["b1"] == pids[:PIDS_PER_KERNEL]
    assert {r.kernel_id for r in book.registrations() if r.user == "bob"} == {"b1"}
    # A server with no grant left keeps no lease: a made-up server name leaves no row.
    book.release("bob", "b1", False)
    book.lease("bob", "", {}, T0 + 1)
    book.lease("bob", "made-up", {}, T0 + 1)
    assert [lease.user for lease in book.leases()] == ["alice"]
    assert store.counts() == {"grants": 1, "leases": 1, "reservations": 0}


def _owned(kernel_id: str, granted_at: float) -> Owned:
    return Owned(Grant(kernel_id, "u", "python3", (), {}, {}, {}, "test", True), "", granted_at)


@settings(max_examples=300, deadline=None)
@given(
    granted_at=st.floats(0, 100),
    held_at=st.one_of(st.none(), st.floats(0, 200)),
    since=st.floats(0, 200),
    now=st.floats(0, 300),
    gap=st.floats(0, 50),
)
def test_a_grant_is_idle_only_after_a_whole_period_of_checks_that_found_no_live_process(
    granted_at, held_at, since, now, gap
):
    last = min(now, since + gap / 2)
    idle = idle_grants([_owned("k", granted_at)], {} if held_at is None else {"k": held_at}, since, last, now, 60, gap)
    if idle:
        assert now - granted_at >= 60 and now - since >= 60 and now - last <= gap
        assert held_at is None or now - held_at >= 60
    assert idle_grants([_owned("k", granted_at)], {}, None, None, now, 60, gap) == []  # never checked: never idle


def test_a_lease_renewed_with_empty_pid_lists_keeps_nothing_for_long(tmp_path):
    _, book = open_book(tmp_path, lease_seconds=60, check_gap=10)
    book.grant("carol", "made-up", "c1", "python3", policy(), None, T0)
    book.grant("alice", "", "a1", "python3", policy(), None, T0)
    for tick in range(0, 70, 5):
        now = T0 + tick
        book.lease("carol", "made-up", {"c1": ()}, now)
        book.lease("alice", "", {"a1": (500,)}, now)
        book.note_round({"a1": (500,)}, now)  # the sampler believed alice's PID, and nothing of carol's
    assert book.idle(T0 + 65) == ["c1"]
    assert book.release_idle(T0 + 65) == ["c1"]
    assert [o.grant.kernel_id for o in book.owned()] == ["a1"] and [lease.user for lease in book.leases()] == ["alice"]


def test_checks_that_stopped_make_nothing_idle_and_a_restart_of_them_gives_a_full_period(tmp_path):
    _, book = open_book(tmp_path, lease_seconds=60, check_gap=10)
    book.grant("alice", "", "a1", "python3", policy(), None, T0)
    book.note_round({}, T0)
    assert book.idle(T0 + 100) == []  # no round for 100 s: a hung driver call, not an idle grant
    for tick in range(100, 165, 5):  # the checks are back, every 5 s: a full period from their restart
        book.note_round({}, T0 + tick)
        assert book.idle(T0 + tick) == ([] if tick < 160 else ["a1"]), tick


operation = st.one_of(
    st.tuples(st.just("grant"), st.sampled_from(["alice", "bob"]), st.sampled_from([None, [0], [1]])),
    st.tuples(st.just("change"), st.integers(0, 30), st.sampled_from(["0.1", "0.3", "0.5", "1.0", "50GiB"])),
    st.tuples(st.just("reset"), st.integers(0, 30), st.none()),
    st.tuples(st.just("release"), st.integers(0, 30), st.none()),
)


@settings(max_examples=150, deadline=None)
@given(
    operations=st.lists(operation, max_size=40),
    budget=st.sampled_from(["0.3", "0.5", "0.75", "none"]),
    most=st.integers(1, 6),
    on_over_max=st.sampled_from(["clamp", "refuse"]),
)
def test_no_sequence_of_starts_raises_resets_and_releases_passes_a_users_limits(operations, budget, most, on_over_max):
    class Journal:
        def __getattr__(self, name):
            return lambda *args: None

    host = build_policy("0.25", "1.0", overcommit=2.0, on_over_max=on_over_max)
    limits = host_limits(most, budget)
    book = HostBook(DEVICES, host, Journal(), 60, 0, limits)
    started = []
    for kind, who, arg in operations:
        if kind == "grant":
            kernel_id = f"k{len(started)}"
            try:
                book.grant(who, "", kernel_id, "python3", policy(limits), arg, T0)
                started.append(kernel_id)
            except AdmissionRefused:
                pass
        elif started:
            kernel_id = started[who % len(started)]
            held = {o.grant.kernel_id: o.grant for o in book.owned()}
            if kernel_id not in held:
                continue
            owner = held[kernel_id].user
            try:
                if kind == "change":
                    book.change(owner, kernel_id, False, parse_cap(arg), None)
                elif kind == "reset":
                    book.reset(owner, kernel_id, False)
                else:
                    book.release(owner, kernel_id, False)
            except PolicyError:
                pass  # a CPU-only kernel has no cap to change
        for user in ("alice", "bob"):
            mine = [o.grant for o in book.owned() if o.grant.user == user]
            assert len(mine) <= most
            for device in DEVICES:
                total = sum(g.caps.get(device.index, 0) for g in mine)
                limit = limits.budget_on(device)
                assert limit is None or total <= limit, (user, device.index, total, limit)
