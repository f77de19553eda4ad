"""WatchdogSettings: what to do about a kernel whose measured usage stays over its cap.

The decision (`decide`) is pure; the settings are validated next to the policy
(`policy.watchdog_settings`). `Watchdog` keeps the per-kernel state between samples and the record of
every action; the monitor carries the actions out through the kernel manager and reports back here, so
the status API can show what was done and whether it worked.

A kernel is "over" on a device when NVML's `used` for its processes exceeds its cap plus the slack
(the slack covers the CUDA context, about 600 MiB per process, that no in-process cap counts). It is acted
on once it has been over for `grace` seconds. A device the kernel holds no grant on counts as cap 0.

Only usage proven to be the kernel's, its own process tree's, can cost the kernel its state: usage
counted through a process's environment alone (processes.py: any process can name any kernel there)
gets a warning at most, whatever `enforce` says.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Deque, Dict, List, Mapping, Optional, Tuple

from .settings import DEFAULTS
from .shared.sizes import CapSpec, format_bytes, parse_cap
from .processes import ENVIRONMENT, TREE

HISTORY = 200  # actions the status API can show; older ones are in the server log


@dataclass(frozen=True)
class WatchdogSettings:
    """The admin's enforcement settings, validated (policy.watchdog_settings builds them)."""

    enforce: str = DEFAULTS["enforce"]
    slack: CapSpec = parse_cap(DEFAULTS["slack"])
    grace: float = float(DEFAULTS["grace"])  # seconds over the limit before acting
    poll_interval: float = float(DEFAULTS["poll_interval"])

    @property
    def cooldown(self) -> float:
        """After a strong action, how long before the next one: a restart takes a moment to free memory,
        and NVML may still list the old process on the next tick."""
        return max(self.grace, 5 * self.poll_interval, 2.0)

    def limit(self, cap: int) -> int:
        """The most a kernel with this cap may use before it is over."""
        if self.slack.fraction is not None:
            return cap + int(self.slack.fraction * cap)
        return cap + (self.slack.nbytes or 0)

    def describe(self) -> dict:
        return {
            "enforce": self.enforce,
            "slack": str(self.slack),
            "grace": self.grace,
            "poll_interval": self.poll_interval,
        }


# --- the decision --------------------------------------------------------------------------------


@dataclass(frozen=True)
class OverLimitEpisode:
    """What the watchdog remembers about one kernel between samples."""

    over_since: Optional[float] = None  # monotonic time the current over-limit episode began
    quiet_until: float = 0.0  # no action before this (just after one)
    warned: bool = False  # "warn" says it once per episode


def decide(
    watch: OverLimitEpisode, over: bool, now: float, settings: WatchdogSettings, proven: bool = True
) -> Tuple[OverLimitEpisode, Optional[str]]:
    """(new state, action or None) for one kernel given whether it is over its limit now.

    An episode starts at the first sample over the limit and ends at the first one within it. "warn"
    fires once per episode. Stronger actions fire after `grace`, then wait `cooldown` before firing
    again while the kernel stays over (an interrupt may not free what the kernel holds).
    `proven`: the kernel's own process tree is over the limit by itself; when only usage found through
    environments puts it over, "warn" is the most that happens."""
    if settings.enforce == "off" or not over:
        return OverLimitEpisode(quiet_until=watch.quiet_until), None
    over_since = watch.over_since if watch.over_since is not None else now
    held = replace(watch, over_since=over_since)
    if now - over_since < settings.grace or now < watch.quiet_until:
        return held, None
    if settings.enforce == "warn" or not proven:
        if watch.warned:
            return held, None
        return replace(held, warned=True), "warn"
    return OverLimitEpisode(over_since=None, quiet_until=now + settings.cooldown), settings.enforce


def worst_device(
    used: Mapping[int, int], caps: Mapping[int, int], settings: WatchdogSettings
) -> Optional[Tuple[int, int, int, int]]:
    """(device, used, cap, limit) of the device where the kernel is furthest over its limit, or None."""
    worst = None
    for index, nbytes in used.items():
        cap = caps.get(index, 0)
        limit = settings.limit(cap)
        if nbytes > limit and (worst is None or nbytes - limit > worst[1] - worst[3]):
            worst = (index, nbytes, cap, limit)
    return worst


