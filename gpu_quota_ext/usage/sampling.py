"""Sampling: what every kernel really holds on every GPU, measured by the driver, once per poll interval.

This is the monitor, and it only samples. NVML calls and /proc reads run in the monitor's own thread;
the event loop only gathers the kernels' PIDs before a sample and hands each sample, once it is back, to
whoever subscribed (`on_sample`: the watchdog, parking). NVML trouble never stops the server: it becomes
the monitor's `state` and `message`, logged once per problem. Where there is no GPU the monitor still
exists and says so (state "no-gpu", with the reason).

A call that hangs is trouble too: when a sample has been out for `stall_after` seconds the state is
"stalled" and usage is unknown (not the last sample's figures), while the rest of the server (the
kernels' lifecycle included, which polls on its own) goes on. The sampling thread is a daemon that
nothing waits for, so a hung call never delays the server's exit.

The monitor is the single source of truth for measured usage: NVML's `used` per kernel and per device
(what kernels report about their own allocator is kept by reports.py). Caps stay in the ledger.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import (
    Callable,
    Collection,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
)

from ..devices import Device, NvmlBackend, NvmlFailure, NvmlUnavailable
from ..threads import SerialThread
from .attribution import TREE, foreign_pids
from .kernels import KernelRoots
from .periodic import every
from .processes import PidResolver

log = logging.getLogger("gpu_quota_ext")

REOPEN_AFTER = 60.0  # seconds between attempts to start NVML when it was unavailable
STALL_POLLS = 3  # a sample out for this many poll intervals ...
STALL_MIN = 3.0  # ... and at least this many seconds means NVML is stuck: many GPUs, a busy machine or
# a slow driver make one sample take longer than a short interval without anything being wrong.


def stall_after(poll_interval: float) -> float:
    """Seconds a sample may be out before the monitor says "stalled"."""
    return max(STALL_POLLS * poll_interval, STALL_MIN)


# --- what one sample holds -------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceReading:
    index: int
    used: Optional[int]  # None: NVML could not tell this tick
    error: Optional[str] = None


@dataclass(frozen=True)
class Sample:
    # "starting", "ok", "degraded" (some devices unreadable), "no-gpu", "error"; the API adds "stalled"
    state: str
    message: Optional[str] = None
    time: Optional[float] = None  # wall clock when its reading began
    devices: Mapping[int, DeviceReading] = field(default_factory=dict)
    kernels: Mapping[str, Mapping[int, int]] = field(default_factory=dict)  # kernel -> device -> used
    # The part of `kernels` used by the kernel's own process tree (the rest was found by environment).
    in_tree: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    pids: Mapping[str, Tuple[int, ...]] = field(default_factory=dict)  # kernel -> its PIDs on any GPU
    # kernel -> those of its PIDs whose real uid is not the server's (a server that is not root cannot park them)
    foreign: Mapping[str, Tuple[int, ...]] = field(default_factory=dict)

    def used(self, kernel_id: str, index: int) -> Optional[int]:
        reading = self.devices.get(index)
        if reading is None or reading.used is None:
            return None
        return self.kernels.get(kernel_id, {}).get(index, 0)


# --- the monitor --------------------------------------------------------------------------------------


class Monitor:
    """Samples every GPU once per `poll_interval` and keeps the last sample.

    `kernels` gives the kernels' own processes (`roots()`) and ids (`kernel_ids()`); `holders` the ids of
    kernels that hold a grant, which a process may name in its environment before the server lists them."""

    def __init__(
        self,
        devices: Iterable[Device],
        backend: NvmlBackend,
        kernels: KernelRoots,
        poll_interval: float,
        no_gpu_reason: Optional[str] = None,
        resolver: Optional[PidResolver] = None,
        holders: Callable[[], Iterable[str]] = lambda: (),
    ):
        self.devices: Dict[int, Device] = {d.index: d for d in devices}
        self.backend = backend
        self.kernels = kernels
        self.poll_interval = poll_interval
        self.resolver = resolver or PidResolver()
        self.holders = holders
        self.latest = Sample(state="no-gpu", message=no_gpu_reason) if not self.devices else Sample(state="starting")
        self.ticks = 0  # samples taken (tests wait on it)
        self._wake: Optional[asyncio.Event] = None  # set: the next round starts now (made on the loop, at start)
        self.stall_after = stall_after(poll_interval)
        self._subscribers: List[Callable[[Sample], object]] = []
        self._opened = False
        self._reopen_at = 0.0
        self._problems: Dict[str, str] = {}  # what is wrong now, logged once each
        self._sampler: Optional[SerialThread] = None
        self._sampling: Optional[asyncio.Future] = None  # the sample out in the thread, if any
        self._sampling_began = 0.0  # monotonic
        self._sampled_at = time.monotonic()  # when the last sample came back (or the monitor started)
        self._started_wall = time.time()
        self._stall_noted = False
        self._stopped = False
        self._task: Optional[asyncio.Task] = None

    def on_sample(self, callback: Callable[[Sample], object]) -> None:
        """Call `callback(sample)` on the event loop after each sample, in the order subscribed. A callback
        that raises is logged and does not keep the others from their turn."""
        self._subscribers.append(callback)

    def gpu_pids(self, kernel_id: str) -> Tuple[int, ...]:
        """The kernel's processes on any GPU in the last sample, as this server's /proc numbers them."""
        return tuple(self.latest.pids.get(kernel_id, ()))

    # --- start and stop (event loop) -------------------------------------------------------------------

    def start(self) -> None:
        """Start sampling on the running event loop. Idempotent."""
        if self._task is not None:
            return
        # A thread of our own: a hung NVML call stalls only the monitor, never the loop or its executor.
        self._sampler = SerialThread("gpu-quota-monitor")
        self._sampled_at, self._started_wall = time.monotonic(), time.time()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass  # what cancel() asked for
            except Exception as error:  # broad: the server stops all the same; the rounds logged their own failures
                log.debug("gpu-quota-ext: the GPU monitor ended with %r", error)
            self._task = None
        if self._sampling is not None:
            self._sampling.cancel()
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.finish(self._close)  # after a hung call returns, if it ever does; never waited for

    def _close(self) -> None:
        if self._opened:
            self.backend.close()
            self._opened = False

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        await every(lambda: self.poll_interval, self.tick, self._round_failed, self._wake)

    def sample_soon(self) -> None:
        """Take the next sample now rather than at the next interval (a park needs what a kernel holds now)."""
        if self._wake is not None:
            self._wake.set()

    def _round_failed(self, error: Exception) -> None:
        self._problem("tick", f"the GPU monitor failed one round: {error!r}")

    async def tick(self) -> None:
        """One round: the kernels' PIDs (loop), a sample (thread) unless the last one has not come back,
        then the subscribers on the sample (loop)."""
        roots = self.kernels.roots()
        known = set(self.kernels.kernel_ids()) | set(self.holders())
        if self._sampler is None:  # not started (tests, embedders): sample right here
            self._apply(self.sample(roots, known))
            return
        if self._sampling is not None:
            self._note_stall()
            return  # still out: one sample at a time
        future = self._sampler.submit(asyncio.get_running_loop(), self.sample, roots, known)
        self._sampling, self._sampling_began = future, time.monotonic()
        # Applied whenever it comes back, even after this round has given up waiting for it.
        future.add_done_callback(self._sampled)
        await asyncio.wait({future}, timeout=self.poll_interval)

    def _sampled(self, future: asyncio.Future) -> None:
        if future is self._sampling:
            self._sampling = None
        if future.cancelled() or self._stopped:
            return
        error = future.exception()
        if error is not None:
            self._round_failed(error)
            return
        self._apply(future.result())

    def _apply(self, sample: Sample) -> None:
        """A sample came back: it becomes the last sample, and every subscriber sees it."""
        now = time.monotonic()
        if self._stall_noted:
            self._stall_noted = False
            gap = now - self._sampled_at
            log.info("gpu-quota-ext: the GPU monitor has a sample again, %.0f s after the one before", gap)
        self.latest = sample
        self._sampled_at = now
        self.ticks += 1
        for callback in list(self._subscribers):
            try:
                callback(sample)
            except Exception as error:  # one subscriber's bug must not cost the others their sample
                log.error("gpu-quota-ext: %r failed on a GPU sample: %r", callback, error)

    # --- a sample that does not come back ---------------------------------------------------------

    def stalled_for(self, now: Optional[float] = None) -> Optional[float]:
        """Seconds the sample in progress has been out, once that is `stall_after` or more; else None."""
        if self._sampling is None:
            return None
        age = (time.monotonic() if now is None else now) - self._sampling_began
        return age if age >= self.stall_after else None

    def is_stalled(self) -> bool:
        return self.stalled_for() is not None

    def sample_age(self) -> float:
        """Seconds since the last sample came back (or the monitor started)."""
        return time.monotonic() - self._sampled_at

    def _note_stall(self) -> None:
        if self._stall_noted or self.stalled_for() is None:
            return
        self._stall_noted = True
        log.warning("gpu-quota-ext: %s", self._stall_message(self.stalled_for() or 0.0))

    def _stall_message(self, age: float) -> str:
        since = self.latest.time
        when = _utc(since) if since is not None else f"the monitor started ({_utc(self._started_wall)})"
        return (
            f"no GPU sample since {when}: an NVML call has not returned for {age:.0f} s;"
            " usage is unknown and the watchdog cannot act until it does"
        )

    # --- sampling (monitor thread) ----------------------------------------------------------------

    def sample(self, roots: Mapping[int, str], known: Collection[str]) -> Sample:
        """Read every device and attribute its processes: `roots` maps each kernel's own PID to its id,
        `known` is every kernel id a process may name in its environment."""
        if not self.devices:
            return self.latest
        now = time.monotonic()
        if not self._opened:
            instead = self._open(now)
            if instead is not None:
                return instead

        # The sample's time is when its reading began: what is decided on a sample taken after a moment (a
        # restore's reservation ends on one that shows its memory back) needs the reading itself to be later.
        began = time.time()
        readings: Dict[int, DeviceReading] = {}
        processes: Dict[int, List[Tuple[int, int]]] = {}
        for index, device in self.devices.items():
            key = f"device {index}"
            try:
                used = self.backend.device_used(device.uuid)
                processes[index] = self.backend.device_processes(device.uuid)
            except NvmlFailure as error:
                readings[index] = DeviceReading(index, None, str(error))
                self._problem(key, f"GPU {index} ({device.uuid}) unreadable: {error}")
                continue
            except Exception as error:  # a backend bug or an unforeseen pynvml error: same treatment
                readings[index] = DeviceReading(index, None, repr(error))
                self._problem(key, f"GPU {index} ({device.uuid}) unreadable: {error!r}")
                continue
            readings[index] = DeviceReading(index, int(used))
            self._solved(key)

        owners = self.resolver.resolve((pid for listed in processes.values() for pid, _ in listed), roots, known, now)
        usage: Dict[str, Dict[int, int]] = {}
        in_tree: Dict[str, Dict[int, int]] = {}
        pids: Dict[str, Set[int]] = {}
        for index, listed in processes.items():
            for pid, used in listed:
                owner = owners.get(pid)
                if owner is None:
                    continue
                (kernel_id, by), local_pid = owner
                _add(usage, kernel_id, index, used)
                if by == TREE:
                    _add(in_tree, kernel_id, index, used)
                pids.setdefault(kernel_id, set()).add(local_pid)

        foreign = self._foreign(pids)
        failed = [r for r in readings.values() if r.error]
        if not failed:
            state, message = "ok", None
        elif len(failed) == len(readings):
            state, message = "error", f"no GPU could be read: {failed[0].error}"
        else:
            state = "degraded"
            message = "; ".join(f"GPU {r.index} unreadable: {r.error}" for r in failed)
        return Sample(
            state=state,
            message=message,
            time=began,
            devices=readings,
            kernels=usage,
            in_tree=in_tree,
            pids={k: tuple(sorted(v)) for k, v in pids.items()},
            foreign=foreign,
        )

    def _open(self, now: float) -> Optional[Sample]:
        """Start NVML (at most every REOPEN_AFTER seconds while it fails); None once it is open, else the sample to
        give instead: the last one while a new attempt is not due, or one that says why NVML did not start."""
        if now < self._reopen_at:
            return self.latest
        try:
            self.backend.open()
        except NvmlUnavailable as error:
            self._reopen_at = now + REOPEN_AFTER
            message = f"no GPU usage: {error}"
            self._problem("open", message)
            return Sample(state="no-gpu", message=message, time=time.time())
        except Exception as error:  # broad: a backend bug or an unforeseen pynvml error; _problem logs it
            self._reopen_at = now + REOPEN_AFTER
            message = f"no GPU usage: NVML failed to start ({error!r})"
            self._problem("open", message)
            return Sample(state="error", message=message, time=time.time())
        self._opened = True
        self._solved("open")
        return None

    def _foreign(self, pids: Mapping[str, Set[int]]) -> Dict[str, Tuple[int, ...]]:
        """Per kernel, its GPU processes of another Unix user than the server's (none when the server is root,
        which may checkpoint anyone's process). Read here, in the monitor's thread, once per sample."""
        found: Dict[str, Tuple[int, ...]] = {}
        for kernel_id, listed in pids.items():
            others = foreign_pids(listed, self.resolver.own_uid, self.resolver.table.uids_of)
            if others:
                found[kernel_id] = others
        return found

    # --- problems, logged once ------------------------------------------------------------------

    def _problem(self, key: str, message: str) -> None:
        if self._problems.get(key) != message:
            self._problems[key] = message
            log.warning("gpu-quota-ext: %s", message)

    def _solved(self, key: str) -> None:
        if self._problems.pop(key, None) is not None:
            log.info("gpu-quota-ext: %s is readable again", "NVML" if key == "open" else key)

    def device_used_now(self, index: int) -> Optional[int]:
        """The device's used bytes read from NVML right now, not the last sample's; None when it cannot be read.
        Blocking: for a thread that must check the device just before it acts (a restore)."""
        device = self.devices.get(index)
        if device is None or not self._opened:
            return None
        try:
            return int(self.backend.device_used(device.uuid))
        except Exception as error:  # broad, as in sample(): NvmlFailure, a backend bug or an unforeseen pynvml error
            log.debug("gpu-quota-ext: GPU %s not read now: %r", index, error)
            return None

    # --- what the last sample says, unless it is too old (event loop) -----------------------------

    def device_used(self, index: int) -> Optional[int]:
        if self.is_stalled():
            return None  # unknown: the last sample is too old to show as now
        reading = self.latest.devices.get(index)
        return None if reading is None else reading.used

    def kernel_used(self, kernel_id: str, index: int) -> Optional[int]:
        return None if self.is_stalled() else self.latest.used(kernel_id, index)

    def describe(self) -> dict:
        latest = self.latest
        state, message = latest.state, latest.message
        stalled = self.stalled_for()
        if stalled is not None:
            state, message = "stalled", self._stall_message(stalled)
        return {
            "state": state,
            "message": message,
            "sampled_at": latest.time,
            "poll_interval": self.poll_interval,
            "stalled_after": self.stall_after,
        }


def _add(table: Dict[str, Dict[int, int]], kernel_id: str, index: int, nbytes: int) -> None:
    per_device = table.setdefault(kernel_id, {})
    per_device[index] = per_device.get(index, 0) + nbytes


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
