"""The usage side without a server, through the manager that owns it: sampling with the fake NVML, NVML
trouble, the watchdog acting on a sample, the kernels' lifecycle, a sample that does not come back."""

import asyncio
import logging
import os
import threading

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.ledger import UnknownKernel
from gpu_quota_ext.ledger.local import LocalLedger
from gpu_quota_ext.manager import GpuQuotaManager
from gpu_quota_ext.policy import build_policy, resolve
from gpu_quota_ext.shared.contract import KERNEL_FIELDS
from gpu_quota_ext.shared.sizes import GiB, parse_cap
from gpu_quota_ext.status.view import VIEW_FIELDS
from gpu_quota_ext.usage import PidResolver
from gpu_quota_ext.usage.watchdog_settings import build_watchdog_settings

from .fakes import ProcSnapshot, UsageKernels

ME = 1000

# --- sampling with the fake NVML -------------------------------------------------------------------

DEVICES = [Device(0, "Fake 0", "static-0", 16 * GiB, 0), Device(1, "Fake 1", "static-1", 16 * GiB, 1)]


@pytest.fixture
def fake_nvml():
    FakeNvml.reset()
    yield FakeNvml
    FakeNvml.reset()


def make_manager(enforce="warn", roots=None, kernels=("k1",)):
    """A manager over a ledger where `kernels` hold grants, with the fake NVML and kernels at `roots`."""
    policy = build_policy("0.25", "1.0")
    ledger = LocalLedger(DEVICES, policy)
    for kernel_id in kernels:
        ledger.grant(kernel_id, "me", "python3", resolve(policy, "me", "python3"))
    source = UsageKernels(roots if roots is not None else {os.getpid(): "k1"})
    manager = GpuQuotaManager(
        policy, DEVICES, ledger, source, FakeNvml(), build_watchdog_settings(enforce, "1GiB", 0, 0.1), user="me"
    )
    return manager, ledger, source


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_a_sample_attributes_usage_per_kernel_and_device(fake_nvml):
    manager, ledger, _ = make_manager()
    monitor = manager.monitor
    device = ledger.get("k1").devices[0]
    fake_nvml.set_usage(os.getpid(), f"static-{device}", 3 * GiB)
    fake_nvml.set_usage(1, f"static-{device}", 5 * GiB)  # init: not a kernel
    fake_nvml.other_used[f"static-{1 - device}"] = 2 * GiB
    run(monitor.tick())
    sample = monitor.latest
    assert sample.state == "ok"
    assert sample.kernels == {"k1": {device: 3 * GiB}}
    assert monitor.device_used(device) == 8 * GiB and monitor.device_used(1 - device) == 2 * GiB
    assert manager.status.kernel_device_usage("k1", device)["used"] == 3 * GiB
    assert manager.status.kernel_device_usage("k1", 1 - device)["used"] == 0
    assert sample.pids == {"k1": (os.getpid(),)}
    assert manager.gpu_pids("k1") == (os.getpid(),) and manager.gpu_pids("k2") == ()


def test_every_subscriber_sees_each_sample_even_after_one_fails(fake_nvml):
    manager, _, _ = make_manager()
    seen = []

    def broken(sample):
        raise RuntimeError("a subscriber's bug")

    manager.monitor.on_sample(broken)
    manager.monitor.on_sample(seen.append)
    run(manager.monitor.tick())
    run(manager.monitor.tick())
    assert [sample.state for sample in seen] == ["ok", "ok"] and seen[-1] is manager.monitor.latest


def test_over_the_limit_is_acted_on_and_recorded(fake_nvml):
    async def scenario():
        manager, ledger, source = make_manager("kill")
        device = ledger.get("k1").devices[0]
        fake_nvml.set_usage(os.getpid(), f"static-{device}", 6 * GiB)  # cap 4 GiB + 1 GiB slack
        await manager.monitor.tick()
        await manager.watchdog.acted()
        return manager, source

    manager, source = run(scenario())
    assert source.acted == [("k1", "kill")]
    last = manager.status.last_action("k1")
    assert (last["action"], last["used"], last["cap"], last["outcome"]) == ("kill", 6 * GiB, 4 * GiB, "done")


