"""Prometheus gauges in jupyter_server's /metrics, set by the monitor, gone with the kernel."""

import re

import pytest

from gpu_quota_ext.policy import GiB

from .fake_gpu import fake_gpu_config, fake_nvml, kernel_pid, next_samples, service_of  # noqa: F401
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
    pid = await kernel_pid(jp_serverapp, kernel_id)
    grant = service_of(jp_serverapp).ledger.get(kernel_id)
    device = grant.devices[0]
    fake_nvml.set_usage(pid, f"static-{device}", 3 * GiB)
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

    await shutdown_kernel(jp_fetch, kernel_id)
    await next_samples(jp_serverapp)
    metrics = await scrape(jp_fetch)
    assert not [name for name in metrics if kernel_id in name]
    assert metrics[f'gpu_quota_device_granted_bytes{{device="{device}"}}'] == 0
