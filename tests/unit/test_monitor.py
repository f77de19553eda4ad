"""The monitor without a server: PID -> kernel mapping, NSpid, sampling with the fake NVML, NVML trouble."""

import asyncio
import logging
import os
import subprocess
import sys

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.local_ledger import LocalLedger
from gpu_quota_ext.monitor import Monitor, PidResolver
from gpu_quota_ext.shared.env_vars import KERNEL_ID
from gpu_quota_ext.policy import GiB, build_policy, resolve
from gpu_quota_ext.processes import (
    ENVIRONMENT,
    TREE,
    Attribution,
    ProcTable,
    alias_map,
    kernel_for_pid,
    parse_environ_kernel_id,
    parse_nspid,
    parse_ppid,
    parse_uids,
)
from gpu_quota_ext.fake_nvml import FakeNvml
from gpu_quota_ext.policy import watchdog_settings

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
        pid, roots or {100: "k1", 200: "k2"}, PARENTS.get, ENVIRON.get, set(known), lambda p: UIDS.get(p, (ME,) * 4), own_uid
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
        assert resolver.resolve([child.pid], {os.getpid(): "me"}, {"me"}, now=0.0) == {child.pid: (("me", TREE), child.pid)}
        assert resolver.resolve([child.pid], {}, {"k-live"}, now=100.0) == {child.pid: (("k-live", ENVIRONMENT), child.pid)}
        # A server of another user does not believe what our process's environment says.
        assert PidResolver(table, own_uid=os.getuid() + 1).resolve([child.pid], {}, {"k-live"}, now=0.0) == {}
    finally:
        child.kill()
        child.wait()


class FakeTable:
    """A process table snapshot where NVML's PID 17 is our 4242 (a container's numbering)."""

    has_proc = True

    def __init__(self):
        self.scans = 0

    def parent_of(self, pid):
        return {4242: 100, 100: 1}.get(pid)

    def kernel_in_environ(self, pid):
        return None

    def uids_of(self, pid):
        return ()

    def namespace_aliases(self):
        self.scans += 1
        return {17: 4242}


def test_resolver_maps_pids_of_another_namespace_through_nspid_and_scans_rarely():
    table = FakeTable()
    resolver = PidResolver(table)
    assert resolver.resolve([17], {100: "k1"}, {"k1"}, now=0.0) == {17: (("k1", TREE), 4242)}
    resolver.resolve([17, 55], {100: "k1"}, {"k1"}, now=1.0)
    resolver.resolve([56], {100: "k1"}, {"k1"}, now=2.0)
    assert table.scans == 1  # unknown PIDs do not make every tick scan all of /proc


# --- sampling with the fake NVML -------------------------------------------------------------------

DEVICES = [Device(0, "Fake 0", "static-0", 16 * GiB, 0), Device(1, "Fake 1", "static-1", 16 * GiB, 1)]


class Kernels:
    def __init__(self, roots):
        self._roots = roots
        self.acted = []
        self.dead_callbacks = {}
        self.dead = set()

    def kernel_ids(self):
        return list(self._roots.values())

    def roots(self):
        return dict(self._roots)

    def on_dead(self, kernel_id, callback):
        self.dead_callbacks[kernel_id] = callback

    async def dead_ids(self):
        return sorted(self.dead)

    async def act(self, kernel_id, action):
        self.acted.append((kernel_id, action))


@pytest.fixture
def fake_nvml():
    FakeNvml.reset()
    yield FakeNvml
    FakeNvml.reset()


