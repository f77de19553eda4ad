"""The monitor without a server: PID -> kernel mapping, NSpid, sampling with the fake NVML, NVML trouble."""

import asyncio
import logging
import os
import subprocess
import sys

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.ledger import Ledger
from gpu_quota_ext.monitor import Monitor, PidResolver
from gpu_quota_ext.names import KERNEL_ID
from gpu_quota_ext.policy import GiB, build_policy, resolve
from gpu_quota_ext.processes import (
    ProcTable,
    alias_map,
    kernel_for_pid,
    parse_environ_kernel_id,
    parse_nspid,
    parse_ppid,
)
from gpu_quota_ext.testing import FakeNvml
from gpu_quota_ext.watchdog import build_enforcement

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


PARENTS = {100: 1, 101: 100, 102: 101, 200: 1, 300: 1, 400: 1}
ENVIRON = {300: "k-escaped", 400: "k-unknown"}


def owner(pid, roots=None, known=("k1", "k2", "k-escaped")):
    return kernel_for_pid(pid, roots or {100: "k1", 200: "k2"}, PARENTS.get, ENVIRON.get, set(known))


def test_a_kernel_owns_itself_and_every_descendant():
    assert owner(100) == "k1"
    assert owner(102) == "k1"  # a grandchild: e.g. a DataLoader worker of a subprocess
    assert owner(200) == "k2"


def test_an_escaped_process_is_found_by_the_kernel_id_in_its_environment():
    assert owner(300) == "k-escaped"
    assert owner(400) is None  # names a kernel this server does not know: not ours to attribute
    assert owner(999) is None  # unknown process


def test_a_loop_in_the_parent_table_ends():
    assert kernel_for_pid(5, {}, {5: 6, 6: 5}.get, lambda pid: None, set()) is None


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
        assert isinstance(table.namespace_aliases(), dict)  # a full scan runs without error here
        resolver = PidResolver(table)
        assert resolver.resolve([child.pid], {os.getpid(): "me"}, {"me"}, now=0.0) == {child.pid: ("me", child.pid)}
        assert resolver.resolve([child.pid], {}, {"k-live"}, now=100.0) == {child.pid: ("k-live", child.pid)}
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

    def namespace_aliases(self):
        self.scans += 1
        return {17: 4242}


def test_resolver_maps_pids_of_another_namespace_through_nspid_and_scans_rarely():
    table = FakeTable()
    resolver = PidResolver(table)
    assert resolver.resolve([17], {100: "k1"}, {"k1"}, now=0.0) == {17: ("k1", 4242)}
    resolver.resolve([17, 55], {100: "k1"}, {"k1"}, now=1.0)
    resolver.resolve([56], {100: "k1"}, {"k1"}, now=2.0)
    assert table.scans == 1  # unknown PIDs do not make every tick scan all of /proc


# --- sampling with the fake NVML -------------------------------------------------------------------

DEVICES = [Device(0, "Fake 0", "static-0", 16 * GiB, 0), Device(1, "Fake 1", "static-1", 16 * GiB, 1)]


class Kernels:
    def __init__(self, roots):
        self._roots = roots
        self.acted = []

    def kernel_ids(self):
        return list(self._roots.values())

    def roots(self):
        return dict(self._roots)

    async def act(self, kernel_id, action):
        self.acted.append((kernel_id, action))


@pytest.fixture
def fake_nvml():
    FakeNvml.reset()
    yield FakeNvml
    FakeNvml.reset()


def make_monitor(enforce="warn", roots=None, kernels=("k1",)):
    policy = build_policy("0.25", "1.0")
    ledger = Ledger(DEVICES, policy)
    for kernel_id in kernels:
        ledger.grant(kernel_id, "me", "python3", resolve(policy, "me", "python3"))
    source = Kernels(roots if roots is not None else {os.getpid(): "k1"})
    monitor = Monitor(DEVICES, ledger, FakeNvml(), source, build_enforcement(enforce, "1GiB", 0, 0.1))
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
    monitor = Monitor([], Ledger([], build_policy("0.25", "1.0")), FakeNvml(), Kernels({}), build_enforcement("warn", "1GiB", 0, 1), no_gpu_reason="no GPU: none here")
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
