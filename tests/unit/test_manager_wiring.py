"""The manager's composition root: what each sample feeds, in which order, and what the ledger says about a host
service behind it (which broker parking asks, whether a lease reads the park states)."""

import asyncio
import os

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.ledger import LeaseHooks
from gpu_quota_ext.ledger.local import LocalLedger
from gpu_quota_ext.ledger.remote import RemoteLedger
from gpu_quota_ext.manager import GpuQuotaManager
from gpu_quota_ext.parking import HostBroker, Parker
from gpu_quota_ext.policy import build_policy, resolve
from gpu_quota_ext.shared.sizes import GiB
from gpu_quota_ext.usage.watchdog_settings import build_watchdog_settings

from .fakes import UsageKernels

DEVICES = [Device(0, "Fake 0", "static-0", 16 * GiB, 0)]
POLICY = build_policy("0.25", "1.0")


@pytest.fixture
def fake_nvml():
    FakeNvml.reset()
    yield FakeNvml
    FakeNvml.reset()


def manager_over(ledger, cls=GpuQuotaManager):
    kernels = UsageKernels({os.getpid(): "k1"})  # one kernel, this process, idle
    return cls(POLICY, DEVICES, ledger, kernels, FakeNvml(), build_watchdog_settings("warn", "1GiB", 0, 0.1))


def test_each_sample_goes_to_parking_then_the_history_then_the_review(fake_nvml, monkeypatch):
    # The order is the contract: a history point carries this sample's park state, and the watchdog acts last.
    fed = []
    monkeypatch.setattr(Parker, "on_sample", lambda parker, sample: fed.append(("parking", sample)))

    class Recording(GpuQuotaManager):
        def _record_history(self, sample):
            fed.append(("history", sample))
            super()._record_history(sample)

        def _review(self, sample):
            fed.append(("review", sample))
            super()._review(sample)

    ledger = LocalLedger(DEVICES, POLICY)
    ledger.grant("k1", "me", "python3", resolve(POLICY, "me", "python3"))
    manager = manager_over(ledger, Recording)
    asyncio.new_event_loop().run_until_complete(manager.monitor.tick())
    sample = manager.monitor.latest
    assert fed == [("parking", sample), ("history", sample), ("review", sample)]


def test_the_sample_consumers_are_the_monitors_subscribers_in_their_order(fake_nvml):
    manager = manager_over(LocalLedger(DEVICES, POLICY))
    assert manager.sample_consumers == (manager.parker.on_sample, manager._record_history, manager._review)
    assert manager.monitor._subscribers == list(manager.sample_consumers)


def test_a_servers_own_ledger_has_no_host_service_so_parking_decides_here_and_reports_to_no_one(fake_nvml):
    ledger = LocalLedger(DEVICES, POLICY)
    assert ledger.host_service() is None
    manager = manager_over(ledger)
    assert not isinstance(manager.parker.broker, HostBroker) and manager.parker.reports_to_host is False


def test_a_remote_ledger_names_its_host_service_which_brokers_and_takes_the_lease_hooks(fake_nvml):
    ledger = RemoteLedger(DEVICES, "http://127.0.0.1:9/services/gpu-quota/", "token")
    try:
        assert ledger.host_service() is ledger
        manager = manager_over(ledger)
        assert isinstance(manager.parker.broker, HostBroker) and manager.parker.broker.rooms is ledger
        assert manager.parker.reports_to_host is True
        hooks = ledger.lease._hooks
        assert hooks.processes is not LeaseHooks().processes and hooks.park_report == manager.parker.host_report
        assert hooks.on_park_requests == manager.park_for_host
    finally:
        ledger.close()