def make_monitor(enforce="warn", roots=None, kernels=("k1",)):
    policy = build_policy("0.25", "1.0")
    ledger = LocalLedger(DEVICES, policy)
    for kernel_id in kernels:
        ledger.grant(kernel_id, "me", "python3", resolve(policy, "me", "python3"))
    source = Kernels(roots if roots is not None else {os.getpid(): "k1"})
    monitor = Monitor(DEVICES, ledger, FakeNvml(), source, watchdog_settings(enforce, "1GiB", 0, 0.1))
    return monitor, ledger, source


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_a_sample_attributes_usage_per_kernel_and_device(fake_nvml):
    monitor, ledger, _ = make_monitor()
    device = ledger.get("k1").devices[0]
    fake_nvml.set_usage(os.getpid(), f"static-{device}", 3 * GiB)
    fake_nvml.set_usage(1, f"static-{device}", 5 * GiB)  # init: not a kernel
    fake_nvml.other_used[f"static-{1 - device}"] = 2 * GiB
    run(monitor.tick())
    sample = monitor.latest
    assert sample.state == "ok"
    assert sample.kernels == {"k1": {device: 3 * GiB}}
    assert monitor.device_used(device) == 8 * GiB and monitor.device_used(1 - device) == 2 * GiB
    assert monitor.kernel_device_usage("k1", device)["used"] == 3 * GiB
    assert monitor.kernel_device_usage("k1", 1 - device)["used"] == 0
    assert sample.pids == {"k1": (os.getpid(),)}


def test_over_the_limit_is_acted_on_and_recorded(fake_nvml):
    async def scenario():
        monitor, ledger, source = make_monitor("kill")
        device = ledger.get("k1").devices[0]
        fake_nvml.set_usage(os.getpid(), f"static-{device}", 6 * GiB)  # cap 4 GiB + 1 GiB slack
        await monitor.tick()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return monitor, source

    monitor, source = run(scenario())
    assert source.acted == [("k1", "kill")]
    last = monitor.last_action("k1")
    assert (last["action"], last["used"], last["cap"], last["outcome"]) == ("kill", 6 * GiB, 4 * GiB, "done")


def test_nvml_unavailable_is_a_clear_state_logged_once(fake_nvml, caplog):
    fake_nvml.unavailable = "NVML could not start (NVMLError_DriverNotLoaded: Driver Not Loaded)"
    monitor, _, _ = make_monitor()
    with caplog.at_level(logging.WARNING, logger="gpu_quota_ext"):
        for _ in range(3):
            run(monitor.tick())
    assert monitor.latest.state == "no-gpu"
    assert "Driver Not Loaded" in monitor.latest.message
    assert monitor.kernel_device_usage("k1", 0)["used"] is None
    assert len([r for r in caplog.records if "Driver Not Loaded" in r.getMessage()]) == 1


def test_failing_mid_run_degrades_then_recovers_logging_once_each(fake_nvml, caplog):
    monitor, _, _ = make_monitor()
    with caplog.at_level(logging.INFO, logger="gpu_quota_ext"):
        run(monitor.tick())
        assert monitor.latest.state == "ok"
        fake_nvml.lost = {"static-1"}
        run(monitor.tick())
        run(monitor.tick())
        assert monitor.latest.state == "degraded" and monitor.device_used(1) is None and monitor.device_used(0) == 0
        fake_nvml.crashing = True
        run(monitor.tick())
        assert monitor.latest.state == "error"
        fake_nvml.crashing = False
        fake_nvml.lost = set()
        run(monitor.tick())
        assert monitor.latest.state == "ok"
    lost = [r for r in caplog.records if "GpuIsLost" in r.getMessage()]
    assert len(lost) == 1


def test_no_devices_means_no_gpu_without_touching_nvml(fake_nvml):
    monitor = Monitor([], LocalLedger([], build_policy("0.25", "1.0")), FakeNvml(), Kernels({}), watchdog_settings("warn", "1GiB", 0, 1), no_gpu_reason="no GPU: none here")
    run(monitor.tick())
    assert monitor.latest.state == "no-gpu" and monitor.latest.message == "no GPU: none here"
    assert fake_nvml.calls == 0


def test_reports_are_kept_until_the_kernel_is_gone(fake_nvml):
    monitor, _, source = make_monitor()
    monitor.report("k1", [{"index": 0, "allocated": 1, "reserved": 2, "peak": 3}])
    run(monitor.tick())
    assert monitor.kernel_device_usage("k1", 0)["reserved"] == 2
    monitor.ledger.release("k1")
    source._roots = {}
    run(monitor.tick())
    assert monitor.kernel_device_usage("k1", 0)["reserved"] is None