def test_nvml_unavailable_is_a_clear_state_logged_once(fake_nvml, caplog):
    fake_nvml.unavailable = "NVML could not start (NVMLError_DriverNotLoaded: Driver Not Loaded)"
    manager, _, _ = make_manager()
    monitor = manager.monitor
    with caplog.at_level(logging.WARNING, logger="gpu_quota_ext"):
        for _ in range(3):
            run(monitor.tick())
    assert monitor.latest.state == "no-gpu"
    assert "Driver Not Loaded" in monitor.latest.message
    assert manager.status.kernel_device_usage("k1", 0)["used"] is None
    assert len([r for r in caplog.records if "Driver Not Loaded" in r.getMessage()]) == 1


def test_failing_mid_run_degrades_then_recovers_logging_once_each(fake_nvml, caplog):
    monitor = make_manager()[0].monitor
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
    policy = build_policy("0.25", "1.0")
    manager = GpuQuotaManager(
        policy,
        [],
        LocalLedger([], policy),
        UsageKernels(),
        FakeNvml(),
        build_watchdog_settings("warn", "1GiB", 0, 1),
        no_gpu_reason="no GPU: none here",
    )
    monitor = manager.monitor  # exists without a GPU, and says why there is none
    run(monitor.tick())
    assert monitor.latest.state == "no-gpu" and monitor.latest.message == "no GPU: none here"
    assert fake_nvml.calls == 0
    answer = manager.status.answer({})
    assert answer["monitor"]["state"] == "no-gpu" and answer["gpu"] is False and answer["devices"] == []


def test_reports_are_kept_until_the_kernel_is_gone(fake_nvml):
    manager, ledger, source = make_manager()
    manager.reports.report("k1", [{"index": 0, "allocated": 1, "reserved": 2, "peak": 3}])
    run(manager.monitor.tick())
    assert manager.status.kernel_device_usage("k1", 0)["reserved"] == 2
    ledger.release("k1")
    source._roots = {}
    run(manager.monitor.tick())
    assert manager.status.kernel_device_usage("k1", 0)["reserved"] is None


def test_other_parts_add_fields_to_each_kernels_entry(fake_nvml):
    manager, _, _ = make_manager()
    manager.status.add_kernel_field("extra", lambda kernel_id: {"state": "running", "of": kernel_id})
    with pytest.raises(ValueError):
        manager.status.add_kernel_field("park", lambda kernel_id: None)  # one writer per field: the parker's
    with pytest.raises(ValueError):
        manager.status.add_kernel_field("devices", lambda kernel_id: None)  # nor one the view writes
    (entry,) = manager.status.answer({})["kernels"]
    assert entry["extra"] == {"state": "running", "of": "k1"} and entry["id"] == "k1"
    assert entry["park"]["state"] in ("busy", "idle") and entry["park"]["parkable"] is False  # the manager's parker
    assert set(entry) == {*VIEW_FIELDS, "park", "extra"}  # the view's own fields and the added ones
    assert set(VIEW_FIELDS) <= set(KERNEL_FIELDS)  # all in the REST contract


# --- usage found by environment, and the watchdog -------------------------------------------------


def escaped(named, uids):
    """A process table snapshot: PID 900 escaped k1's tree and names `named` in its environment, with the uids
    given (the test's own process is kernel k1's root)."""
    return ProcSnapshot(parents={900: 1}, named={900: named}, uids={900: uids})


def manager_with_table(enforce, table, kernels=("k1", "k2")):
    roots = {os.getpid(): "k1", 999_999: "k2"}  # k2's own process uses nothing here
    manager, ledger, source = make_manager(
        enforce, roots={p: k for p, k in roots.items() if k in kernels}, kernels=kernels
    )
    manager.monitor.resolver = PidResolver(table, own_uid=ME)
    return manager, ledger, source


async def settle(manager):
    """Every action the last sample started has been carried out."""
    await manager.watchdog.acted()


@pytest.mark.parametrize("enforce", ["interrupt", "restart", "kill"])
def test_usage_found_by_environment_only_gets_a_warning(fake_nvml, enforce):
    async def scenario():
        manager, ledger, source = manager_with_table(enforce, escaped("k2", (ME,) * 4))
        device = ledger.get("k2").devices[0]
        fake_nvml.set_usage(900, f"static-{device}", 6 * GiB)  # over k2's 4 GiB + 1 GiB slack
        for _ in range(3):
            await manager.monitor.tick()
            await settle(manager)
        return manager, source, device

    manager, source, device = run(scenario())
    assert manager.monitor.latest.kernels["k2"] == {device: 6 * GiB}
    assert manager.monitor.latest.in_tree.get("k2", {}) == {}
    assert source.acted == []  # nothing carried out on the kernel
    assert [(a.action, a.attributed) for a in manager.watchdog.history] == [("warn", "environment")]


