"""The monitor: what every kernel really holds on every GPU, measured by the driver, once per poll interval.

Sampling (NVML calls and /proc reads) runs in the monitor's own thread; the event loop only gathers the
kernels' PIDs before a sample and hands the watchdog's actions to the kernel manager after it. NVML
trouble never stops the server: it becomes the monitor's `state` and `message`, logged once per problem.

The monitor is the single source of truth for usage: NVML's `used` per kernel and per device, and the
`allocated` / `reserved` / `peak` figures kernels report about their own allocator. Caps stay in the ledger.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from .devices import Device
from .metrics import MetricsExporter
from .nvml import NvmlBackend, NvmlFailure, NvmlUnavailable
from .processes import ProcTable, kernel_for_pid
from .watchdog import Action, Enforcement, Watchdog

log = logging.getLogger("gpu_quota_ext")

REOPEN_AFTER = 60.0  # seconds between attempts to start NVML when it was unavailable
RECHECK_AFTER = 5.0  # seconds a PID's kernel (or "none") is trusted before it is looked up again
ALIASES_AFTER = 30.0  # seconds between full /proc scans for NSpid aliases


# --- what one sample holds -------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceReading:
    index: int
    used: Optional[int]  # None: NVML could not tell this tick
    error: Optional[str] = None


@dataclass(frozen=True)
class Sample:
    state: str  # "starting", "ok", "degraded" (some devices unreadable), "no-gpu", "error"
    message: Optional[str] = None
    time: Optional[float] = None  # wall clock of the sample
    devices: Mapping[int, DeviceReading] = field(default_factory=dict)
    kernels: Mapping[str, Mapping[int, int]] = field(default_factory=dict)  # kernel -> device -> used
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

    def __init__(self, table: Optional[ProcTable] = None):
        self.table = table or ProcTable()
        self._cache: Dict[int, Tuple[Optional[str], Optional[int], float]] = {}  # pid -> (kernel, local pid, until)
        self._aliases: Dict[int, int] = {}
        self._aliases_until = 0.0

    def resolve(
        self, pids: Iterable[int], roots: Mapping[int, str], known: Collection[str], now: float
    ) -> Dict[int, Tuple[str, int]]:
        """{NVML pid: (kernel id, pid as our /proc numbers it)} for the PIDs that belong to a kernel."""
        found: Dict[int, Tuple[str, int]] = {}
        cache: Dict[int, Tuple[Optional[str], Optional[int], float]] = {}
        for pid in set(pids):
            hit = self._cache.get(pid)
            if hit is None or hit[2] <= now or (hit[0] is not None and hit[0] not in known):
                kernel, local = self._lookup(pid, roots, known, now)
                # Staggered by PID so 200 kernels' entries do not all expire on the same tick.
                hit = (kernel, local, now + RECHECK_AFTER * (1 + (pid % 16) / 16))
            cache[pid] = hit
            if hit[0] is not None and hit[1] is not None:
                found[pid] = (hit[0], hit[1])
        self._cache = cache  # PIDs no longer on any GPU drop out here
        return found

    def _lookup(self, pid: int, roots, known, now) -> Tuple[Optional[str], Optional[int]]:
        table = self.table
        kernel = kernel_for_pid(pid, roots, table.parent_of, table.kernel_in_environ, known)
        if kernel is not None:
            return kernel, pid
        # Not ours under this number: maybe NVML numbered it in another PID namespace (containers).
        if now >= self._aliases_until:
            self._aliases = table.namespace_aliases()
            self._aliases_until = now + ALIASES_AFTER
        local = self._aliases.get(pid)
        if local is not None:
            kernel = kernel_for_pid(local, roots, table.parent_of, table.kernel_in_environ, known)
            if kernel is not None:
                return kernel, local
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


class ServerKernels:
    """The server's kernel manager, as the monitor needs it: PIDs in, actions out."""

    def __init__(self, multi_kernel_manager: Any):
        self.manager = multi_kernel_manager

    def kernel_ids(self) -> List[str]:
        return list(self.manager.list_kernel_ids())

    def starting_ids(self) -> Set[str]:
        # A kernel being started is not listed yet; jupyter_client keeps it in this table meanwhile.
        return set(getattr(self.manager, "_pending_kernels", {}) or {})

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


# --- the monitor --------------------------------------------------------------------------------------


