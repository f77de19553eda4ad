"""The monitor: what every kernel really holds on every GPU, measured by the driver, once per poll interval.

Sampling (NVML calls and /proc reads) runs in the monitor's own thread; the event loop only gathers the
kernels' PIDs before a sample and hands the watchdog's actions to the kernel manager after it. NVML
trouble never stops the server: it becomes the monitor's `state` and `message`, logged once per problem.
A call that hangs is trouble too: when a sample has been out for `stall_after` seconds the state is
"stalled" and usage is unknown (not the last sample's figures), while the kernels' lifecycle goes on
every poll. The sampling thread is a daemon that nothing waits for, so a hung call never delays the
server's exit.

The monitor also follows the kernels' lifecycle for the ledger: a kernel that is gone from the server,
that its restarter gave up on, or whose process has ended with no restarter (autorestart off) gives its
grant back. With autorestart off jupyter_server keeps listing such a kernel, and so do we: the user may
still restart it, which asks the ledger for a grant again like a new kernel.

The monitor is the single source of truth for usage: NVML's `used` per kernel and per device, and the
`allocated` / `reserved` / `peak` figures kernels report about their own allocator. Caps stay in the ledger.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from .devices import Device
from .metrics import COLLECTOR, monitor_families
from .jupyter_private import pending_kernels
from .nvml import NvmlBackend, NvmlFailure, NvmlUnavailable
from .processes import TREE, Attribution, ProcTable, kernel_for_pid
from .watchdog import WatchdogAction, WatchdogSettings, Watchdog

log = logging.getLogger("gpu_quota_ext")

REOPEN_AFTER = 60.0  # seconds between attempts to start NVML when it was unavailable
RECHECK_AFTER = 5.0  # seconds a PID's kernel (or "none") is trusted before it is looked up again
ALIASES_AFTER = 30.0  # seconds between full /proc scans for NSpid aliases
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
    time: Optional[float] = None  # wall clock of the sample
    devices: Mapping[int, DeviceReading] = field(default_factory=dict)
    kernels: Mapping[str, Mapping[int, int]] = field(default_factory=dict)  # kernel -> device -> used
    # The part of `kernels` used by the kernel's own process tree (the rest was found by environment).
    in_tree: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    pids: Mapping[str, Tuple[int, ...]] = field(default_factory=dict)  # kernel -> its PIDs on any GPU

    def used(self, kernel_id: str, index: int) -> Optional[int]:
        reading = self.devices.get(index)
        if reading is None or reading.used is None:
            return None
        return self.kernels.get(kernel_id, {}).get(index, 0)


@dataclass(frozen=True)
class AllocatorReport:
    """What a kernel said about its own allocator on one device (POST .../usage)."""

    allocated: Optional[int]
    reserved: Optional[int]
    peak: Optional[int]
    time: float


# --- PIDs to kernels ---------------------------------------------------------------------------------


class PidResolver:
    """kernel_for_pid over the live process table, with a short cache: most PIDs on a GPU stay there for
    many ticks, and walking their ancestry every second for 200 kernels would be most of our cost."""

    def __init__(self, table: Optional[ProcTable] = None, own_uid: Optional[int] = None):
        self.table = table or ProcTable()
        # The server's own user: the only one whose processes may name a kernel by environment.
        self.own_uid = own_uid if own_uid is not None else (os.getuid() if hasattr(os, "getuid") else None)
        self._cache: Dict[int, Tuple[Optional[Attribution], Optional[int], float]] = {}  # pid -> (owner, local pid, until)
        self._aliases: Dict[int, int] = {}
        self._aliases_until = 0.0

    def resolve(
        self, pids: Iterable[int], roots: Mapping[int, str], known: Collection[str], now: float
    ) -> Dict[int, Tuple[Attribution, int]]:
        """{NVML pid: (whose and how, pid as our /proc numbers it)} for the PIDs that belong to a kernel."""
        found: Dict[int, Tuple[Attribution, int]] = {}
        cache: Dict[int, Tuple[Optional[Attribution], Optional[int], float]] = {}
        for pid in set(pids):
            hit = self._cache.get(pid)
            if hit is None or hit[2] <= now or (hit[0] is not None and hit[0].kernel_id not in known):
                owner, local = self._lookup(pid, roots, known, now)
                # Staggered by PID so 200 kernels' entries do not all expire on the same tick.
                hit = (owner, local, now + RECHECK_AFTER * (1 + (pid % 16) / 16))
            cache[pid] = hit
            if hit[0] is not None and hit[1] is not None:
                found[pid] = (hit[0], hit[1])
        self._cache = cache  # PIDs no longer on any GPU drop out here
        return found

    def _owner(self, pid: int, roots, known) -> Optional[Attribution]:
        table = self.table
        return kernel_for_pid(pid, roots, table.parent_of, table.kernel_in_environ, known, table.uids_of, self.own_uid)

    def _lookup(self, pid: int, roots, known, now) -> Tuple[Optional[Attribution], Optional[int]]:
        owner = self._owner(pid, roots, known)
        if owner is not None:
            return owner, pid
        # Not ours under this number: maybe NVML numbered it in another PID namespace (containers).
        if now >= self._aliases_until:
            self._aliases = self.table.namespace_aliases()
            self._aliases_until = now + ALIASES_AFTER
        local = self._aliases.get(pid)
        if local is not None:
            owner = self._owner(local, roots, known)
            if owner is not None:
                return owner, local
        return None, None


# --- the kernels of this server ----------------------------------------------------------------------


def kernel_pid(kernel_manager: Any) -> Optional[int]:
    """The kernel's own process id, from its provisioner (jupyter_client >= 7) or its Popen."""
    provisioner = getattr(kernel_manager, "provisioner", None)
    pid = getattr(provisioner, "pid", None)
    if pid is None:
        process = getattr(provisioner, "process", None) or getattr(kernel_manager, "kernel", None)
        pid = getattr(process, "pid", None)
    return pid if isinstance(pid, int) else None