# --- state and record ----------------------------------------------------------------------------


@dataclass(frozen=True)
class WatchdogAction:
    """One thing the watchdog did (or tried): shown by the status API, logged, counted in /metrics."""

    kernel_id: str
    action: str
    device: int
    used: int
    cap: int
    limit: int
    time: float  # wall clock, seconds since the epoch
    outcome: str = "pending"  # "pending", "done", "failed: ..."
    attributed: str = TREE  # how the usage over the limit was found: TREE, or ENVIRONMENT (warn only)

    def to_json(self) -> dict:
        return {
            "kernel_id": self.kernel_id,
            "action": self.action,
            "device": self.device,
            "used": self.used,
            "cap": self.cap,
            "limit": self.limit,
            "time": self.time,
            "outcome": self.outcome,
            "attributed": self.attributed,
        }

    def describe(self) -> str:
        text = (
            f"kernel {self.kernel_id} used {format_bytes(self.used)} on device {self.device}, over its cap of "
            f"{format_bytes(self.cap)} (limit with slack {format_bytes(self.limit)}): {self.action}"
        )
        if self.attributed == ENVIRONMENT:
            text += (
                " (counting processes outside its process tree whose environment names it: the watchdog"
                " warns about those, never interrupts, restarts or kills)"
            )
        return text


class Watchdog:
    """Per-kernel watch state and the action record. Used from the event loop only."""

    def __init__(self, settings: WatchdogSettings):
        self.settings = settings
        self._watches: Dict[str, OverLimitEpisode] = {}
        self._last: Dict[str, WatchdogAction] = {}
        self.history: Deque[WatchdogAction] = deque(maxlen=HISTORY)
        self.counts: Dict[str, int] = {}  # action -> how many were taken since the server started (/metrics)

    def review(
        self,
        usage: Mapping[str, Mapping[int, int]],
        caps: Mapping[str, Mapping[int, int]],
        now: Optional[float] = None,
        wall: Optional[float] = None,
        in_tree: Optional[Mapping[str, Mapping[int, int]]] = None,
    ) -> List[WatchdogAction]:
        """Actions to take for this sample. `usage`: kernel -> device -> used, every process attributed to
        the kernel; `in_tree`: the same for its process tree alone (None: all of `usage` is); `caps`: the
        ledger's caps of every kernel it holds a grant for (kernels without a grant are not ours to police)."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        actions = []
        for kernel_id, kernel_caps in caps.items():
            over = worst_device(usage.get(kernel_id, {}), kernel_caps, self.settings)
            proven = over if in_tree is None else worst_device(in_tree.get(kernel_id, {}), kernel_caps, self.settings)
            watch, action = decide(
                self._watches.get(kernel_id, OverLimitEpisode()), over is not None, now, self.settings, proven is not None
            )
            self._watches[kernel_id] = watch
            if action is not None and over is not None:
                device, used, cap, limit = proven or over
                record = WatchdogAction(
                    kernel_id, action, device, used, cap, limit, wall, attributed=TREE if proven else ENVIRONMENT
                )
                self._remember(record)
                actions.append(record)
        return actions

    def finished(self, record: WatchdogAction, outcome: str) -> WatchdogAction:
        """The monitor reports how an action went; the record shown by the API is updated."""
        done = replace(record, outcome=outcome)
        if self._last.get(record.kernel_id) is record:
            self._last[record.kernel_id] = done
        for position, item in enumerate(self.history):
            if item is record:
                self.history[position] = done
        return done

    def _remember(self, record: WatchdogAction) -> None:
        self.counts[record.action] = self.counts.get(record.action, 0) + 1
        self._last[record.kernel_id] = record
        self.history.append(record)

    def last_action(self, kernel_id: str) -> Optional[WatchdogAction]:
        return self._last.get(kernel_id)

    def forget_all_but(self, kernel_ids) -> None:
        """Drop the state of every kernel not in `kernel_ids` (the ones still running)."""
        for kernel_id in [k for k in self._watches if k not in kernel_ids]:
            self.forget(kernel_id)

    def forget(self, kernel_id: str) -> None:
        """The kernel is gone: drop its state. Its actions stay in `history`."""
        self._watches.pop(kernel_id, None)
        self._last.pop(kernel_id, None)
