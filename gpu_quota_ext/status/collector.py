"""Prometheus metrics in jupyter_server's own /metrics, built at scrape time by a custom collector.

No gauge is ever set: each scrape builds its families from what is true now (the monitor's last sample,
the ledger's grants, the hard-limit layer's record, the park states, the watchdog's own counts). A kernel whose grant is
released has no series at the next scrape, by construction; there is no label bookkeeping to get wrong.

jupyter_server serves prometheus_client's default registry, which accepts each metric name once per
process. Several servers can live in one process (tests, embedders), so one process-wide collector is
registered with the first server that publishes and unregistered with the last that withdraws; each
server adds its sources to it. Where two sources give the same series (two servers see the same
devices), the one published last speaks.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

# jupyter_server depends on prometheus_client: it is always there where this runs.
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..shared.contract import PARK_STATES

log = logging.getLogger("gpu_quota_ext")

Source = Callable[[], Iterable["Metric"]]

HELP = {
    "gpu_quota_device_total_bytes": "GPU memory of the device",
    "gpu_quota_device_used_bytes": "GPU memory in use on the whole device (NVML)",
    "gpu_quota_device_granted_bytes": "Sum of the caps granted on the device",
    "gpu_quota_kernel_used_bytes": "GPU memory the kernel's processes use (NVML)",
    "gpu_quota_kernel_cap_bytes": "The kernel's cap on the device",
    "gpu_quota_nvml_up": "1 when the last sample read every device, else 0 (0 while stalled too)",
    "gpu_quota_watchdog_actions": "Watchdog actions taken",
    "gpu_quota_monitor_stalled": "1 while a GPU sample has been out too long (an NVML call that does not return)",
    "gpu_quota_monitor_sample_age_seconds": "Seconds since the monitor's last GPU sample came back",
    "gpu_quota_kernel_park_state": "1 for the kernel's park state (busy, idle, pending, parking, parked, resuming, "
        "waiting)",
    "gpu_quota_kernel_parked_host_bytes": "Bytes of the kernel's GPU memory held in host memory while parked",
    "gpu_quota_host_memory_short": "1 while host memory is short with kernels parked (nothing parks; parked kernels "
        "come back where the device has room)",
    "gpu_quota_host_memory_short_episodes": "Times host memory ran short with kernels parked",
    "gpu_quota_host_memory_promised_bytes": "Host memory promised to parks under way and not yet on the host",
    "gpu_quota_host_memory_parked_bytes": "Parked kernels' GPU memory held in host memory",
    "gpu_quota_kernel_hard_limit_bytes": (
        "The kernel's hard limit on the device (NVIDIA MPS, CUDA context included); absent: no hard limit"
    ),
}


def monitor_families(
    devices: Mapping[int, Tuple[int, Optional[int]]],
    kernel_used: Mapping[str, Mapping[int, int]],
    kernel_caps: Mapping[str, Mapping[int, int]],
    nvml_ok: bool,
    stalled: bool,
    sample_age: float,
    actions: Mapping[str, int],
) -> List["Metric"]:
    """The monitor's families from plain facts (pure). `devices`: index -> (total, used or None: unknown);
    `kernel_used`: usage of the kernels that are still ours, by device index; `kernel_caps`: the ledger's
    grants now. While stalled, usage is unknown: no usage series rather than an old sample's figures."""
    gauge = lambda name, labels=(): GaugeMetricFamily(name, HELP[name], labels=list(labels))  # noqa: E731
    total, used, granted = (gauge(f"gpu_quota_device_{n}_bytes", ["device"]) for n in ("total", "used", "granted"))
    k_used, k_cap = (gauge(f"gpu_quota_kernel_{n}_bytes", ["kernel_id", "device"]) for n in ("used", "cap"))
    sums: Dict[int, int] = {index: 0 for index in devices}
    for kernel_id, caps in sorted(kernel_caps.items()):
        for index, cap in sorted(caps.items()):
            sums[index] = sums.get(index, 0) + cap
            k_cap.add_metric([kernel_id, str(index)], cap)
    for index, (device_total, device_used) in sorted(devices.items()):
        total.add_metric([str(index)], device_total)
        granted.add_metric([str(index)], sums.get(index, 0))
        if device_used is not None and not stalled:
            used.add_metric([str(index)], device_used)
    if not stalled:
        for kernel_id in sorted(set(kernel_used) | set(kernel_caps)):
            indexes = set(kernel_used.get(kernel_id, {})) | set(kernel_caps.get(kernel_id, {}))
            for index in sorted(indexes):
                if index in devices and devices[index][1] is None:
                    continue  # NVML could not read the device: unknown, not 0
                k_used.add_metric([kernel_id, str(index)], kernel_used.get(kernel_id, {}).get(index, 0))
    up = gauge("gpu_quota_nvml_up")
    up.add_metric([], 1 if nvml_ok and not stalled else 0)
    stall = gauge("gpu_quota_monitor_stalled")
    stall.add_metric([], 1 if stalled else 0)
    age = gauge("gpu_quota_monitor_sample_age_seconds")
    age.add_metric([], sample_age)
    counted = CounterMetricFamily("gpu_quota_watchdog_actions", HELP["gpu_quota_watchdog_actions"], labels=["action"])
    for action, count in sorted(actions.items()):
        counted.add_metric([action], count)
    return [total, used, granted, k_used, k_cap, up, counted, stall, age]


