"""The watchdog: what to do about a kernel whose measured usage stays over its cap, decided and carried out.

The decision (`decide`, `worst_device`) is pure. `Watchdog` keeps the per-kernel state between samples
and the record of every action, reviews each sample the monitor takes, and carries its actions out
through the kernel manager (interrupt, restart, kill: one at a time per kernel); how each went is kept
with its record, so the status API can show what was done and whether it worked.

A kernel is "over" on a device when NVML's `used` for its processes exceeds its cap plus the slack
(the slack covers the CUDA context, about 600 MiB per process, that no in-process cap counts). It is acted
on once it has been over for `grace` seconds. A device the kernel holds no grant on counts as cap 0.

Only usage proven to be the kernel's, its own process tree's, can cost the kernel its state: usage
counted through a process's environment alone (attribution.py: any process can name any kernel there)
gets a warning at most, whatever `enforce` says.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Container, Deque, Dict, List, Mapping, Optional, Set, Tuple

from ..shared.sizes import format_bytes
from .attribution import ENVIRONMENT, TREE
from .kernels import KernelActions
from .sampling import Sample
from .watchdog_settings import WatchdogSettings

log = logging.getLogger("gpu_quota_ext")

HISTORY = 200  # actions the status API can show; older ones are in the server log


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
        return asdict(self)

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
    """Per-kernel watch state, the action record, and the carrying out. Used from the event loop only.

    `kernels.act(kernel_id, action)` carries out "interrupt", "restart" and "kill" (KernelManagerView)."""

    def __init__(self, settings: WatchdogSettings, kernels: Optional[KernelActions] = None):
        self.settings = settings
        self.kernels = kernels
        self._acting: Set[str] = set()
        self._tasks: Set[asyncio.Task] = set()
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
                self._watches.get(kernel_id, OverLimitEpisode()),
                over is not None,
                now,
                self.settings,
                proven is not None,
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

    def act_on(self, sample: Sample, caps: Mapping[str, Mapping[int, int]]) -> None:
        """Review a sample the monitor took and carry out what it calls for. `caps`: the ledger's caps
        now (a late sample must not act on a kernel released meanwhile)."""
        if sample.state not in ("ok", "degraded"):
            return  # nothing measured: nothing to act on
        for record in self.review(sample.kernels, caps, in_tree=sample.in_tree):
            self._carry_out(record)

    def _carry_out(self, record: WatchdogAction) -> None:
        if record.action == "warn":
            log.warning("gpu-quota-ext: %s", record.describe())
            self.finished(record, "done")
            return
        if record.kernel_id in self._acting:
            self.finished(record, "skipped: the previous action on this kernel is still running")
            return
        log.warning("gpu-quota-ext: %s", record.describe())
        self._acting.add(record.kernel_id)
        task = asyncio.get_running_loop().create_task(self._act(record))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def acted(self) -> None:
        """Wait until every action under way has been carried out (the server's stop, tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _act(self, record: WatchdogAction) -> None:
        try:
            await self.kernels.act(record.kernel_id, record.action)
        except Exception as error:  # broad: a kernel manager's shutdown or restart may raise anything; recorded
            log.error("gpu-quota-ext: %s failed: %r", record.action, error)
            self.finished(record, f"failed: {error!r}")
        else:
            self.finished(record, "done")
        finally:
            self._acting.discard(record.kernel_id)

    def finished(self, record: WatchdogAction, outcome: str) -> WatchdogAction:
        """How an action went; the record shown by the API is updated."""
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

    def forget_all_but(self, kernel_ids: Container[str]) -> None:
        """Drop the state of every kernel not in `kernel_ids` (the ones still running)."""
        for kernel_id in [k for k in self._watches if k not in kernel_ids]:
            self.forget(kernel_id)

    def forget(self, kernel_id: str) -> None:
        """The kernel is gone: drop its state. Its actions stay in `history`."""
        self._watches.pop(kernel_id, None)
        self._last.pop(kernel_id, None)