# --- usage found by environment, and the watchdog -------------------------------------------------


class Table:
    """A process table snapshot: the test's own process is kernel k1's root; PID 900 escaped k1's tree
    and names `named` in its environment, with the uids given."""

    has_proc = True

    def __init__(self, named, uids):
        self.named, self.uids = named, uids

    def parent_of(self, pid):
        return {900: 1}.get(pid)

    def kernel_in_environ(self, pid):
        return self.named if pid == 900 else None

    def uids_of(self, pid):
        return self.uids if pid == 900 else ()

    def namespace_aliases(self):
        return {}


def monitor_with_table(enforce, table, kernels=("k1", "k2")):
    roots = {os.getpid(): "k1", 999_999: "k2"}  # k2's own process uses nothing here
    monitor, ledger, source = make_monitor(enforce, roots={p: k for p, k in roots.items() if k in kernels}, kernels=kernels)
    monitor.resolver = PidResolver(table, own_uid=ME)
    return monitor, ledger, source


async def settle():
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.mark.parametrize("enforce", ["interrupt", "restart", "kill"])
def test_usage_found_by_environment_only_gets_a_warning(fake_nvml, enforce):
    async def scenario():
        monitor, ledger, source = monitor_with_table(enforce, Table("k2", (ME,) * 4))
        device = ledger.get("k2").devices[0]
        fake_nvml.set_usage(900, f"static-{device}", 6 * GiB)  # over k2's 4 GiB + 1 GiB slack
        for _ in range(3):
            await monitor.tick()
            await settle()
        return monitor, source, device

    monitor, source, device = run(scenario())
    assert monitor.latest.kernels["k2"] == {device: 6 * GiB}
    assert monitor.latest.in_tree.get("k2", {}) == {}
    assert source.acted == []  # nothing carried out on the kernel
    assert [(a.action, a.attributed) for a in monitor.watchdog.history] == [("warn", "environment")]


def test_the_kernels_own_tree_over_its_cap_still_gets_the_strong_action(fake_nvml):
    async def scenario():
        monitor, ledger, source = monitor_with_table("kill", Table("k1", (ME,) * 4), kernels=("k1",))
        device = ledger.get("k1").devices[0]
        fake_nvml.set_usage(os.getpid(), f"static-{device}", 5 * GiB + 1)  # its own process: over by itself
        fake_nvml.set_usage(900, f"static-{device}", GiB)
        await monitor.tick()
        await settle()
        return monitor, source, device

    monitor, source, device = run(scenario())
    assert source.acted == [("k1", "kill")]
    record = monitor.watchdog.history[0]
    assert (record.attributed, record.used) == ("tree", 5 * GiB + 1)  # the tree's figure: what it is acted on for


def test_another_users_process_counts_for_no_kernel(fake_nvml):
    monitor, ledger, source = monitor_with_table("kill", Table("k2", (ME + 1,) * 4))
    device = ledger.get("k2").devices[0]
    fake_nvml.set_usage(900, f"static-{device}", 6 * GiB)
    run(monitor.tick())
    assert monitor.latest.kernels == {} and list(monitor.watchdog.history) == []


# --- the kernels' lifecycle ---------------------------------------------------------------------


def test_a_dead_kernel_with_no_restarter_gives_its_grant_back_in_one_round(fake_nvml):
    monitor, ledger, source = make_monitor(kernels=("k1",))
    run(monitor.tick())
    assert ledger.get("k1") is not None
    source.dead = {"k1"}  # what KernelManagerView.dead_ids says once the process is gone (autorestart off)
    run(monitor.tick())
    assert ledger.get("k1") is None


def test_the_restarters_dead_event_gives_the_grant_back_at_once(fake_nvml):
    monitor, ledger, source = make_monitor(kernels=("k1",))
    run(monitor.tick())
    assert set(source.dead_callbacks) == {"k1"}  # listened to from the first round that sees the kernel
    source.dead_callbacks["k1"]()
    assert ledger.get("k1") is None