def hard_limit_family(limits: Mapping[str, Mapping[int, int]]) -> "Metric":
    """kernel -> device index -> hard limit, for the kernels that hold one now (pure)."""
    name = "gpu_quota_kernel_hard_limit_bytes"
    family = GaugeMetricFamily(name, HELP[name], labels=["kernel_id", "device"])
    for kernel_id, by_device in sorted(limits.items()):
        for index, limit in sorted(by_device.items()):
            family.add_metric([kernel_id, str(index)], limit)
    return family


def park_families(parks: Mapping[str, Mapping[str, Any]]) -> List["Metric"]:
    """kernel id -> its park object (shared.contract.PARK_FIELDS): its state, and the bytes held on the
    host while parked (pure)."""
    state = GaugeMetricFamily(
        "gpu_quota_kernel_park_state", HELP["gpu_quota_kernel_park_state"], labels=["kernel_id", "state"]
    )
    host_name = "gpu_quota_kernel_parked_host_bytes"
    host = GaugeMetricFamily(host_name, HELP[host_name], labels=["kernel_id"])
    for kernel_id, park in sorted(parks.items()):
        for name in PARK_STATES:
            state.add_metric([kernel_id, name], 1 if park["state"] == name else 0)
        if park["host_bytes"] is not None:
            host.add_metric([kernel_id], park["host_bytes"])
    return [state, host]


def host_memory_families(host: Mapping[str, Any]) -> List["Metric"]:
    """Parking's account of the host's memory (shared.contract.HOST_MEMORY_FIELDS) as gauges and a counter (pure)."""
    gauge = lambda name, value: GaugeMetricFamily(name, HELP[name], value=value)  # noqa: E731
    episodes = "gpu_quota_host_memory_short_episodes"
    return [
        gauge("gpu_quota_host_memory_short", 1 if host["short"] else 0),
        gauge("gpu_quota_host_memory_promised_bytes", host["promised"]),
        gauge("gpu_quota_host_memory_parked_bytes", host["parked"]),
        CounterMetricFamily(episodes, HELP[episodes], value=host["short_episodes"]),
    ]


class SourcesCollector:
    """The one collector of this process: the families of every published source, merged by name."""

    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry if registry is not None else REGISTRY
        self._lock = threading.Lock()
        self._sources: List[Source] = []

    def publish(self, source: Source) -> None:
        """Add a source; the first one registers the collector. Idempotent per source."""
        with self._lock:
            if source in self._sources:
                return
            self._sources.append(source)
            if len(self._sources) == 1:
                self.registry.register(self)

    def withdraw(self, source: Source) -> None:
        """Remove a source (a stopping server); the last one unregisters the collector."""
        with self._lock:
            if source not in self._sources:
                return
            self._sources.remove(source)
            if not self._sources:
                self.registry.unregister(self)

    def describe(self) -> list:
        # Names are not declared: the registry then neither checks them against other collectors'
        # nor calls collect() at registration. Ours are all "gpu_quota_*", which nothing else uses.
        return []

    def collect(self) -> List["Metric"]:
        with self._lock:
            sources = list(self._sources)
        merged: Dict[str, "Metric"] = {}
        seen: Dict[str, set] = {}
        for source in reversed(sources):  # the newest first: its series win
            try:
                families = list(source())
            except Exception as error:  # a scrape must not fail because one source did
                log.warning("gpu-quota-ext: building /metrics failed: %r", error)
                continue
            for family in families:
                kept = merged.setdefault(family.name, family)
                keys = seen.setdefault(family.name, set())
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    if key in keys:
                        continue
                    keys.add(key)
                    if kept is not family:
                        kept.samples.append(sample)
        return list(merged.values())


# One per process, like the registry it is registered on.
COLLECTOR = SourcesCollector()
