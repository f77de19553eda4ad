"""Prometheus metrics in jupyter_server's /metrics, built at each scrape (gpu_quota_ext.status.collector' collector):
the monitor's last sample, the ledger's grants now, the watchdog's counts; gone with the grant."""

import re

import pytest

from gpu_quota_ext.shared.sizes import GiB
from gpu_quota_ext.status import collector as gpu_metrics

from .fake_gpu import fake_gpu_config, kernel_pid, manager_of, next_samples, uses_gpu, wait_for
from .kernels import shutdown_kernel, start_kernel


@pytest.fixture
def jp_server_config():
    return fake_gpu_config("warn")


async def scrape(jp_fetch) -> dict:
    """{'name{labels}': value} for our metrics."""
    text = (await jp_fetch("metrics")).body.decode()
    found = {}
    for line in text.splitlines():
        match = re.match(r"^(gpu_quota_\w+)(\{[^}]*\})? (\S+)$", line)
        if match:
            found[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return found


async def test_gauges_follow_the_monitor_and_drop_a_gone_kernel(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    pid, device = await uses_gpu(jp_serverapp, kernel_id, 3 * GiB)
    grant = manager_of(jp_serverapp).ledger.get(kernel_id)
    await next_samples(jp_serverapp)

    metrics = await scrape(jp_fetch)
    labels = f'{{device="{device}",kernel_id="{kernel_id}"}}'
    assert metrics["gpu_quota_kernel_used_bytes" + labels] == 3 * GiB
    assert metrics["gpu_quota_kernel_cap_bytes" + labels] == grant.caps[device]
    assert metrics[f'gpu_quota_device_used_bytes{{device="{device}"}}'] == 3 * GiB
    assert metrics[f'gpu_quota_device_granted_bytes{{device="{device}"}}'] == grant.caps[device]
    assert metrics[f'gpu_quota_device_total_bytes{{device="{device}"}}'] == 16 * GiB
    assert metrics["gpu_quota_nvml_up"] == 1

    # A scrape is not a sample: /metrics shows what the last round set, even while NVML is failing.
    fake_nvml.failing = "NVMLError_Unknown"
    await next_samples(jp_serverapp)
    metrics = await scrape(jp_fetch)
    assert metrics["gpu_quota_nvml_up"] == 0
    assert f'gpu_quota_device_used_bytes{{device="{device}"}}' not in metrics  # unknown, not a stale number
    assert "gpu_quota_kernel_used_bytes" + labels not in metrics
    assert metrics["gpu_quota_kernel_cap_bytes" + labels] == grant.caps[device]  # the ledger still knows
    fake_nvml.failing = None

    await next_samples(jp_serverapp)
    assert (await scrape(jp_fetch))["gpu_quota_kernel_used_bytes" + labels] == 3 * GiB

    # No stale series: the moment the grant is released, the next scrape has none of the kernel's series,
    # without waiting for a sample (the last one still lists the kernel's usage).
    await shutdown_kernel(jp_fetch, kernel_id)
    assert manager_of(jp_serverapp).ledger.get(kernel_id) is None
    metrics = await scrape(jp_fetch)
    assert not [name for name in metrics if kernel_id in name]
    assert metrics[f'gpu_quota_device_granted_bytes{{device="{device}"}}'] == 0


async def test_watchdog_actions_are_counted_by_the_watchdog(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    pid = await kernel_pid(jp_serverapp, kernel_id)
    grant = manager_of(jp_serverapp).ledger.get(kernel_id)
    device = grant.devices[0]
    watchdog = manager_of(jp_serverapp).watchdog
    fake_nvml.set_usage(pid, f"static-{device}", grant.caps[device] + 2 * GiB)  # over cap + 1 GiB slack
    await wait_for(lambda: watchdog.counts.get("warn", 0) >= 1)
    metrics = await scrape(jp_fetch)
    assert metrics['gpu_quota_watchdog_actions_total{action="warn"}'] == watchdog.counts["warn"]
    await shutdown_kernel(jp_fetch, kernel_id)


async def test_two_servers_in_one_process_share_one_collector(
    jp_fetch, jp_serverapp, jp_configurable_serverapp, fake_nvml
):
    """pytest-jupyter (and embedders) can run several servers in one process, all serving one registry."""
    kernel_id = await start_kernel(jp_fetch)
    first = manager_of(jp_serverapp)
    # pytest-jupyter initializes its (singleton) app again: a second extension app, manager and monitor
    # in the same process, on the same registry. Before the collector, the second one's gauges collided.
    second = manager_of(jp_configurable_serverapp(config=fake_gpu_config("warn")))
    try:
        assert second is not first and second.monitor._task is not None  # its monitor runs, and it publishes
        assert first.status.metric_families in gpu_metrics.COLLECTOR._sources
        assert second.status.metric_families in gpu_metrics.COLLECTOR._sources

        metrics = await scrape(jp_fetch)
        device = first.ledger.get(kernel_id).devices[0]
        assert f'gpu_quota_kernel_cap_bytes{{device="{device}",kernel_id="{kernel_id}"}}' in metrics
        # One series per label set, though both servers see devices "0" and "1".
        text = (await jp_fetch("metrics")).body.decode()
        assert text.count('gpu_quota_device_total_bytes{device="0"}') == 1

        # The second server stops: the first one's series stay, and the collector is still registered.
        await second.stop()
        assert second.status.metric_families not in gpu_metrics.COLLECTOR._sources
        metrics = await scrape(jp_fetch)
        assert f'gpu_quota_kernel_cap_bytes{{device="{device}",kernel_id="{kernel_id}"}}' in metrics
        await shutdown_kernel(jp_fetch, kernel_id)
    finally:  # the app's own cleanup stops only the extension app it knows last
        await second.stop()
        await first.stop()
    assert first.status.metric_families not in gpu_metrics.COLLECTOR._sources


def test_the_collector_registers_once_and_leaves_with_its_last_source():
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    collector = gpu_metrics.SourcesCollector(registry)
    def one():
        return gpu_metrics.monitor_families({0: (16, 4)}, {"k1": {0: 4}}, {"k1": {0: 8}}, True, False, 0.5, {"warn": 2})

    two = lambda: [gpu_metrics.hard_limit_family({"k2": {1: 9}})]  # noqa: E731
    collector.publish(one)
    collector.publish(two)
    collector.publish(one)  # idempotent
    text = generate_latest(registry).decode()
    assert 'gpu_quota_kernel_used_bytes{device="0",kernel_id="k1"} 4.0' in text
    assert 'gpu_quota_kernel_hard_limit_bytes{device="1",kernel_id="k2"} 9.0' in text
    assert 'gpu_quota_watchdog_actions_total{action="warn"} 2.0' in text
    collector.withdraw(one)
    assert "gpu_quota_kernel_used_bytes{" not in generate_latest(registry).decode()
    collector.withdraw(two)
    assert "gpu_quota" not in generate_latest(registry).decode()
    collector.publish(one)  # registers again after the last one left, without a duplicate error
    assert "gpu_quota_nvml_up 1.0" in generate_latest(registry).decode()