# --- a sample that does not come back -------------------------------------------------------------


def test_a_hung_call_makes_the_monitor_stalled_and_usage_unknown_until_it_returns(fake_nvml):
    async def scenario():
        monitor, ledger, source = make_monitor(kernels=("k1",))
        monitor.stall_after = 0.3  # the server's is max(3 polls, 3 s); short here to keep the test quick
        device = ledger.get("k1").devices[0]
        fake_nvml.set_usage(os.getpid(), f"static-{device}", 3 * GiB)
        monitor.start()
        try:
            await until(lambda: monitor.ticks >= 1)
            assert monitor.describe()["state"] == "ok"
            release = fake_nvml.hang()
            await until(lambda: monitor.describe()["state"] == "stalled")
            described = monitor.describe()
            assert described["message"].startswith("no GPU sample since ") and "NVML" in described["message"]
            assert monitor.kernel_device_usage("k1", device)["used"] is None and monitor.device_used(device) is None
            # The lifecycle goes on without samples: a kernel that died gives its grant back.
            ticks = monitor.ticks
            source.dead = {"k1"}
            await until(lambda: ledger.get("k1") is None)
            assert monitor.ticks == ticks
            release.set()
            await until(lambda: monitor.describe()["state"] == "ok")
            return monitor
        finally:
            await monitor.stop()

    run(scenario())


async def until(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_the_sampler_thread_is_a_daemon_that_stop_does_not_wait_for(fake_nvml):
    async def scenario():
        monitor, _, _ = make_monitor()
        monitor.start()
        await until(lambda: monitor.ticks >= 1)
        release = fake_nvml.hang()
        await until(lambda: fake_nvml.calls > 0 and monitor._sampling is not None)
        thread = monitor._sampler._thread
        await asyncio.wait_for(monitor.stop(), timeout=5)  # returns although a call hangs
        return thread, release

    thread, release = run(scenario())
    assert thread.daemon and thread.is_alive()  # still inside the hung call: nobody joined it
    release.set()
    thread.join(timeout=10)
    assert not thread.is_alive()  # it ran the close job and ended once the call returned


# --- /metrics families, built from plain facts (gpu_quota_ext.metrics) --------------------------------


def _series(families):
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }


def test_metric_families_show_unknown_usage_as_absent_not_zero():
    from gpu_quota_ext.metrics import monitor_families

    series = _series(
        monitor_families(
            {0: (16, 5), 1: (16, None)}, {"k": {0: 3, 1: 2}}, {"k": {0: 4, 1: 4}},
            nvml_ok=False, stalled=False, sample_age=0.3, actions={"warn": 2, "kill": 1},
        )
    )
    assert series[("gpu_quota_kernel_used_bytes", (("device", "0"), ("kernel_id", "k")))] == 3
    assert ("gpu_quota_kernel_used_bytes", (("device", "1"), ("kernel_id", "k"))) not in series  # unreadable
    assert ("gpu_quota_device_used_bytes", (("device", "1"),)) not in series
    assert series[("gpu_quota_device_granted_bytes", (("device", "1"),))] == 4
    assert series[("gpu_quota_nvml_up", ())] == 0
    assert series[("gpu_quota_watchdog_actions_total", (("action", "kill"),))] == 1


def test_metric_families_while_stalled_have_caps_but_no_usage():
    from gpu_quota_ext.metrics import monitor_families

    series = _series(monitor_families({0: (16, 5)}, {"k": {0: 3}}, {"k": {0: 4}}, True, True, 9.0, {}))
    assert not [key for key in series if key[0].endswith("used_bytes")]
    assert series[("gpu_quota_kernel_cap_bytes", (("device", "0"), ("kernel_id", "k")))] == 4
    assert series[("gpu_quota_monitor_stalled", ())] == 1 and series[("gpu_quota_nvml_up", ())] == 0
    assert series[("gpu_quota_monitor_sample_age_seconds", ())] == 9.0
