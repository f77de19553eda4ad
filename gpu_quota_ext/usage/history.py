"""Each kernel's usage over the last minutes: a bounded history, one point per monitor sample, for the charts
of the sidebar and of `%gpucap panel` (GET history, GET kernels/<id>/history: shared/contract.py).

Pure: no I/O and no clock. The manager hands it, after each sample, what it read for each kernel (the
sample's NVML figures, the kernel's last allocator report, its caps, its hard limit, its park state) and the
time. At most `points_max` points are kept per kernel, the oldest dropped first, and only for kernels still
ours (`forget_all_but`): memory is bounded by kernels × points_max however long the server runs. A history
holds measured usage next to the caps of the moment; it decides nothing and is the truth of nothing.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Collection, Deque, Dict, Iterable, List, Mapping, Optional

from ..shared.contract import HISTORY_POINT_FIELDS, PARK_STATES
from .reports import AllocatorReport

POINTS_MAX = 300  # per kernel: 5 minutes at the default 1 s poll interval

# A point as JSON: '{"t":...,"used":...,...}', its names the contract's, in its order.
_POINT_TEMPLATE = "{{" + ",".join(f'"{name}":{{}}' for name in HISTORY_POINT_FIELDS) + "}}"


def _json_value(value: Any) -> str:
    """A point's value as JSON: None, a size (int), the time (a finite float), a park state (a word)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)  # an int, or time.time(): finite, and Python's repr of it is JSON


@dataclass(frozen=True)
class HistoryPoint:
    """One kernel at one sample (contract.HISTORY_POINT_FIELDS); sizes in bytes, None where unknown."""

    t: float
    used: Optional[int]
    allocated: Optional[int]
    reserved: Optional[int]
    cap: Optional[int]
    hard_limit: Optional[int]
    park: str
    # The point as JSON, written once: a full answer (every kernel, 300 points each) is then joined, not
    # serialized again, so that it keeps the event loop for milliseconds, not for a quarter of a second.
    text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", _POINT_TEMPLATE.format(*map(_json_value, self._values())))

    def _values(self) -> tuple:
        return (self.t, self.used, self.allocated, self.reserved, self.cap, self.hard_limit, self.park)

    def to_json(self) -> Dict[str, Any]:
        return dict(zip(HISTORY_POINT_FIELDS, self._values()))


def total(values: Iterable[Optional[int]], every: bool) -> Optional[int]:
    """The sum of the known values; None when none is known, or (`every`) when any one is unknown: a sum
    that leaves out a device is not the kernel's figure."""
    known, missing = 0, False
    count = 0
    for value in values:
        if value is None:
            missing = True
        else:
            known += value
            count += 1
    if count == 0 or (every and missing):
        return None
    return known


def point_for(
    t: float,
    devices: Iterable[int],
    used: Mapping[int, Optional[int]],
    allocator: Mapping[int, AllocatorReport],
    caps: Mapping[int, int],
    hard_limits: Mapping[int, int],
    park: str,
) -> HistoryPoint:
    """The point of a kernel holding `devices`: `used` is NVML's figure per device (None: unread),
    `allocator` its last report per device, `hard_limits` the driver's limit per device (empty: none)."""
    devices = tuple(devices)
    reports = [allocator[i] for i in devices if i in allocator]
    return HistoryPoint(
        t=t,
        used=total((used.get(i) for i in devices), every=True),
        allocated=total((r.allocated for r in reports), every=False),
        reserved=total((r.reserved for r in reports), every=False),
        cap=total((caps.get(i) for i in devices), every=True),
        hard_limit=total((hard_limits.get(i) for i in devices), every=True) if hard_limits else None,
        park=park if park in PARK_STATES else "idle",
    )


class UsageHistory:
    """kernel id -> its last `points_max` points, oldest first. Used from the event loop only."""

    def __init__(self, points_max: int = POINTS_MAX) -> None:
        if points_max < 1:
            raise ValueError("a history keeps at least one point per kernel")
        self.points_max = points_max
        self._points: Dict[str, Deque[HistoryPoint]] = {}

    def add(self, kernel_id: str, point: HistoryPoint) -> None:
        """Keep `point`, dropping the kernel's oldest past `points_max`. A point no later than the kernel's
        last one is dropped: points stay in time order, so `since` can stop at the first old one."""
        points = self._points.get(kernel_id)
        if points is None:
            points = self._points[kernel_id] = deque(maxlen=self.points_max)
        elif points and point.t <= points[-1].t:
            return
        points.append(point)

    def forget_all_but(self, kernel_ids: Collection[str]) -> None:
        """Drop the history of every kernel not in `kernel_ids` (the ones still ours)."""
        for kernel_id in [k for k in self._points if k not in kernel_ids]:
            del self._points[kernel_id]

    def kernel(self, kernel_id: str, since: Optional[float] = None) -> Optional[List[HistoryPoint]]:
        """The kernel's points with t > `since` (all without it), oldest first; None for a kernel it has none for."""
        points = self._points.get(kernel_id)
        if points is None:
            return None
        if since is None:
            return list(points)
        newer: List[HistoryPoint] = []
        for point in reversed(points):  # an incremental read wants the last few: stop at the first old one
            if point.t <= since:
                break
            newer.append(point)
        newer.reverse()
        return newer

    def kernels(self, since: Optional[float] = None) -> Dict[str, List[HistoryPoint]]:
        """Every kept kernel's points with t > `since`; a kernel with none newer is listed with none."""
        return {kernel_id: self.kernel(kernel_id, since) or [] for kernel_id in self._points}

    def point_count(self) -> int:
        """Points kept in all (what bounds this history's memory)."""
        return sum(len(points) for points in self._points.values())


def _points_text(points: Iterable[HistoryPoint]) -> str:
    return "[" + ",".join(p.text for p in points) + "]"


def history_text(history: UsageHistory, interval: float, since: Optional[float]) -> str:
    """GET history as JSON text (contract.HISTORY_FIELDS, in that order)."""
    kernels = ",".join(f"{json.dumps(k)}:{_points_text(points)}" for k, points in history.kernels(since).items())
    return f'{{"interval":{json.dumps(interval)},"points_max":{history.points_max},"kernels":{{{kernels}}}}}'


def kernel_history_text(points: List[HistoryPoint], history: UsageHistory, interval: float) -> str:
    """GET kernels/<id>/history as JSON text (contract.KERNEL_HISTORY_FIELDS, in that order)."""
    return f'{{"interval":{json.dumps(interval)},"points_max":{history.points_max},"points":{_points_text(points)}}}'
