"""Each user's GPU memory over the last minutes, for the charts of the admin page: a bounded history per user,
one point per host sample.

A point is the user's row of the status (status.py) at that sample: `used`, what NVML saw of every process of
the user's (their kernels' and their unmanaged processes'), unknown while no device could be read; and `cap`,
the bytes the user's grants hold. At most `points_max` points per user, and only for users the status still
lists: memory is bounded by users x points_max however long the service runs. Written by the sampler's
thread, read by the page's handler: a lock between them. It decides nothing.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Mapping, Optional

from ...usage import HistoryPoint, UsageHistory

POINTS_MAX = 300  # per user: 25 minutes at the service's default 5 s poll interval

# What the admin page's chart calls its figures (shared/chart.py WORDS): a user's line is all their processes.
WORDS = {"used": "NVML used, all the user's processes", "allocator": "", "cap": "Granted", "hard_limit": "Hard limit"}


def user_points(status: Mapping, sampled: bool) -> Dict[str, HistoryPoint]:
    """One point per user row of an admin's status (status.build_status); `sampled`: NVML read a device in
    the sample the status was built from (else every user's usage is unknown, not 0)."""
    t = status["sampled_at"]
    points = {}
    for row in status["users"]:
        used: Optional[int] = int(row["used"]) + int(row["unmanaged"]) if sampled else None
        points[row["name"]] = HistoryPoint(t, used, None, None, int(row["granted"]), None, "idle")
    return points


class UserHistory:
    """user name -> their last `points_max` points, oldest first."""

    def __init__(self, points_max: int = POINTS_MAX) -> None:
        self._history = UsageHistory(points_max)
        self._lock = threading.Lock()

    @property
    def points_max(self) -> int:
        return self._history.points_max

    def record(self, points: Mapping[str, HistoryPoint]) -> None:
        """A sample's points; the users it has none for are forgotten."""
        with self._lock:
            for name, point in points.items():
                self._history.add(name, point)
            self._history.forget_all_but(points.keys())

    def points(self, users: List[str]) -> Dict[str, List[dict]]:
        """The kept points of each of `users` that has any, as the contract's dicts (the charts' input)."""
        with self._lock:
            kept = {name: self._history.kernel(name) for name in users}
        return {name: [p.to_json() for p in points] for name, points in kept.items() if points}
