"""Allocator usage read from inside the kernel: what %gpucap, the panel, the per-cell report and the
server's sidebar show. Stdlib only; torch is only looked at when the kernel itself imported it.

Readings come from torch.cuda.memory_stats(), and only when CUDA is already initialized: before that
there is nothing to read, and anything that started CUDA would cost the kernel a context (docs/measurements.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from .torch_cap import cuda_torch


@dataclass(frozen=True)
class DeviceUsage:
    ordinal: int
    allocated: int  # bytes in live tensors
    reserved: int  # bytes the caching allocator holds: what the torch cap is compared with
    peak: int  # the most reserved at once since torch's last reset_peak_memory_stats
    peak_allocated: int
    total: Optional[int] = None  # torch's view of the device's memory


def read_usage(ordinals: Optional[List[int]] = None) -> Dict[int, DeviceUsage]:
    """Usage per torch ordinal; {} while torch is not imported or CUDA not initialized."""
    torch = cuda_torch()
    if torch is None:
        return {}
    try:
        count = torch.cuda.device_count()
        wanted = range(count) if ordinals is None else [o for o in ordinals if 0 <= o < count]
        return {o: _read_one(torch, o) for o in wanted}
    except Exception:  # a reading must never break a cell or the panel
        return {}


def _read_one(torch, ordinal: int) -> DeviceUsage:
    stats = torch.cuda.memory_stats(ordinal)
    try:
        total = int(torch.cuda.get_device_properties(ordinal).total_memory)
    except Exception:  # broad: torch's own code; the total is optional
        total = None
    return DeviceUsage(
        ordinal=ordinal,
        allocated=int(stats.get("allocated_bytes.all.current", 0)),
        reserved=int(stats.get("reserved_bytes.all.current", 0)),
        peak=int(stats.get("reserved_bytes.all.peak", 0)),
        peak_allocated=int(stats.get("allocated_bytes.all.peak", 0)),
        total=total,
    )


def reset_peaks(ordinals: List[int]) -> None:
    """Start a new peak window (the per-cell report). Only while CUDA runs; never starts it."""
    torch = cuda_torch()
    if torch is None:
        return
    for ordinal in ordinals:
        try:
            torch.cuda.reset_peak_memory_stats(ordinal)
        except Exception:  # broad: torch's own code; the next cell's peak then covers more
            pass


def usage_report(state, readings: Dict[int, DeviceUsage]) -> List[dict]:
    """The body's `devices` for POST .../usage: server device indexes, not torch ordinals."""
    report = []
    for device in state.devices:
        reading = readings.get(device.ordinal)
        if reading is not None:
            report.append(
                {
                    "index": device.index,
                    "allocated": reading.allocated,
                    "reserved": reading.reserved,
                    "peak": reading.peak,
                }
            )
    return report


def report_to_server(state, client) -> None:
    """Send the current readings to the server (fire-and-forget); nothing when CUDA is not in use."""
    if client is None or not state.devices:
        return
    readings = read_usage([d.ordinal for d in state.devices])
    if readings:
        client.report_usage(usage_report(state, readings))
