"""The host service's record: every grant survives a restart of the service, in SQLite WAL, in a private
directory; leases release what their servers no longer run, and everything of a server whose lease ran out."""

import os
import sqlite3
import stat
import threading

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.hub.service.attribution import Registration
from gpu_quota_ext.hub.service.book import Forbidden, HostBook
from gpu_quota_ext.hub.service.store import Store
from gpu_quota_ext.hub.service.user_policy import UserPolicy
from gpu_quota_ext.ledger import AdmissionRefused, UnknownKernel
from gpu_quota_ext.policy import PolicyDecision, build_policy
from gpu_quota_ext.shared.sizes import GiB, parse_cap

DEVICES = [Device(0, "Test GPU", "GPU-aaaa", 80 * GiB, 0), Device(1, "Test GPU", "GPU-bbbb", 80 * GiB, 1)]
POLICY = build_policy("0.25", "1.0", overcommit=1.0)
QUARTER = UserPolicy(PolicyDecision(parse_cap("0.25"), parse_cap("1.0"), 1, "test"), "cpu-only")
T0 = 1_000_000.0


def open_book(state_dir, lease_seconds=60, start_grace=0, devices=DEVICES, now=T0):
    store = Store(str(state_dir), devices)
    book = HostBook(devices, POLICY, store, lease_seconds, start_grace)
    book.restore(*store.load(), now)
    return store, book


def test_a_restart_restores_every_grant_with_its_changed_cap(tmp_path):
    store, book = open_book(tmp_path)
    book.grant("alice", "", "k1", "python3", QUARTER, None, T0)
    book.grant("bob", "", "k2", "python3", QUARTER, None, T0)
    book.change("alice", "k1", False, parse_cap("0.5"), None)
    before = {o.grant.kernel_id: o.grant for o in book.owned()}
    grants_before = book.ledger.device_grants()
    store.close()

    store, book = open_book(tmp_path)
    after = {o.grant.kernel_id: o.grant for o in book.owned()}
    assert after == before
    assert after["k1"].caps[after["k1"].devices[0]] == 40 * GiB
    assert book.ledger.device_grants() == grants_before  # the budget counts the restored grants
    assert book.get("bob", "k2", False).user == "bob"


def test_the_database_is_wal_in_a_private_directory(tmp_path):
    state = tmp_path / "state"
    store, _ = open_book(state)
    assert store.journal_mode() == "wal"
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    for name in os.listdir(state):
        assert stat.S_IMODE(os.stat(state / name).st_mode) & 0o077 == 0, name


def test_a_state_directory_others_could_read_is_made_private(tmp_path):
    state = tmp_path / "open"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    open_book(state)
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700


def test_a_lease_releases_kernels_its_server_no_longer_lists(tmp_path):
    store, book = open_book(tmp_path)
    book.grant("alice", "", "k1", "python3", QUARTER, None, T0)
    book.grant("alice", "", "k2", "python3", QUARTER, None, T0)
    book.grant("alice", "other", "k3", "python3", QUARTER, None, T0)
    released = book.lease("alice", "", {"k1": (123,)}, T0 + 1)
    assert released == ["k2"]
    assert {o.grant.kernel_id for o in book.owned()} == {"k1", "k3"}  # another server's kernel stays
    assert book.registrations() == [Registration("alice", "", "k1", 123)]
    store.close()
    _, book = open_book(tmp_path)
    assert {o.grant.kernel_id for o in book.owned()} == {"k1", "k3"}


def test_a_young_grant_is_kept_until_its_server_could_list_it(tmp_path):
    _, book = open_book(tmp_path, start_grace=30)
    book.grant("alice", "", "k1", "python3", QUARTER, None, T0)
    assert book.lease("alice", "", {}, T0 + 5) == []
    assert book.lease("alice", "", {}, T0 + 31) == ["k1"]