class Monitor:
    def __init__(
        self,
        devices: Iterable[Device],
        ledger: Any,
        backend: NvmlBackend,
        kernels: Any,
        settings: Enforcement,
        no_gpu_reason: Optional[str] = None,
        metrics: Optional[MetricsExporter] = None,
        resolver: Optional[PidResolver] = None,
        release: Optional[Callable[[str], Any]] = None,
    ):
        self.devices: Dict[int, Device] = {d.index: d for d in devices}
        self.ledger = ledger
        self.backend = backend
        self.kernels = kernels
        self.settings = settings
        self.watchdog = Watchdog(settings)
        self.metrics = metrics if metrics is not None else MetricsExporter()
        self.resolver = resolver or PidResolver()
        self.release = release or ledger.release
        self.latest = Sample(state="no-gpu", message=no_gpu_reason) if not self.devices else Sample(state="starting")
        self.reports: Dict[str, Dict[int, AllocatorReport]] = {}
        self.ticks = 0
        self._no_gpu_reason = no_gpu_reason
        self._opened = False
        self._reopen_at = 0.0
        self._problems: Dict[str, str] = {}  # what is wrong now, logged once each
        self._acting: Set[str] = set()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._task: Optional[asyncio.Task] = None
        self._actions: Set[asyncio.Task] = set()

    # --- lifecycle (event loop) -------------------------------------------------------------------

    def start(self) -> None:
        """Start sampling on the running event loop. Idempotent."""
        if self._task is not None:
            return
        # One thread of our own: a hung NVML call stalls only the monitor, never the loop or its executor.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-quota-monitor")
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.submit(self._close)
            executor.shutdown(wait=False)

    def _close(self) -> None:
        if self._opened:
            self.backend.close()
            self._opened = False
        self.metrics.clear()

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
        """One round: gather PIDs (loop), sample (thread), then act (loop)."""
        roots = self.kernels.roots()
        self._release_vanished()
        grants = {g.kernel_id: g for g in self.ledger.grants()}
        known = set(self.kernels.kernel_ids()) | set(grants)
        loop = asyncio.get_running_loop()
        if self._executor is None:
            sample = self.sample(roots, known, grants)
        else:
            sample = await loop.run_in_executor(self._executor, self.sample, roots, known, grants)
        self.latest = sample
        self.ticks += 1
        self._forget_gone(known)
        if sample.state in ("ok", "degraded"):
            caps = {kid: dict(g.caps) for kid, g in grants.items()}
            for record in self.watchdog.review(sample.kernels, caps):
                self._carry_out(record)

    # --- sampling (monitor thread) ----------------------------------------------------------------

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

    def sample(self, roots: Mapping[int, str], known: Collection[str], grants: Mapping[str, Any]) -> Sample:
        sample = self._read(roots, known)
        try:
            self._export(sample, grants)
        except Exception as error:  # metrics are a view: never let them stop sampling
            self._problem("metrics", f"updating /metrics failed: {error!r}")
        return sample

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
        pids: Dict[str, Set[int]] = {}
        for index, listed in processes.items():
            for pid, used in listed:
                owner = owners.get(pid)
                if owner is None:
                    continue
                kernel_id, local_pid = owner
                per_device = usage.setdefault(kernel_id, {})
                per_device[index] = per_device.get(index, 0) + used
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
            pids={k: tuple(sorted(v)) for k, v in pids.items()},
        )

    def _export(self, sample: Sample, grants: Mapping[str, Any]) -> None:
        granted: Dict[int, int] = {index: 0 for index in self.devices}
        caps: Dict[str, Dict[int, int]] = {}
        for kernel_id, grant in grants.items():
            caps[kernel_id] = dict(grant.caps)
            for index, cap in grant.caps.items():
                granted[index] = granted.get(index, 0) + cap
        devices = {
            index: (device.total, getattr(sample.devices.get(index), "used", None), granted.get(index, 0))
            for index, device in self.devices.items()
        }
        self.metrics.update(devices, sample.kernels, caps, sample.state == "ok")

    # --- problems, logged once ------------------------------------------------------------------

    def _problem(self, key: str, message: str) -> None:
        if self._problems.get(key) != message:
            self._problems[key] = message
            log.warning("gpu-quota-ext: %s", message)

    def _solved(self, key: str) -> None:
        if self._problems.pop(key, None) is not None:
            log.info("gpu-quota-ext: %s is readable again", "NVML" if key == "open" else key)

    # --- enforcement (event loop) ----------------------------------------------------------------

    def _carry_out(self, record: Action) -> None:
        self.metrics.count_action(record.action)
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

    async def _act(self, record: Action) -> None:
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
        reading = self.latest.devices.get(index)
        return None if reading is None else reading.used

    def kernel_device_usage(self, kernel_id: str, index: int) -> dict:
        report = self.reports.get(kernel_id, {}).get(index)
        return {
            "used": self.latest.used(kernel_id, index),
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
        return {
            "state": latest.state,
            "message": latest.message,
            "sampled_at": latest.time,
            "poll_interval": self.settings.poll_interval,
        }
