"""The parker: parks idle kernels and resumes them, through a CheckpointDriver, for this server's kernels.

It runs the decisions of decisions.py against the world: jupyter_server's view of each kernel (execution
state, last activity), the monitor's last sample (which processes of each kernel are on a GPU, and how
many bytes they hold), the hard-limit layer (MPS clients cannot be parked), host memory. Every driver
call runs in a daemon thread of its own, never on the event loop: a call that does not return leaves
the kernel's state saying so (after `call_timeout`), and the server, its API and its exit go on.

Every CUDA process of a kernel (the kernel and its children on a GPU) is parked and resumed together:
all are locked before any is checkpointed, and none is unlocked before all are restored, so no process
of the kernel runs against a half-parked set. A parked kernel resumes by itself as soon as it turns busy
(an execute request, a widget message: the kernel's iopub status, the way jupyter_server's activity
monitor reads it), so the user's next cell just runs. A resume that finds no device memory waits and
retries with backoff; nothing is killed and the grant is kept.

The manager (manager.py) builds and owns it. Seams to the rest of the server (one each): `on_sample(sample)`
subscribed to the monitor (before the watchdog's review), `kernel_json(kernel_id)` as the status view's
"park" field, `forget(kernel_id)` from the provisioner's cleanup, `holds_gpu_state(kernel_id)` from the
provisioner's shutdown, and usage.kernel_manager.KernelManagerView for jupyter_server's view of each kernel
(`kernel_ids`, `activity`). A park waits for a sample taken after it was asked (at most `fresh_sample_wait` seconds),
so its PIDs and `host_bytes` are what the kernel's processes hold right before the checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Callable, Dict, Optional, Tuple

import psutil

from ..ledger import UnknownKernel
from ..threads import off_loop
from .checkpoint import (
    CHECKPOINTED,
    CUDA_ERROR_NOT_FOUND,
    LOCKED,
    CheckpointDriver,
    CheckpointError,
    CheckpointUnavailable,
)
from .decisions import (
    HELD,
    ParkRecord,
    ParkSettings,
    activity_state,
    describe_transition,
    due_for_park,
    failure_reason,
    host_guard,
    idle_seconds,
    is_out_of_memory,
    moved,
    not_parkable,
    park_json,
    retry_delay,
    stuck_reason,
    waiting_reason,
)
from .host_room import host_room

log = logging.getLogger("gpu_quota_ext")

def kernel_activity(kernels: Any, kernel_id: str) -> Tuple[Optional[str], Optional[float]]:
    """(execution state, wall clock of its last activity) from KernelManagerView.activity."""
    state, last = kernels.activity(kernel_id)
    return state, (last.timestamp() if last is not None else None)


def foreign_processes(pids: Tuple[int, ...], own_uid: int) -> Tuple[int, ...]:
    """The processes among `pids` that belong to another Unix user than `own_uid` (none for root, which
    may checkpoint anyone's process)."""
    if own_uid == 0:
        return ()
    foreign = []
    for pid in pids:
        try:
            if psutil.Process(pid).uids().real != own_uid:
                foreign.append(pid)
        except psutil.Error:
            continue  # gone, or unreadable: the driver answers for it
    return tuple(foreign)


# --- the driver calls, a whole kernel at a time (run in a thread) ---------------------------------------


def park_processes(driver: CheckpointDriver, pids: Tuple[int, ...], lock_timeout_ms: int) -> None:
    """Lock every process, then checkpoint every process. On a failure, what was done is undone (restored,
    unlocked) and the error raised: the kernel is left running as before."""
    locked, parked = [], []
    try:
        for pid in pids:
            driver.lock(pid, lock_timeout_ms)
            locked.append(pid)
        for pid in pids:
            driver.checkpoint(pid)
            parked.append(pid)
    except CheckpointError:
        for pid in parked:
            _quietly(driver.restore, pid)
        for pid in locked:
            _quietly(driver.unlock, pid)
        raise


def resume_processes(driver: CheckpointDriver, pids: Tuple[int, ...]) -> None:
    """Restore every process still checkpointed, then unlock them all. A restore that fails (out of device
    memory) raises with the restored ones still locked: the next attempt restores the rest. A process that
    has exited is skipped."""
    alive = []
    for pid in pids:
        try:
            state = driver.state(pid)
        except CheckpointError as error:
            if error.code == CUDA_ERROR_NOT_FOUND or not psutil.pid_exists(pid):
                continue
            raise
        if state == CHECKPOINTED:
            driver.restore(pid)
            state = LOCKED
        alive.append((pid, state))
    for pid, state in alive:
        if state == LOCKED:
            driver.unlock(pid)


def _quietly(call: Callable[[int], None], pid: int) -> None:
    try:
        call(pid)
    except CheckpointError as error:
        log.warning("gpu-quota-ext: undoing a park: %s", error)


# --- the parker -------------------------------------------------------------------------------------


class Parker:
    def __init__(
        self,
        settings: ParkSettings,
        driver: CheckpointDriver,
        kernels: Any,
        ledger: Any,
        hard_cap: Any = None,
        host: Callable[[], Tuple[Optional[int], Optional[int]]] = host_room,
        own_uid: Optional[int] = None,
        sample_soon: Callable[[], None] = lambda: None,
    ):
        self.settings = settings
        self.sample_soon = sample_soon  # the monitor's: a park asks for a fresh sample rather than wait a poll
        self.driver = driver
        self.kernels = kernels  # usage.kernel_manager.KernelManagerView
        self.ledger = ledger
        self.hard_cap = hard_cap
        self.host = host
        self.own_uid = os.geteuid() if own_uid is None else own_uid
        self.driver_problem: Optional[str] = "the checkpoint driver has not been opened yet"
        self.records: Dict[str, ParkRecord] = {}
        self.usage: Dict[str, Dict[int, int]] = {}  # the last sample's: kernel -> device -> bytes
        self.pids: Dict[str, Tuple[int, ...]] = {}  # the last sample's: kernel -> its processes on a GPU
        self.transitions = 0  # state changes logged (tests wait on it)
        self._sampled: Optional[asyncio.Event] = None  # set by each sample: a park waits for a fresh one
        self._ops: Dict[str, object] = {}  # kernel -> the token of its park or resume in progress
        self._stuck: Dict[str, str] = {}  # kernel -> a driver call that has not returned
        self._refused: Dict[str, str] = {}  # kernel -> why its last park failed (no automatic retry until busy)
        self._retries: Dict[str, asyncio.TimerHandle] = {}
        self._streams: Dict[str, Any] = {}
        self._tasks: set = set()
        self._opening: Optional[asyncio.Future] = None
        self._stopped = False

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the driver in a thread (cuInit takes a moment). Idempotent."""
        if self._opening is not None:
            return
        self._opening = off_loop(self.driver.open, name="gpu-quota-checkpoint-open")
        self._opening.add_done_callback(self._opened)

    def _opened(self, future: asyncio.Future) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            self.driver_problem = None
            log.info("gpu-quota-ext: parking: the CUDA checkpoint driver is ready (%s)", self.settings.describe())
        else:
            detail = str(error) if isinstance(error, CheckpointUnavailable) else repr(error)
            self.driver_problem = detail
            log.info("gpu-quota-ext: parking is not possible on this server: %s", detail)

    async def ready(self) -> None:
        """Wait for the driver to be opened (or found missing)."""
        if self._opening is not None:
            await asyncio.wait({self._opening})

    async def stop(self) -> None:
        self._stopped = True
        for handle in self._retries.values():
            handle.cancel()
        self._retries.clear()
        for kernel_id in list(self._streams):
            self._unwatch(kernel_id)
        for task in list(self._tasks):
            task.cancel()

    # --- what the status shows -------------------------------------------------------------------

    def kernel_json(self, kernel_id: str) -> dict:
        now = time.time()
        execution_state, last = kernel_activity(self.kernels, kernel_id)
        idle_for = idle_seconds(execution_state, last, now)
        record = self.records.get(kernel_id)
        if record is not None and (record.state in HELD or record.state == "pending"):
            stuck = self._stuck.get(kernel_id)
            reason = stuck or record.reason
            return park_json(record.state, record.since, idle_for, record.host_bytes, stuck is None, reason)
        problem = self._not_parkable(kernel_id)
        state = activity_state(execution_state)
        reason = problem or self._refused.get(kernel_id) or (record.reason if record else None)
        return park_json(state, last, idle_for, None, problem is None, reason)

    def holds_gpu_state(self, kernel_id: str) -> bool:
        """The driver holds (or is moving) this kernel's GPU state: its processes cannot run CUDA now."""
        record = self.records.get(kernel_id)
        return record is not None and record.state in HELD

    def _not_parkable(self, kernel_id: str) -> Optional[str]:
        layers = self.hard_cap.layers(kernel_id) if self.hard_cap is not None else None
        grant = self.ledger.get(kernel_id)
        pids = self.pids.get(kernel_id, ())
        return not_parkable(
            self.driver_problem,
            bool(layers is not None and layers.hard),
            bool(grant is not None and grant.devices),
            sum(self.usage.get(kernel_id, {}).values()),
            pids,
            foreign=self._foreign(pids),
            stuck=self._stuck.get(kernel_id),
        )

    def _foreign(self, pids: Tuple[int, ...]) -> Tuple[int, ...]:
        return foreign_processes(pids, self.own_uid)

    def _kernel_ids(self) -> set:
        try:
            return set(self.kernels.kernel_ids())
        except Exception:
            return set(self.records)

    # --- transitions -----------------------------------------------------------------------------

    def _set(self, kernel_id: str, record: Optional[ParkRecord], shown_state: Optional[str] = None) -> None:
        """Store a kernel's record (None: back to jupyter_server's busy/idle) and log the transition once."""
        old = self.records.get(kernel_id)
        old_state = old.state if old is not None else self._activity(kernel_id)
        if record is None:
            self.records.pop(kernel_id, None)
            new_state = shown_state or self._activity(kernel_id)
            logged = ParkRecord(state=new_state, since=time.time())
        else:
            self.records[kernel_id] = record
            new_state, logged = record.state, record
        if old_state != new_state:
            self.transitions += 1
            log.info("%s", describe_transition(kernel_id, old_state, new_state, logged))
        watched = record is not None and (record.state in HELD or record.state == "pending")
        if watched and kernel_id not in self._streams:
            self._watch(kernel_id)
        elif not watched and kernel_id in self._streams:
            self._unwatch(kernel_id)

    def _activity(self, kernel_id: str) -> str:
        return activity_state(kernel_activity(self.kernels, kernel_id)[0])

    def _note(self, kernel_id: str, reason: Optional[str]) -> None:
        """Why the last park did not happen (shown until the kernel is busy again); logged once per reason."""
        if reason is None:
            self._refused.pop(kernel_id, None)
        elif self._refused.get(kernel_id) != reason:
            self._refused[kernel_id] = reason
            log.info("gpu-quota-ext: kernel %s: %s", kernel_id, reason)

    # --- requests (REST) -------------------------------------------------------------------------

    def _known(self, kernel_id: str) -> None:
        if kernel_id not in self._kernel_ids():
            raise UnknownKernel(kernel_id)

    async def request_park(self, kernel_id: str, who: str = "user") -> Tuple[bool, dict]:
        """Park now (idle) or once the current cell has finished (busy). (accepted, the kernel's park object)."""
        self._known(kernel_id)
        await self.ready()
        record = self.records.get(kernel_id)
        if record is not None and (record.state in HELD or record.state == "pending"):
            if record.state == "parking":
                self.records[kernel_id] = moved(record, "parking", time.time(), resume_wanted=False)
            return True, self.kernel_json(kernel_id)
        self._refused.pop(kernel_id, None)
        problem = self._not_parkable(kernel_id)
        if problem is not None:
            return False, self.kernel_json(kernel_id)
        if self._activity(kernel_id) == "busy":
            self._set(
                kernel_id,
                ParkRecord(
                    state="pending",
                    since=time.time(),
                    reason=f"parks when its current cell has finished ({who} request)",
                ),
            )
            return True, self.kernel_json(kernel_id)
        accepted = self._begin_park(kernel_id)
        return accepted, self.kernel_json(kernel_id)

    async def request_resume(self, kernel_id: str, who: str = "user") -> Tuple[bool, dict]:
        """Resume now (parked, waiting), right after parking (parking); a pending park is called off."""
        self._known(kernel_id)
        record = self.records.get(kernel_id)
        if record is None:
            # Nothing to resume; where parking cannot work at all, the answer says why (409), as park's does.
            return self._not_parkable(kernel_id) is None, self.kernel_json(kernel_id)
        if record.state == "pending":
            self._set(kernel_id, None)
        elif record.state == "parking":
            self.records[kernel_id] = moved(record, "parking", time.time(), resume_wanted=True)
        elif record.state in ("parked", "waiting"):
            self._begin_resume(kernel_id)
        return True, self.kernel_json(kernel_id)

    # --- the kernel's activity -------------------------------------------------------------------

    def turned_busy(self, kernel_id: str) -> None:
        """The kernel started handling a request: a parked kernel resumes now."""
        self._refused.pop(kernel_id, None)
        record = self.records.get(kernel_id)
        if record is None:
            return
        if record.state in ("parked", "waiting"):
            self._begin_resume(kernel_id)
        elif record.state == "parking" and not record.resume_wanted:
            self.records[kernel_id] = moved(record, "parking", time.time(), resume_wanted=True)

    def turned_idle(self, kernel_id: str) -> None:
        """The kernel finished handling a request: a pending park goes ahead."""
        record = self.records.get(kernel_id)
        if record is not None and record.state == "pending":
            if not self._begin_park(kernel_id):
                self._set(kernel_id, None)

    def on_sample(self, sample: Any) -> None:
        """After each monitor sample (event loop): its usage and PIDs, then the idle timer, pending parks,
        and parked kernels that turned busy without our stream seeing it. Never raises: the monitor's
        watchdog runs after it on the same sample."""
        if self._stopped:
            return
        try:
            self._review(sample)
        except Exception as error:
            log.warning("gpu-quota-ext: parking skipped one sample: %r", error)

    def _review(self, sample: Any) -> None:
        if getattr(sample, "state", None) in ("ok", "degraded"):
            self.usage = {k: dict(v) for k, v in sample.kernels.items()}
            self.pids = dict(sample.pids)
            if self._sampled is not None:
                self._sampled.set()  # the parks waiting for a fresh reading have it
        live = self._kernel_ids()
        for kernel_id in [k for k in list(self.records) + list(self._refused) if k not in live]:
            self.forget(kernel_id)
        if self.driver_problem is not None:
            return
        now = time.time()
        for kernel_id in live:
            record = self.records.get(kernel_id)
            execution_state, last = kernel_activity(self.kernels, kernel_id)
            if record is not None:
                if (
                    record.state in ("parked", "waiting")
                    and execution_state == "busy"
                    and kernel_id not in self._retries
                ):
                    self._begin_resume(kernel_id)
                elif record.state == "pending" and execution_state != "busy":
                    self.turned_idle(kernel_id)
                continue
            if execution_state == "busy":
                self._refused.pop(kernel_id, None)
                continue
            if kernel_id in self._refused:
                continue  # it did not park last time: not again until it has been busy
            if due_for_park(self.settings, activity_state(execution_state), idle_seconds(execution_state, last, now)):
                if self._not_parkable(kernel_id) is None:
                    self._begin_park(kernel_id, automatic=True)

    def forget(self, kernel_id: str) -> None:
        """The kernel's processes are gone (shut down, restarted, dead): nothing of its parking remains."""
        record = self.records.get(kernel_id)
        if record is not None and record.state in HELD:
            log.info(
                "gpu-quota-ext: kernel %s was %s; its processes ended, and its GPU state on the host with them",
                kernel_id,
                record.state,
            )
        self.records.pop(kernel_id, None)
        self._ops.pop(kernel_id, None)
        self._stuck.pop(kernel_id, None)
        self._refused.pop(kernel_id, None)
        self.usage.pop(kernel_id, None)
        self.pids.pop(kernel_id, None)
        handle = self._retries.pop(kernel_id, None)
        if handle is not None:
            handle.cancel()
        self._unwatch(kernel_id)

    # --- park and resume -------------------------------------------------------------------------

    def _begin_park(self, kernel_id: str, automatic: bool = False) -> bool:
        problem = self._not_parkable(kernel_id)
        if problem is not None:
            self._set(kernel_id, None)
            self._note(kernel_id, f"did not park: {problem}")
            return False
        pids = self.pids.get(kernel_id, ())
        gpu_bytes = dict(self.usage.get(kernel_id, {}))
        total = sum(gpu_bytes.values())
        available, room = self.host()
        refused = host_guard(total, available, room, self.settings.host_margin)
        if refused is not None:
            self._set(kernel_id, None)
            self._note(kernel_id, refused)
            return False
        self._note(kernel_id, None)
        why = f"idle for {self.settings.idle_after:.0f} s" if automatic else None
        self._set(
            kernel_id,
            ParkRecord(
                state="parking", since=time.time(), pids=pids, gpu_bytes=gpu_bytes, host_bytes=total, reason=why
            ),
        )
        self._spawn(self._park(kernel_id, pids))
        return True

    def _begin_resume(self, kernel_id: str) -> None:
        record = self.records[kernel_id]
        handle = self._retries.pop(kernel_id, None)
        if handle is not None:
            handle.cancel()
        if kernel_id in self._ops:
            return  # a call is out for it already
        self._set(kernel_id, moved(record, "resuming", time.time(), reason=None))
        self._spawn(self._resume(kernel_id, record.pids))

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drive(
        self, kernel_id: str, token: object, call: str, fn: Callable, *args: Any
    ) -> Optional[CheckpointError]:
        """Run a driver sequence in its thread; None when it succeeded, else its CheckpointError. A call out
        longer than call_timeout marks the kernel stuck (shown in its state) and keeps waiting for it."""
        future = off_loop(fn, *args, name=f"gpu-quota-{call}")
        done, _ = await asyncio.wait({future}, timeout=self.settings.call_timeout)
        if not done:
            if self._ops.get(kernel_id) is token:
                self._stuck[kernel_id] = stuck_reason(call, self.settings.call_timeout)
                log.warning("gpu-quota-ext: kernel %s: %s", kernel_id, self._stuck[kernel_id])
            await asyncio.wait({future})
            self._stuck.pop(kernel_id, None)
        error = future.exception()
        if error is None or isinstance(error, CheckpointError):
            return error
        return CheckpointError(call, -1, -1, repr(error))

    async def _fresh_sample(self) -> None:
        """Wait for the next sample (one taken after now), at most `fresh_sample_wait` seconds."""
        wait = self.settings.fresh_sample_wait
        if wait <= 0:
            return
        if self._sampled is None or self._sampled.is_set():
            self._sampled = asyncio.Event()
        self.sample_soon()
        try:
            await asyncio.wait_for(asyncio.shield(self._sampled.wait()), wait)
        except asyncio.TimeoutError:
            log.info("gpu-quota-ext: parking: no new GPU sample within %.0f s; the last one says what moves", wait)

    async def _park(self, kernel_id: str, pids: Tuple[int, ...]) -> None:
        token = self._ops[kernel_id] = object()
        # The sample that made it parkable may predate what the kernel holds now (a tensor made just before
        # the request): its processes and bytes are read again, right before the checkpoint.
        await self._fresh_sample()
        if self._ops.get(kernel_id) is not token:
            return  # forgotten meanwhile
        pids, gpu_bytes = self.pids.get(kernel_id, pids), dict(self.usage.get(kernel_id, {}))
        refused = host_guard(sum(gpu_bytes.values()), *self.host(), self.settings.host_margin)
        if refused is not None or not pids:
            del self._ops[kernel_id]
            self._set(kernel_id, None)
            self._note(kernel_id, refused or "did not park: its processes no longer hold GPU memory")
            return
        self.records[kernel_id] = moved(
            self.records[kernel_id],
            "parking",
            time.time(),
            pids=pids,
            gpu_bytes=gpu_bytes,
            host_bytes=sum(gpu_bytes.values()),
        )
        error = await self._drive(
            kernel_id, token, "checkpoint", park_processes, self.driver, pids, self.settings.lock_timeout_ms
        )
        if self._ops.get(kernel_id) is not token:
            return  # forgotten meanwhile (restarted, shut down): its processes are gone
        del self._ops[kernel_id]
        record = self.records[kernel_id]
        if error is not None:
            self._set(kernel_id, None)
            self._note(kernel_id, failure_reason("park", error.call, error.code, str(error)))
            return
        self._set(kernel_id, moved(record, "parked", time.time(), reason=None))
        if record.resume_wanted:
            self._begin_resume(kernel_id)

    async def _resume(self, kernel_id: str, pids: Tuple[int, ...]) -> None:
        token = self._ops[kernel_id] = object()
        error = await self._drive(kernel_id, token, "restore", resume_processes, self.driver, pids)
        if self._ops.get(kernel_id) is not token:
            return
        del self._ops[kernel_id]
        record = self.records[kernel_id]
        if error is None:
            self._set(kernel_id, None)
            return
        # Its processes stay parked: try again later. Out of device memory is the expected case (others
        # took the memory meanwhile); any other failure is retried the same way and says what it was.
        attempt = record.attempt + 1
        delay = retry_delay(attempt)
        if is_out_of_memory(error.code):
            reason = waiting_reason(record.gpu_bytes, attempt, delay)
        else:
            reason = f"{failure_reason('resume', error.call, error.code, str(error))}; retry {attempt} in {delay:.0f} s"
        self._set(kernel_id, moved(record, "waiting", time.time(), reason=reason, attempt=attempt))
        self._retries[kernel_id] = asyncio.get_running_loop().call_later(delay, self._retry, kernel_id)

    def _retry(self, kernel_id: str) -> None:
        self._retries.pop(kernel_id, None)
        record = self.records.get(kernel_id)
        if record is not None and record.state == "waiting" and not self._stopped:
            self._begin_resume(kernel_id)

    # --- the kernel's iopub: busy and idle as they happen -------------------------------------------

    def _watch(self, kernel_id: str) -> None:
        """Listen to the kernel's iopub status messages while it is pending or parked, as jupyter_server's
        activity monitor does (the same tracked message types), so a cell resumes it at once."""
        try:
            kernel = self.kernels.manager.get_kernel(kernel_id)
            stream = kernel.connect_iopub()
        except Exception as error:  # no channel (a kernel going away): the per-sample check still resumes it
            log.debug("gpu-quota-ext: kernel %s: no iopub stream for parking: %r", kernel_id, error)
            return
        from jupyter_client.session import Session

        session = Session(config=kernel.session.config, key=kernel.session.key)
        track = getattr(self.kernels.manager, "track_message_type", lambda kind: True)

        def on_message(parts) -> None:
            try:
                _, fed = session.feed_identities(parts)
                message = session.deserialize(fed)
            except Exception:
                return
            if message["header"].get("msg_type") != "status":
                return
            parent = (message.get("parent_header") or {}).get("msg_type")
            if not parent or not track(parent):
                return
            state = message["content"].get("execution_state")
            if state == "busy":
                self.turned_busy(kernel_id)
            elif state == "idle":
                self.turned_idle(kernel_id)

        stream.on_recv(on_message)
        self._streams[kernel_id] = stream

    def _unwatch(self, kernel_id: str) -> None:
        stream = self._streams.pop(kernel_id, None)
        if stream is not None:
            try:
                stream.close()
            except Exception:
                pass