class KernelManagerView:
    """The server's kernel manager, as the monitor needs it: PIDs in, actions out."""

    def __init__(self, multi_kernel_manager: Any):
        self.manager = multi_kernel_manager

    def kernel_ids(self) -> List[str]:
        return list(self.manager.list_kernel_ids())

    def starting_ids(self) -> Set[str]:
        # A kernel being started is not listed yet; jupyter_client keeps it in this table meanwhile.
        return set(pending_kernels(self.manager) or {})

    def roots(self) -> Dict[int, str]:
        roots = {}
        for kernel_id in self.kernel_ids():
            try:
                pid = kernel_pid(self.manager.get_kernel(kernel_id))
            except KeyError:
                continue  # shut down between the two calls
            if pid is not None:
                roots[pid] = kernel_id
        return roots

    def on_dead(self, kernel_id: str, callback: Callable[[], Any]) -> None:
        """Call `callback` when the kernel's restarter gives up on it (jupyter_client's "dead" event).
        A kernel without a restarter (autorestart off) never fires it: see dead_ids."""
        try:
            self.manager.add_restart_callback(kernel_id, callback, "dead")
        except KeyError:
            pass  # shut down meanwhile

    async def dead_ids(self) -> List[str]:
        """Kernels whose process has ended and that nothing will start again: no restarter (autorestart
        off), and no start, restart or shutdown in progress (those leave `ready` pending or set
        `shutting_down` while the process is briefly gone)."""
        dead = []
        for kernel_id in self.kernel_ids():
            try:
                manager = self.manager.get_kernel(kernel_id)
            except KeyError:
                continue
            if getattr(manager, "autorestart", True) or getattr(manager, "shutting_down", False):
                continue
            ready = getattr(manager, "ready", None)
            if ready is not None and not ready.done():
                continue
            try:
                alive = await _maybe_await(manager.is_alive())
            except Exception:
                continue  # cannot tell: not a reason to take a grant away
            if not alive:
                dead.append(kernel_id)
        return dead

    async def act(self, kernel_id: str, action: str) -> None:
        manager = self.manager
        # `now=True`: a kernel over its cap may be stuck inside a CUDA call and never answer a polite request.
        if action == "interrupt":
            await _maybe_await(manager.interrupt_kernel(kernel_id))
        elif action == "restart":
            await _maybe_await(manager.restart_kernel(kernel_id, now=True))
        elif action == "kill":
            await _maybe_await(manager.shutdown_kernel(kernel_id, now=True))
        else:  # pragma: no cover - build_enforcement allows no other value
            raise ValueError(action)


async def _maybe_await(value):
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value


# --- the sampling thread --------------------------------------------------------------------------------