def test_the_kernels_own_tree_over_its_cap_still_gets_the_strong_action(fake_nvml):
    async def scenario():
        manager, ledger, source = manager_with_table("kill", escaped("k1", (ME,) * 4), kernels=("k1",))
        device = ledger.get("k1").devices[0]
        fake_nvml.set_usage(os.getpid(), f"static-{device}", 5 * GiB + 1)  # its own process: over by itself
        fake_nvml.set_usage(900, f"static-{device}", GiB)
        await manager.monitor.tick()
        await settle(manager)
        return manager, source, device

    manager, source, device = run(scenario())
    assert source.acted == [("k1", "kill")]
    record = manager.watchdog.history[0]
    assert (record.attributed, record.used) == ("tree", 5 * GiB + 1)  # the tree's figure: what it is acted on for


def test_another_users_process_counts_for_no_kernel(fake_nvml):
    manager, ledger, source = manager_with_table("kill", escaped("k2", (ME + 1,) * 4))
    device = ledger.get("k2").devices[0]
    fake_nvml.set_usage(900, f"static-{device}", 6 * GiB)
    run(manager.monitor.tick())
    assert manager.monitor.latest.kernels == {} and list(manager.watchdog.history) == []


# --- the kernels' lifecycle ---------------------------------------------------------------------


def test_a_dead_kernel_with_no_restarter_gives_its_grant_back_in_one_round(fake_nvml):
    async def scenario():
        manager, ledger, source = make_manager(kernels=("k1",))
        await manager.lifecycle.poll()
        assert ledger.get("k1") is not None
        source.dead = {"k1"}  # what KernelManagerView.dead_ids says once the process is gone (autorestart off)
        await manager.lifecycle.poll()
        await manager.settled()  # the ledger's call runs in a thread
        assert ledger.get("k1") is None

    run(scenario())


def test_the_restarters_dead_event_gives_the_grant_back_at_once(fake_nvml):
    async def scenario():
        manager, ledger, source = make_manager(kernels=("k1",))
        token = manager.token_for("k1")
        await manager.lifecycle.poll()
        assert set(source.dead_callbacks) == {"k1"}  # listened to from the first round that sees the kernel
        source.dead_callbacks["k1"]()  # jupyter_client calls it on the loop, and nothing awaits it
        assert not manager.token_matches("k1", token)  # the bookkeeping is done at once ...
        await manager.settled()
        assert ledger.get("k1") is None  # ... the ledger's release in a thread, without another round
        source.dead_callbacks["k1"]()  # said twice: nothing more to do
        await manager.settled()
        assert ledger.get("k1") is None

    run(scenario())


