"""Process -> kernel attribution: the pure mapping and NSpid (gpu_quota_ext.usage.attribution), the live table
and the resolver (usage.processes)."""

import os
import subprocess
import sys

import pytest

from gpu_quota_ext.shared.env_vars import KERNEL_ID
from gpu_quota_ext.usage import PidResolver, ProcTable
from gpu_quota_ext.usage.attribution import (
    ENVIRONMENT,
    TREE,
    Attribution,
    alias_map,
    kernel_for_pid,
    parse_environ_kernel_id,
    parse_nspid,
    parse_ppid,
    parse_uids,
)

from .fakes import ProcSnapshot

# --- pure parts ---------------------------------------------------------------------------------------


def test_parse_ppid_survives_odd_command_names():
    assert parse_ppid("1234 (python3) S 77 1234 1234 0 -1") == 77
    assert parse_ppid("1234 (my (odd) prog) R 88 1 1") == 88
    assert parse_ppid("garbage") is None


def test_parse_nspid():
    status = "Name:\tpython\nTgid:\t4242\nNSpid:\t4242\t17\nPPid:\t1\n"
    assert parse_nspid(status) == [4242, 17]
    assert parse_nspid("Name:\tx\n") == []


def test_parse_environ_kernel_id():
    env = b"HOME=/root\0" + KERNEL_ID.encode() + b"=abc-123\0PATH=/bin\0"
    assert parse_environ_kernel_id(env) == "abc-123"
    assert parse_environ_kernel_id(b"HOME=/root\0") is None


def test_alias_map_maps_other_namespaces_numbers_to_ours():
    assert alias_map([(4242, [4242, 17]), (5000, [5000]), (6000, [6000, 17])]) == {17: 4242}


def test_parse_uids():
    assert parse_uids("Name:\tx\nUid:\t1000\t1000\t0\t1000\nGid:\t1\t1\t1\t1\n") == (1000, 1000, 0, 1000)
    assert parse_uids("Name:\tx\n") == ()


ME, OTHER = 1000, 1001
PARENTS = {100: 1, 101: 100, 102: 101, 200: 1, 300: 1, 400: 1, 500: 1, 600: 1, 601: 100}
ENVIRON = {300: "k-escaped", 400: "k-unknown", 500: "k1", 600: "k2", 601: "k2"}
UIDS = {500: (OTHER, OTHER, OTHER, OTHER), 600: (ME, 0, ME, ME), 601: (OTHER,) * 4}


def owner(pid, roots=None, known=("k1", "k2", "k-escaped"), own_uid=ME):
    return kernel_for_pid(
        pid,
        roots or {100: "k1", 200: "k2"},
        PARENTS.get,
        ENVIRON.get,
        set(known),
        lambda p: UIDS.get(p, (ME,) * 4),
        own_uid,
    )


def test_a_kernel_owns_itself_and_every_descendant_by_its_tree():
    assert owner(100) == Attribution("k1", TREE)
    assert owner(102) == ("k1", TREE)  # a grandchild: e.g. a DataLoader worker of a subprocess
    assert owner(200) == ("k2", TREE)


def test_the_tree_wins_over_what_the_environment_says_and_over_the_uid():
    assert owner(601) == ("k1", TREE)  # under k1 (another uid, say after su): k1's, whatever it names


def test_an_escaped_process_of_our_user_is_found_by_its_environment():
    assert owner(300) == Attribution("k-escaped", ENVIRONMENT)
    assert owner(400) is None  # names a kernel this server does not know: not ours to attribute
    assert owner(999) is None  # unknown process


class EnvironmentReads:
    """kernel_in_environ that records which PIDs had their environment read."""

    def __init__(self):
        self.pids = []

    def __call__(self, pid):
        self.pids.append(pid)
        return ENVIRON.get(pid)


def test_a_process_of_another_user_is_never_attributed_by_its_environment():
    assert owner(500) is None  # another user naming k1
    assert owner(600) is None  # our real uid, but root's effective uid (a setuid program): not ours either
    assert owner(300, own_uid=OTHER) is None  # the server runs as someone else: our processes do not count
    assert owner(300, own_uid=None) is None  # no uids on this system: no attribution by environment
    reads = EnvironmentReads()
    assert kernel_for_pid(500, {}, PARENTS.get, reads, {"k1"}, lambda p: UIDS[p], ME) is None
    assert kernel_for_pid(300, {}, PARENTS.get, reads, {"k-escaped"}, lambda p: (), ME) is None  # gone: no uids
    assert reads.pids == []  # neither environment was even read


def test_a_loop_in_the_parent_table_ends():
    assert kernel_for_pid(5, {}, {5: 6, 6: 5}.get, lambda pid: None, set(), lambda pid: (), ME) is None


def test_proc_table_reads_the_live_tree_and_environment():
    table = ProcTable()
    if not table.has_proc:
        pytest.skip("no /proc here")
    env = dict(os.environ, **{KERNEL_ID: "k-live"})
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"], env=env, stdout=subprocess.PIPE
    )
    try:
        child.stdout.readline()  # exec done: until then /proc shows the environment it forked with (ours)
        assert table.parent_of(child.pid) == os.getpid()
        assert table.kernel_in_environ(child.pid) == "k-live"
        assert set(table.uids_of(child.pid)) == {os.getuid()}
        assert isinstance(table.namespace_aliases(), dict)  # a full scan runs without error here
        resolver = PidResolver(table)
        assert resolver.resolve([child.pid], {os.getpid(): "me"}, {"me"}, now=0.0) == {
            child.pid: (("me", TREE), child.pid)
        }
        assert resolver.resolve([child.pid], {}, {"k-live"}, now=100.0) == {
            child.pid: (("k-live", ENVIRONMENT), child.pid)
        }
        # A server of another user does not believe what our process's environment says.
        assert PidResolver(table, own_uid=os.getuid() + 1).resolve([child.pid], {}, {"k-live"}, now=0.0) == {}
    finally:
        child.kill()
        child.wait()


def test_resolver_maps_pids_of_another_namespace_through_nspid_and_scans_rarely():
    # A process table where NVML's PID 17 is our 4242 (a container's numbering).
    table = ProcSnapshot(parents={4242: 100, 100: 1}, aliases={17: 4242})
    resolver = PidResolver(table)
    assert resolver.resolve([17], {100: "k1"}, {"k1"}, now=0.0) == {17: (("k1", TREE), 4242)}
    resolver.resolve([17, 55], {100: "k1"}, {"k1"}, now=1.0)
    resolver.resolve([56], {100: "k1"}, {"k1"}, now=2.0)
    assert table.scans == 1  # unknown PIDs do not make every tick scan all of /proc


def test_foreign_pids_are_those_of_another_real_uid_and_none_for_root():
    from gpu_quota_ext.usage.attribution import foreign_pids

    uids = {10: (1000, 1000, 1000, 1000), 11: (1001, 1001, 1001, 1001), 12: ()}  # 12: gone
    assert foreign_pids([10, 11, 12], 1000, lambda pid: uids[pid]) == (11,)
    assert foreign_pids([10, 11], 0, lambda pid: uids[pid]) == ()  # root may checkpoint anyone's process
    assert foreign_pids([10, 11], None, lambda pid: uids[pid]) == ()
