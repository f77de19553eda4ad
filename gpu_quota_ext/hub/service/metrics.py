"""The service's Prometheus gauges, per user and per kernel, built at scrape time (like the server's
status/collector.py): a custom collector reads the book and the last host sample; nothing is ever set, so a
released grant has no series at the next scrape. Its own registry: the service's process serves nothing
else."""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric


class HostCollector:
    def __init__(self, status: Callable[[], dict]):
        self.status = status  # the admin's status (status.build_status), built per scrape

    def collect(self) -> Iterable[Metric]:
        status = self.status()
        device_budget = GaugeMetricFamily(
            "gpu_quota_host_device_budget_bytes", "What the ledger may grant on the device", labels=["device"]
        )
        device_granted = GaugeMetricFamily(
            "gpu_quota_host_device_granted_bytes", "Sum of the caps granted on the device", labels=["device"]
        )
        device_used = GaugeMetricFamily(
            "gpu_quota_host_device_used_bytes", "GPU memory in use on the device (NVML)", labels=["device"]
        )
        for d in status["devices"]:
            if d["budget"] is not None:
                device_budget.add_metric([d["uuid"]], d["budget"])
            device_granted.add_metric([d["uuid"]], d["granted"])
            if d["used"] is not None:
                device_used.add_metric([d["uuid"]], d["used"])
        user_granted = GaugeMetricFamily("gpu_quota_host_user_granted_bytes", "Sum of the user's caps", labels=["user"])
        user_used = GaugeMetricFamily(
            "gpu_quota_host_user_used_bytes", "GPU memory the user's kernels use (NVML)", labels=["user"]
        )
        user_unmanaged = GaugeMetricFamily(
            "gpu_quota_host_user_unmanaged_bytes",
            "GPU memory the user's processes hold outside every grant",
            labels=["user"],
        )
        for u in status["users"]:
            user_granted.add_metric([u["name"]], u["granted"])
            user_used.add_metric([u["name"]], u["used"])
            user_unmanaged.add_metric([u["name"]], u["unmanaged"])
        kernel_cap = GaugeMetricFamily(
            "gpu_quota_host_kernel_cap_bytes", "The kernel's cap on the device", labels=["user", "kernel_id", "device"]
        )
        kernel_used = GaugeMetricFamily(
            "gpu_quota_host_kernel_used_bytes",
            "GPU memory the kernel uses on the device (NVML)",
            labels=["user", "kernel_id", "device"],
        )
        for k in status["kernels"]:
            for d in k["devices"]:
                labels = [k["user"], k["kernel_id"], d["uuid"]]
                kernel_cap.add_metric(labels, d["cap"])
                if d["used"] is not None:
                    kernel_used.add_metric(labels, d["used"])
        stalled = GaugeMetricFamily("gpu_quota_host_watchdog_stalled", "1 while a host sample has been out too long")
        stalled.add_metric([], 1 if status["state"] == "stalled" else 0)
        return [
            device_budget,
            device_granted,
            device_used,
            user_granted,
            user_used,
            user_unmanaged,
            kernel_cap,
            kernel_used,
            stalled,
        ]


def registry_for(status: Callable[[], dict]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HostCollector(status))
    return registry
