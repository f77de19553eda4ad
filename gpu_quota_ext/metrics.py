"""Prometheus gauges in jupyter_server's own /metrics (prometheus_client's default registry).

Set by the monitor after each sample, from its thread, never while answering a request. Label sets of
kernels (and devices) that went away are removed, so a scrape never shows a dead kernel's last value.
Two gauges are read at scrape time instead (`set_function`): whether the monitor is stalled and how old
its last sample is, since a sampler stuck in NVML sets nothing. While stalled, usage gauges are removed:
unknown, not an old sample's figure.
The metrics are module-level because a registry accepts each name once per process.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Mapping, Optional, Set, Tuple

try:
    from prometheus_client import Counter, Gauge
except ImportError:  # pragma: no cover - jupyter_server depends on prometheus_client
    Counter = Gauge = None

if Gauge is not None:
    DEVICE_TOTAL = Gauge("gpu_quota_device_total_bytes", "GPU memory of the device", ["device"])
    DEVICE_USED = Gauge("gpu_quota_device_used_bytes", "GPU memory in use on the whole device (NVML)", ["device"])
    DEVICE_GRANTED = Gauge("gpu_quota_device_granted_bytes", "Sum of the caps granted on the device", ["device"])
    KERNEL_USED = Gauge(
        "gpu_quota_kernel_used_bytes", "GPU memory the kernel's processes use (NVML)", ["kernel_id", "device"]
    )
    KERNEL_CAP = Gauge("gpu_quota_kernel_cap_bytes", "The kernel's cap on the device", ["kernel_id", "device"])
    NVML_UP = Gauge("gpu_quota_nvml_up", "1 when the last sample read every device, else 0 (0 while stalled too)")
    ACTIONS = Counter("gpu_quota_watchdog_actions", "Watchdog actions taken", ["action"])
    STALLED = Gauge(
        "gpu_quota_monitor_stalled", "1 while a GPU sample has been out too long (an NVML call that does not return)"
    )
    SAMPLE_AGE = Gauge("gpu_quota_monitor_sample_age_seconds", "Seconds since the monitor's last GPU sample came back")


class MetricsExporter:
    """Keeps the gauges equal to the latest sample and the ledger. One per monitor."""

    def __init__(self) -> None:
        self._kernel_labels: Set[Tuple[str, str]] = set()
        self._device_labels: Set[str] = set()
        self.enabled = Gauge is not None

    def update(
        self,
        devices: Mapping[int, Tuple[int, Optional[int], int]],
        kernel_used: Mapping[str, Mapping[int, int]],
        kernel_caps: Mapping[str, Mapping[int, int]],
        nvml_ok: bool,
    ) -> None:
        """`devices`: index -> (total, used or None, granted); per-kernel used and caps by device index."""
        if not self.enabled:
            return
        device_labels = set()
        for index, (total, used, granted) in devices.items():
            label = str(index)
            device_labels.add(label)
            DEVICE_TOTAL.labels(label).set(total)
            DEVICE_GRANTED.labels(label).set(granted)
            if used is None:
                _remove(DEVICE_USED, [(label,)])
            else:
                DEVICE_USED.labels(label).set(used)
        _remove_all((DEVICE_TOTAL, DEVICE_USED, DEVICE_GRANTED), ((l,) for l in self._device_labels - device_labels))
        self._device_labels = device_labels

        kernel_labels = set()
        for kernel_id in set(kernel_used) | set(kernel_caps):
            caps = kernel_caps.get(kernel_id, {})
            used = kernel_used.get(kernel_id, {})
            for index in set(caps) | set(used):
                label = (kernel_id, str(index))
                kernel_labels.add(label)
                if index in devices and devices[index][1] is None:
                    _remove(KERNEL_USED, [label])  # NVML could not read the device: unknown, not 0
                else:
                    KERNEL_USED.labels(*label).set(used.get(index, 0))
                if index in caps:
                    KERNEL_CAP.labels(*label).set(caps[index])
                else:
                    _remove(KERNEL_CAP, [label])
        _remove_all((KERNEL_USED, KERNEL_CAP), self._kernel_labels - kernel_labels)
        self._kernel_labels = kernel_labels
        NVML_UP.set(1 if nvml_ok else 0)

    def watch(self, stalled: Callable[[], bool], age: Callable[[], float]) -> None:
        """Read at every scrape: the running monitor's stall state and the age of its last sample."""
        if self.enabled:
            STALLED.set_function(lambda: 1.0 if stalled() else 0.0)
            SAMPLE_AGE.set_function(age)

    def unwatch(self) -> None:
        if self.enabled:
            STALLED.set_function(lambda: 0.0)
            SAMPLE_AGE.set_function(lambda: 0.0)

    def forget_usage(self) -> None:
        """The monitor is stalled: usage is unknown until the next sample sets it again."""
        if self.enabled:
            _remove_all((DEVICE_USED,), ((l,) for l in list(self._device_labels)))
            _remove_all((KERNEL_USED,), list(self._kernel_labels))
            NVML_UP.set(0)

    def count_action(self, action: str) -> None:
        if self.enabled:
            ACTIONS.labels(action).inc()

    def clear(self) -> None:
        """The server stops: remove every label set this exporter made."""
        if not self.enabled:
            return
        _remove_all((DEVICE_TOTAL, DEVICE_USED, DEVICE_GRANTED), ((l,) for l in self._device_labels))
        _remove_all((KERNEL_USED, KERNEL_CAP), self._kernel_labels)
        self._device_labels, self._kernel_labels = set(), set()


def _remove(gauge, labels: Iterable[Tuple[str, ...]]) -> None:
    for label in labels:
        try:
            gauge.remove(*label)
        except KeyError:
            pass


def _remove_all(gauges, labels: Iterable[Tuple[str, ...]]) -> None:
    labels = list(labels)
    for gauge in gauges:
        _remove(gauge, labels)
