"""What kernels say about their own allocator: `allocated`, `reserved` and `peak` per device.

A kernel posts these after each cell (POST .../usage, validated by the handler). They are usage, so
they live on the usage side, next to the monitor's NVML figures, never in the ledger (caps). A kernel's
reports are kept until the kernel is gone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Collection, Dict, Iterable, Mapping, Optional


@dataclass(frozen=True)
class AllocatorReport:
    """What a kernel said about its own allocator on one device."""

    allocated: Optional[int]
    reserved: Optional[int]
    peak: Optional[int]
    time: float


class KernelReports:
    """kernel id -> device index -> its last AllocatorReport. Used from the event loop only."""

    def __init__(self) -> None:
        self._reports: Dict[str, Dict[int, AllocatorReport]] = {}

    def report(self, kernel_id: str, entries: Iterable[Mapping[str, Any]]) -> None:
        """Store a kernel's own allocator figures (already validated by the handler)."""
        now = time.time()
        per_device = self._reports.setdefault(kernel_id, {})
        for entry in entries:
            per_device[entry["index"]] = AllocatorReport(
                entry.get("allocated"), entry.get("reserved"), entry.get("peak"), now
            )

    def get(self, kernel_id: str) -> Optional[Dict[int, AllocatorReport]]:
        return self._reports.get(kernel_id)

    def __contains__(self, kernel_id: object) -> bool:
        return kernel_id in self._reports

    def forget_all_but(self, kernel_ids: Collection[str]) -> None:
        """Drop the reports of every kernel not in `kernel_ids` (the ones still ours)."""
        for kernel_id in [k for k in self._reports if k not in kernel_ids]:
            del self._reports[kernel_id]
