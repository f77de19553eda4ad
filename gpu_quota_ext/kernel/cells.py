"""The opt-in per-cell report (`%gpucap --cells on`): after each cell, one line with the cell's peak and
its change in allocated memory, against the cap. Stdlib only.

The cell's peak needs a fresh peak window, so while the report is on, torch's peak counters are reset
before each cell (torch.cuda.reset_peak_memory_stats): a user who reads max_memory_allocated across
cells themselves should leave the report off.
"""

from __future__ import annotations

import sys
from typing import Dict, Optional

from ..shared.sizes import format_bytes
from .usage import DeviceUsage, read_usage, reset_peaks


def format_cell_report(before: Dict[int, int], after: Dict[int, DeviceUsage], caps: Dict[int, int]) -> str:
    """before: allocated bytes by ordinal when the cell started; after: readings when it ended."""
    if not after:
        return "gpu-quota: this cell used no GPU memory (CUDA not started)"
    parts = []
    for ordinal, reading in sorted(after.items()):
        change = reading.allocated - before.get(ordinal, 0)
        sign = "+" if change >= 0 else "-"
        cap = caps.get(ordinal)
        of_cap = f" of {format_bytes(cap)} cap ({100 * reading.peak / cap:.0f}%)" if cap else ""
        parts.append(
            f"cuda:{ordinal} peak {format_bytes(reading.peak)}{of_cap}, "
            f"allocated {sign}{format_bytes(abs(change))} (now {format_bytes(reading.allocated)})"
        )
    return "gpu-quota: " + "; ".join(parts)


class CellReporter:
    """pre_run_cell / post_run_cell hooks; does nothing unless switched on."""

    def __init__(self, state):
        self.state = state
        self.enabled = False
        self._before: Dict[int, int] = {}

    def caps(self) -> Dict[int, int]:
        return {d.ordinal: d.cap for d in self.state.devices}

    def pre_run_cell(self, info=None) -> None:
        if not self.enabled:
            return
        try:
            readings = read_usage()
            self._before = {o: u.allocated for o, u in readings.items()}
            reset_peaks(list(readings))
        except Exception:  # broad: torch's own code; a reading must never break the user's cell
            self._before = {}

    def post_run_cell(self, result=None, stream=None) -> Optional[str]:
        if not self.enabled:
            return None
        try:
            line = format_cell_report(self._before, read_usage(), self.caps())
        except Exception:  # broad: torch's own code; no report rather than a broken cell
            return None
        print(line, file=stream or sys.stderr, flush=True)  # not the user's stdout: a note beside it
        return line