def test_a_lease_that_runs_out_releases_every_grant_of_its_server(tmp_path):
    store, book = open_book(tmp_path, lease_seconds=60)
    book.grant("alice", "", "k1", "python3", QUARTER, None, T0)
    book.grant("bob", "", "k2", "python3", QUARTER, None, T0)
    book.lease("bob", "", {"k2": ()}, T0 + 50)
    assert book.expire(T0 + 59) == []
    assert book.expire(T0 + 61) == ["k1"]  # alice's server was not heard of for 61 s
    assert [o.grant.kernel_id for o in book.owned()] == ["k2"]
    assert store.counts() == {"grants": 1, "leases": 1, "reservations": 0}
    assert sum(e["granted"] for e in book.ledger.device_grants()) == 20 * GiB


def test_after_a_restart_every_server_has_a_full_lease_to_re_register(tmp_path):
    store, book = open_book(tmp_path, lease_seconds=60)
    book.grant("alice", "", "k1", "python3", QUARTER, None, T0)
    book.grant("bob", "", "k2", "python3", QUARTER, None, T0)
    store.close()
    # The service was down for 500 s: nobody could renew; nothing is released for that.
    store, book = open_book(tmp_path, lease_seconds=60, now=T0 + 500)
    assert book.expire(T0 + 500) == []
    book.lease("bob", "", {"k2": ()}, T0 + 530)  # bob's server comes back; alice's stopped meanwhile
    assert book.expire(T0 + 561) == ["k1"]
    assert [o.grant.kernel_id for o in book.owned()] == ["k2"]


def test_another_users_kernel_is_forbidden_and_unknown_is_unknown(tmp_path):
    _, book = open_book(tmp_path)
    book.grant("alice", "", "k1", "python3", QUARTER, None, T0)
    with pytest.raises(Forbidden):
        book.grant("bob", "", "k1", "python3", QUARTER, None, T0)  # the same id from bob's server
    for call in (book.get, book.release):
        with pytest.raises(Forbidden):
            call("bob", "k1", False)
    with pytest.raises(Forbidden):
        book.change("bob", "k1", False, parse_cap("0.1"), None)
    with pytest.raises(UnknownKernel):
        book.get("bob", "nope", False)
    assert book.get("root", "k1", True).user == "alice"  # an admin sees it
    assert book.lease("bob", "", {"k1": (1234,)}, T0) == []  # bob cannot register alice's kernel
    assert book.registrations() == []
    assert book.get("alice", "k1", False).caps  # and nothing of alice's changed


def test_concurrent_grants_never_pass_a_devices_budget(tmp_path):
    _, book = open_book(tmp_path)
    refuse = UserPolicy(QUARTER.decision, "refuse")
    results, barrier = [], threading.Barrier(16)

    def start(i):
        barrier.wait()
        try:
            results.append(book.grant(f"user{i % 4}", "", f"k{i}", "python3", refuse, None, T0)[0])
        except AdmissionRefused:
            results.append(None)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    granted = [g for g in results if g is not None]
    assert len(granted) == 8  # 4 quarters on each of 2 devices
    for entry in book.ledger.device_grants():
        assert entry["granted"] <= entry["budget"]


def test_a_grant_the_store_could_not_write_is_not_granted(tmp_path):
    store, book = open_book(tmp_path)
    store.db.close()  # every write fails now
    with pytest.raises(sqlite3.ProgrammingError):  # "Cannot operate on a closed database"
        book.grant("alice", "", "k1", "python3", QUARTER, None, T0)
    assert book.owned() == [] and all(e["granted"] == 0 for e in book.ledger.device_grants())


def test_a_device_gone_since_is_dropped_from_the_restored_grant(tmp_path):
    store, book = open_book(tmp_path)
    grant, _ = book.grant("alice", "", "k1", "python3", QUARTER, None, T0)
    store.close()
    kept = [d for d in DEVICES if d.index not in grant.devices]
    _, book = open_book(tmp_path, devices=[Device(0, kept[0].name, kept[0].uuid, kept[0].total, 0)])
    restored = book.owned()[0].grant
    assert restored.devices == () and "gone" in restored.cpu_only_reason