class SlowLedger(LocalLedger):
    """A ledger whose writes block (a remote ledger waiting for its service), recording the threads."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.threads = []

    def release(self, kernel_id):
        self.threads.append(threading.current_thread())
        self.entered.set()
        assert self.gate.wait(10)  # on the event loop, this would hold it until it failed
        return super().release(kernel_id)

    def change(self, *args, **kwargs):
        self.threads.append(threading.current_thread())
        return super().change(*args, **kwargs)


def test_ledger_writes_run_off_the_loop_in_order_and_a_release_is_made_once(fake_nvml):
    async def scenario():
        policy = build_policy("0.25", "1.0")
        ledger = SlowLedger(DEVICES, policy)
        ledger.grant("k1", "me", "python3", resolve(policy, "me", "python3"))
        manager = GpuQuotaManager(
            policy, DEVICES, ledger, UsageKernels(), FakeNvml(), build_watchdog_settings("warn", "1GiB", 0, 0.1)
        )
        assert manager.release_soon("k1") is True  # returns at once although the ledger blocks
        assert manager.release_soon("k1") is False  # under way: the same release
        assert await asyncio.to_thread(ledger.entered.wait, 10)  # the loop runs while the ledger blocks
        assert ledger.get("k1") is not None
        ledger.gate.set()
        await manager.settled()
        assert ledger.get("k1") is None
        assert all(t is not threading.main_thread() for t in ledger.threads) and len(ledger.threads) == 1
        # A change of a released kernel runs after the release, and says so.
        with pytest.raises(UnknownKernel):
            await manager.change("k1", parse_cap("0.5"))
        # A thread per call, gone once it has answered: nothing is kept for good (an executor would).
        await until(lambda: not [t for t in threading.enumerate() if t.name == "gpu-quota-ledger"])

    run(scenario())


# --- a sample that does not come back -------------------------------------------------------------


def test_a_hung_call_makes_the_monitor_stalled_and_usage_unknown_until_it_returns(fake_nvml):
    async def scenario():
        manager, ledger, source = make_manager(kernels=("k1",))
        monitor = manager.monitor
        monitor.stall_after = 0.3  # the server's is max(3 polls, 3 s); short here to keep the test quick
        device = ledger.get("k1").devices[0]
        fake_nvml.set_usage(os.getpid(), f"static-{device}", 3 * GiB)
        manager.start()
        try:
            await until(lambda: monitor.ticks >= 1)
            assert monitor.describe()["state"] == "ok"
            release = fake_nvml.hang()
            await until(lambda: monitor.describe()["state"] == "stalled")
            described = monitor.describe()
            assert described["message"].startswith("no GPU sample since ") and "NVML" in described["message"]
            assert (
                manager.status.kernel_device_usage("k1", device)["used"] is None and monitor.device_used(device) is None
            )
            # The lifecycle goes on without samples: a kernel that died gives its grant back.
            ticks = monitor.ticks
            source.dead = {"k1"}
            await until(lambda: ledger.get("k1") is None)
            assert monitor.ticks == ticks
            release.set()
            await until(lambda: monitor.describe()["state"] == "ok")
            return monitor
        finally:
            await manager.stop()

    run(scenario())


async def until(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_the_sampler_thread_is_a_daemon_that_stop_does_not_wait_for(fake_nvml):
    async def scenario():
        monitor = make_manager()[0].monitor
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


# --- /metrics families, built from plain facts (gpu_quota_ext.status.collector) --------------------------------


def _series(families):
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }


def test_metric_families_show_unknown_usage_as_absent_not_zero():
    from gpu_quota_ext.status.collector import monitor_families

    series = _series(
        monitor_families(
            {0: (16, 5), 1: (16, None)},
            {"k": {0: 3, 1: 2}},
            {"k": {0: 4, 1: 4}},
            nvml_ok=False,
            stalled=False,
            sample_age=0.3,
            actions={"warn": 2, "kill": 1},
        )
    )
    assert series[("gpu_quota_kernel_used_bytes", (("device", "0"), ("kernel_id", "k")))] == 3
    assert ("gpu_quota_kernel_used_bytes", (("device", "1"), ("kernel_id", "k"))) not in series  # unreadable
    assert ("gpu_quota_device_used_bytes", (("device", "1"),)) not in series
    assert series[("gpu_quota_device_granted_bytes", (("device", "1"),))] == 4
    assert series[("gpu_quota_nvml_up", ())] == 0
    assert series[("gpu_quota_watchdog_actions_total", (("action", "kill"),))] == 1


def test_metric_families_while_stalled_have_caps_but_no_usage():
    from gpu_quota_ext.status.collector import monitor_families

    series = _series(monitor_families({0: (16, 5)}, {"k": {0: 3}}, {"k": {0: 4}}, True, True, 9.0, {}))
    assert not [key for key in series if key[0].endswith("used_bytes")]
    assert series[("gpu_quota_kernel_cap_bytes", (("device", "0"), ("kernel_id", "k")))] == 4
    assert series[("gpu_quota_monitor_stalled", ())] == 1 and series[("gpu_quota_nvml_up", ())] == 0
    assert series[("gpu_quota_monitor_sample_age_seconds", ())] == 9.0


def test_under_a_ledger_that_decides_elsewhere_the_status_shows_who_not_this_servers_policy(fake_nvml):
    class Elsewhere(LocalLedger):
        def decided_by(self):
            return "the host's GPU quota service at http://127.0.0.1:10101/services/gpu-quota/"

    policy = build_policy("0.25", "1.0")
    manager = GpuQuotaManager(
        policy, [], Elsewhere([], policy), UsageKernels(), FakeNvml(), build_watchdog_settings("warn", "1GiB", 0, 1)
    )
    shown = manager.status.answer({})["policy"]
    assert shown["decided_by"].startswith("the host's GPU quota service at ")
    assert "default_cap" not in shown and "max_cap" not in shown  # ignored here: the service's caps apply
    assert shown["enforce"] == "warn"  # this server's watchdog still runs
    alone = GpuQuotaManager(policy, [], LocalLedger([], policy), UsageKernels(), FakeNvml())
    assert "decided_by" not in alone.status.answer({})["policy"]