class SamplerThread:
    """One daemon thread that runs the monitor's samples in order; results come back as asyncio futures.

    Not a ThreadPoolExecutor: concurrent.futures joins its worker threads at interpreter exit, even after
    shutdown(wait=False), so a driver call that hangs would hold the server's exit for as long as it
    hangs. A daemon thread that nothing joins does not."""

    def __init__(self, name: str):
        self._jobs: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> asyncio.Future:
        future = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def finish(self, last: Callable[[], Any]) -> None:
        """Run `last` after the job in progress (if it ever returns), then end. Nothing waits for it."""
        self._jobs.put((None, None, last, ()))
        self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, future, fn, args = job
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the loop, which decides what it means
                result, error = None, exc
            if future is None:
                continue
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:
                pass  # the loop has closed: nobody is waiting any more


def _settle(future: asyncio.Future, result: Any, error: Optional[BaseException]) -> None:
    if future.done():  # cancelled: the monitor stopped
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


# --- the monitor --------------------------------------------------------------------------------------


class Monitor:
    def __init__(
        self,
        devices: Iterable[Device],
        ledger: Any,
        backend: NvmlBackend,
        kernels: Any,
        settings: WatchdogSettings,
        no_gpu_reason: Optional[str] = None,
        resolver: Optional[PidResolver] = None,
        release: Optional[Callable[[str], Any]] = None,
    ):
        self.devices: Dict[int, Device] = {d.index: d for d in devices}
        self.ledger = ledger
        self.backend = backend
        self.kernels = kernels
        self.settings = settings
        self.watchdog = Watchdog(settings)
        self.resolver = resolver or PidResolver()
        self.release = release or ledger.release
        self.latest = Sample(state="no-gpu", message=no_gpu_reason) if not self.devices else Sample(state="starting")
        self.reports: Dict[str, Dict[int, AllocatorReport]] = {}
        self.ticks = 0  # samples taken (tests wait on it)
        self.stall_after = stall_after(settings.poll_interval)
        self._no_gpu_reason = no_gpu_reason
        self._opened = False
        self._reopen_at = 0.0
        self._problems: Dict[str, str] = {}  # what is wrong now, logged once each
        self._acting: Set[str] = set()
        self._sampler: Optional[SamplerThread] = None
        self._sampling: Optional[asyncio.Future] = None  # the sample out in the thread, if any
        self._sampling_began = 0.0  # monotonic
        self._sampled_at = time.monotonic()  # when the last sample came back (or the monitor started)
        self._started_wall = time.time()
        self._stall_noted = False
        self._stopped = False
        self._watched: Set[str] = set()  # kernels whose "dead" event we listen to
        self._task: Optional[asyncio.Task] = None
        self._actions: Set[asyncio.Task] = set()
        self.sample_hooks: List[Callable[[Sample], None]] = []  # called on the loop after each sample (the parker's)

    # --- lifecycle (event loop) -------------------------------------------------------------------

    def start(self) -> None:
        """Start sampling on the running event loop. Idempotent."""
        if self._task is not None:
            return
        # A thread of our own: a hung NVML call stalls only the monitor, never the loop or its executor.
        self._sampler = SamplerThread("gpu-quota-monitor")
        self._sampled_at, self._started_wall = time.monotonic(), time.time()
        COLLECTOR.publish(self.families)  # /metrics reads this monitor at each scrape
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        if self._sampling is not None:
            self._sampling.cancel()
        COLLECTOR.withdraw(self.families)
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.finish(self._close)  # after a hung call returns, if it ever does; never waited for

    def _close(self) -> None:
        if self._opened:
            self.backend.close()
            self._opened = False

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the monitor must outlive anything a tick does
                self._problem("tick", f"the GPU monitor failed one round: {error!r}")
            await asyncio.sleep(max(0.0, self.settings.poll_interval - (loop.time() - began)))

    async def tick(self) -> None:
        """One round: the kernels' lifecycle and PIDs (loop), a sample (thread) unless the last one has
        not come back, then the watchdog on the sample (loop)."""
        roots = self.kernels.roots()
        await self._follow_lifecycle()
        grants = {g.kernel_id: g for g in self.ledger.grants()}
        known = set(self.kernels.kernel_ids()) | set(grants)
        if self._sampler is None:  # not started (tests, embedders): sample right here
            self._apply(self.sample(roots, known, grants))
            return
        if self._sampling is not None:
            self._note_stall()
            return  # still out: one sample at a time, and the lifecycle above keeps going meanwhile
        future = self._sampler.submit(asyncio.get_running_loop(), self.sample, roots, known, grants)
        self._sampling, self._sampling_began = future, time.monotonic()
        # Applied whenever it comes back, even after this round has given up waiting for it.
        future.add_done_callback(self._sampled)
        await asyncio.wait({future}, timeout=self.settings.poll_interval)

    def _sampled(self, future: asyncio.Future) -> None:
        if future is self._sampling:
            self._sampling = None
        if future.cancelled() or self._stopped:
            return
        error = future.exception()
        if error is not None:
            self._problem("tick", f"the GPU monitor failed one round: {error!r}")
            return
        self._apply(future.result())

    def _apply(self, sample: Sample) -> None:
        """A sample came back: it becomes what the API shows, and the watchdog reviews it."""
        now = time.monotonic()
        if self._stall_noted:
            self._stall_noted = False
            log.info("gpu-quota-ext: the GPU monitor has a sample again, %.0f s after the one before", now - self._sampled_at)
        self.latest = sample
        self._sampled_at = now
        self.ticks += 1
        # The ledger as it is now: a late sample must not act on a kernel released meanwhile.
        grants = {g.kernel_id: g for g in self.ledger.grants()}
        known = set(self.kernels.kernel_ids()) | set(grants)
        self._forget_gone(known)
        for hook in self.sample_hooks:
            hook(sample)
        if sample.state in ("ok", "degraded"):
            caps = {kid: dict(g.caps) for kid, g in grants.items()}
            for record in self.watchdog.review(sample.kernels, caps, in_tree=sample.in_tree):
                self._carry_out(record)

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

    # --- the kernels' lifecycle (event loop) ------------------------------------------------------

    async def _follow_lifecycle(self) -> None:
        self._watch_deaths()
        self._release_vanished()
        for kernel_id in await self.kernels.dead_ids():
            if self.ledger.get(kernel_id) is not None:
                log.info(
                    "gpu-quota-ext: kernel %s's process has ended and nothing restarts it (autorestart is off);"
                    " its grant is released, and a restart asks for a new one",
                    kernel_id,
                )
                self.release(kernel_id)

    def _watch_deaths(self) -> None:
        """Listen to jupyter_client's "dead" event of every kernel, once each, from the first round that sees it."""
        listed = set(self.kernels.kernel_ids())
        for kernel_id in listed - self._watched:
            self.kernels.on_dead(kernel_id, functools.partial(self._died, kernel_id))
        self._watched = listed

    def _died(self, kernel_id: str) -> None:
        # The restarter gave up; jupyter_server drops the kernel without the provisioner's cleanup.
        if self.ledger.get(kernel_id) is not None:
            log.info("gpu-quota-ext: kernel %s died for good; its grant is released", kernel_id)
            self.release(kernel_id)

    def _release_vanished(self) -> None:
        """Give back the grants of kernels the server no longer has.

        A kernel that dies for good (its restarter gives up) is removed by jupyter_server without the
        provisioner's cleanup, which is where grants are normally released: without this its budget
        would stay taken until the server restarts.
        """
        starting = getattr(self.kernels, "starting_ids", lambda: set())()
        live = set(self.kernels.kernel_ids()) | starting
        for grant in self.ledger.grants():
            if grant.kernel_id not in live:
                log.info("gpu-quota-ext: kernel %s is gone; its grant is released", grant.kernel_id)
                self.release(grant.kernel_id)

    # --- sampling (monitor thread) ----------------------------------------------------------------

    def sample(self, roots: Mapping[int, str], known: Collection[str], grants: Mapping[str, Any]) -> Sample:
        return self._read(roots, known)

    def _read(self, roots: Mapping[int, str], known: Collection[str]) -> Sample:
        if not self.devices:
            return self.latest
        now = time.monotonic()
        if not self._opened:
            if now < self._reopen_at:
                return self.latest
            try:
                self.backend.open()
            except NvmlUnavailable as error:
                self._reopen_at = now + REOPEN_AFTER
                message = f"no GPU usage: {error}"
                self._problem("open", message)
                return Sample(state="no-gpu", message=message, time=time.time())
            except Exception as error:
                self._reopen_at = now + REOPEN_AFTER
                message = f"no GPU usage: NVML failed to start ({error!r})"
                self._problem("open", message)
                return Sample(state="error", message=message, time=time.time())
            self._opened = True
            self._solved("open")

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

        owners = self.resolver.resolve(
            (pid for listed in processes.values() for pid, _ in listed), roots, known, now
        )
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
            time=time.time(),
            devices=readings,
            kernels=usage,
            in_tree=in_tree,
            pids={k: tuple(sorted(v)) for k, v in pids.items()},
        )

    def families(self) -> list:
        """/metrics at scrape time: the last sample, the ledger's grants and the watchdog's counts now.
        Usage is shown only for kernels that still hold a grant or still run: a released kernel has
        no series, whatever the last sample said."""
        sample = self.latest
        grants = {g.kernel_id: dict(g.caps) for g in self.ledger.grants()}
        try:
            live = set(self.kernels.kernel_ids())
        except Exception:  # the kernel manager's table changed under us: the grants alone then
            live = set()
        ours = live | set(grants)
        devices = {
            index: (device.total, getattr(sample.devices.get(index), "used", None))
            for index, device in self.devices.items()
        }
        return monitor_families(
            devices,
            {kernel_id: used for kernel_id, used in sample.kernels.items() if kernel_id in ours},
            grants,
            nvml_ok=sample.state == "ok",
            stalled=self.is_stalled(),
            sample_age=self.sample_age(),
            actions=self.watchdog.counts,
        )

    # --- problems, logged once ------------------------------------------------------------------

    def _problem(self, key: str, message: str) -> None:
        if self._problems.get(key) != message:
            self._problems[key] = message
            log.warning("gpu-quota-ext: %s", message)

    def _solved(self, key: str) -> None:
        if self._problems.pop(key, None) is not None:
            log.info("gpu-quota-ext: %s is readable again", "NVML" if key == "open" else key)

    # --- enforcement (event loop) ----------------------------------------------------------------

    def _carry_out(self, record: WatchdogAction) -> None:
        if record.action == "warn":
            log.warning("gpu-quota-ext: %s", record.describe())
            self.watchdog.finished(record, "done")
            return
        if record.kernel_id in self._acting:
            self.watchdog.finished(record, "skipped: the previous action on this kernel is still running")
            return
        log.warning("gpu-quota-ext: %s", record.describe())
        self._acting.add(record.kernel_id)
        task = asyncio.get_running_loop().create_task(self._act(record))
        self._actions.add(task)
        task.add_done_callback(self._actions.discard)

    async def _act(self, record: WatchdogAction) -> None:
        try:
            await self.kernels.act(record.kernel_id, record.action)
        except Exception as error:
            log.error("gpu-quota-ext: %s failed: %r", record.action, error)
            self.watchdog.finished(record, f"failed: {error!r}")
        else:
            self.watchdog.finished(record, "done")
        finally:
            self._acting.discard(record.kernel_id)

    # --- what kernels report, what the API reads (event loop) -----------------------------------

    def report(self, kernel_id: str, entries: Iterable[Mapping[str, Any]]) -> None:
        """Store a kernel's own allocator figures (already validated by the handler)."""
        now = time.time()
        per_device = self.reports.setdefault(kernel_id, {})
        for entry in entries:
            per_device[entry["index"]] = AllocatorReport(
                entry.get("allocated"), entry.get("reserved"), entry.get("peak"), now
            )

    def _forget_gone(self, known: Collection[str]) -> None:
        for kernel_id in [k for k in self.reports if k not in known]:
            del self.reports[kernel_id]
        self.watchdog.forget_all_but(known)

    def device_used(self, index: int) -> Optional[int]:
        if self.is_stalled():
            return None  # unknown: the last sample is too old to show as now
        reading = self.latest.devices.get(index)
        return None if reading is None else reading.used

    def kernel_device_usage(self, kernel_id: str, index: int) -> dict:
        report = self.reports.get(kernel_id, {}).get(index)
        return {
            "used": None if self.is_stalled() else self.latest.used(kernel_id, index),
            "allocated": report.allocated if report else None,
            "reserved": report.reserved if report else None,
            "peak": report.peak if report else None,
            "reported_at": report.time if report else None,
        }

    def last_action(self, kernel_id: str) -> Optional[dict]:
        action = self.watchdog.last_action(kernel_id)
        return action.to_json() if action else None

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
            "poll_interval": self.settings.poll_interval,
            "stalled_after": self.stall_after,
        }


def _add(table: Dict[str, Dict[int, int]], kernel_id: str, index: int, nbytes: int) -> None:
    per_device = table.setdefault(kernel_id, {})
    per_device[index] = per_device.get(index, 0) + nbytes


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

