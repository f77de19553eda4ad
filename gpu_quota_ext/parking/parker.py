"""The parker: carries out the parking state machine (states.py) and the broker's decisions (broker.py) for this
server's kernels, through a CheckpointDriver. Orchestration only: every rule is in those pure modules.

What it reads of the world: jupyter_server's view of each kernel (busy or idle, its last activity; the kernel's
iopub status messages while the parker holds it), the monitor's last sample (which processes of each kernel are
on a GPU, what they hold, which belong to another Unix user: the monitor alone stores usage), the ledger's
grants (caps), the hard-limit layer (MPS clients cannot be parked), host memory. What it does: asks the kernel
to empty its caches (kernel_channel.py), then parks it (lock and checkpoint every CUDA process of the kernel
together); restores a kernel only when the broker has reserved room for it; parks idle kernels the broker
chose to make room.

Every driver call runs in a daemon thread (threads.off_loop), never on the event loop: a call that does not
return leaves the kernel's state saying so (after `call_timeout`), and the server, its API and its exit go on.
Processes are locked before any is checkpointed, and none is unlocked before all are restored, so no process
of a kernel runs against a half-parked set. A restore happens once per park: if the driver fails it, the
kernel is lost and told so, never retried (a failed restore leaves the process checkpointed for good).

The broker is this server's own (broker.decide) unless the server is a user server of a hub host: then the
host service decides for every user at once (host_broker.py), and may ask this server to park its idle
kernels for others (`park_for_host`).

The manager (manager.py) builds and owns it. Seams: `on_sample(sample)` subscribed to the monitor (before the
watchdog's review), `kernel_json(kernel_id)` as the status view's "park" field, `forget(kernel_id)` from the
provisioner's cleanup, `holds_gpu_state(kernel_id)` from the provisioner's shutdown, `lost_env(kernel_id)` from the
launch of a kernel restarted after its process died while held (lost.py: its user is told, once).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Dict, Hashable, List, Mapping, Optional, Protocol, Tuple, TypeVar, Union

import psutil

from ..devices import Device
from ..ledger import GrantReads, UnknownKernel
from ..shared.park_state import ParkState
from ..shared.service_contract import SWAP_WAIT
from ..shared.sizes import format_bytes
from ..threads import off_loop
from .broker import Demand as BrokerDemand
from .broker import DeviceView, HostView, KernelView, Plan, Reservation, Round, decide
from .checkpoint import (
    CHECKPOINTED,
    CUDA_ERROR_NOT_FOUND,
    LOCKED,
    CheckpointDriver,
    CheckpointError,
    CheckpointUnavailable,
)
from .decisions import (
    ParkSettings,
    activity_state,
    due_for_park,
    idle_seconds,
    not_parkable,
)
from .events import (
    BROKER,
    HOST_MEMORY,
    HOST_SERVICE,
    TIMER,
    USER,
    EventSink,
    Seen,
    loss_event,
    send,
    transition_event,
)
from .headroom import UNKNOWN, short_kernels
from .host_account import HostAccount, HostReading, host_short, host_short_words
from .host_broker import reported
from .host_room import host_room
from .kernel_channel import KernelChannel
from .lost import LostNotice, lost_notice, notice_env, notice_json, notice_request, shown
from .pages_driver import PagesDriver, threadsafe_ask
from .path import (
    CHECKPOINT,
    PAGES,
    ParkPath,
    arena_bytes,
    arenas_to_release,
    choose_path,
    fast_park_on,
    host_need,
    keep_arena,
    kernel_facts,
    resume_deferred_reason,
)
from .room_flags import RoomFlags
from .shown import Said, shown_as
from .states import (
    HELD,
    LOST,
    RUNNING,
    AskPark,
    AskResume,
    AskRoom,
    Busy,
    Checkpoint,
    Decide,
    Effect,
    Event,
    Idle,
    ParkChecked,
    ParkDone,
    ParkRecord,
    Restore,
    RestoreDeferred,
    ResumeDone,
    RoomGranted,
    RoomTold,
    RoomWait,
    Sampled,
    StartPark,
    Stuck,
    transition,
)
from .wording import describe_transition, failure_reason, lost_reason, park_json, stuck_reason

if TYPE_CHECKING:  # for the signatures only (usage/ and hard_limit/ are beside parking/, not below it)
    from ..hard_limit import KernelLayers
    from ..usage import Sample

log = logging.getLogger("gpu_quota_ext")

Outcome = TypeVar("Outcome")  # what a driver sequence returns (_drive)

# The longest a fast-path resume waits, inside the kernel, for a park under way to free the memory it needs (a swap:
# both copies at once, broker.py's docstring), never more than half of park_call_timeout (the other half is the
# copy's; the kernel cuts it there too). Long enough for the park of a whole H200 many times over (141 GB at the
# 53 GB/s measured there: under 3 s), with room for a slower link and a park that makes its arena first (1.7 s to
# pin 56 GiB); short enough that a resume whose room never comes (the park failed, another process took the bytes)
# is back to waiting, parked and whole, within a minute. Not a setting: it bounds a wait for a copy under way on
# this host, it is no policy. (Restores run one at a time (_restoring): a fast resume that waits holds up the
# restores after it as long.) On the wire (shared.service_contract.SWAP_WAIT): the host service holds a swap's
# reservation that much longer.


class RoomBroker(Protocol):
    """Who decides which resumes run and who parks: this server alone, or the host service for every user."""

    async def decide(self, round_: Round) -> Plan: ...


class OwnBroker:
    """This server's kernels are all the broker looks at (a server without a host service)."""

    makes_room_for_running = True  # it decides for a running kernel that found the device full, too

    async def decide(self, round_: Round) -> Plan:
        return decide(round_)


class ParkedKernels(Protocol):
    """What the parker needs of the server's kernels (usage.KernelManagerView has it all; its channel asks them
    for clients: kernel_channel.KernelClients)."""

    def kernel_ids(self) -> List[str]: ...

    def activity(self, kernel_id: str) -> Tuple[Optional[str], Optional[datetime.datetime]]: ...

    def watch_status(self, kernel_id: str, on_state: Callable[[str], object]) -> Optional[Callable[[], None]]: ...

    def on_restart(self, kernel_id: str, callback: Callable[[], object]) -> Optional[Callable[[], None]]: ...

    def exit_code(self, kernel_id: str) -> Optional[int]: ...


class HardLimitReads(Protocol):
    """The hard-limit layer, as far as parking is concerned: whether a kernel is an MPS client."""

    def layers(self, kernel_id: str) -> Optional[KernelLayers]: ...


class Sampling(Protocol):
    """What the parker needs of the monitor."""

    latest: "Sample"

    def sample_soon(self) -> None: ...

    def device_used_now(self, index: int) -> Optional[int]: ...


# --- the driver calls, a whole kernel at a time (run in a thread) ---------------------------------------


def park_processes(driver: CheckpointDriver, pids: Tuple[int, ...], lock_timeout_ms: int) -> None:
    """Lock every process, then checkpoint every process. A failure before any process is checkpointed is undone
    (unlocked) and raised: the kernel is left running as before. A failure after one was checkpointed is not undone:
    that process's memory has been free since, and may have been taken (a running kernel's allocation, another
    restore), so restoring it would be a restore without reserved room, which the driver answers by losing the
    process for good. The kernel then stays parked as far as the driver has it, every process locked, and comes
    back through the broker like any park (resume_processes restores what is checkpointed, unlocks the rest)."""
    locked, parked = [], []
    try:
        for pid in pids:
            driver.lock(pid, lock_timeout_ms)
            locked.append(pid)
        for pid in pids:
            driver.checkpoint(pid)
            parked.append(pid)
    except CheckpointError as error:
        if parked:
            log.warning(
                "gpu-quota-ext: a park checkpointed process %s, then %s; it stays parked as far as it got (a restore "
                "now would not have reserved room)", ", ".join(map(str, parked)), error,
            )
            return
        for pid in locked:
            _quietly(driver.unlock, pid)
        raise


def resume_processes(driver: CheckpointDriver, pids: Tuple[int, ...]) -> bool:
    """Restore every process still checkpointed, then unlock them all. False when none of them is left (they
    exited while parked). A failure raises: the caller must not call again (see states.py)."""
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
    return bool(alive)


def room_right_now(
    need: Mapping[int, int],
    totals: Mapping[int, int],
    used_now: Callable[[int], Optional[int]],
    others: Mapping[int, int],
    margin: int,
    freeing: Optional[Mapping[int, int]] = None,
) -> Optional[str]:
    """Why the devices do not have `need` free right now (NVML read afresh), beyond the restores granted to
    others that have not run yet and the margin; None when they do. The broker decided on a sample up to a poll
    interval old: this is the check right before the driver is asked, which it cannot take back.

    `freeing`: for a fast-path resume only (it waits, bounded, for memory being freed, and fails recoverably), what
    the fast-path parks under way will still free as they copy, by device. Counted whole: how much of it the device
    gives back already is not read here (the reading counts it free, so the check may count it twice; the resume's
    own bounded wait is what keeps that safe). The checkpoint path's restore never passes it."""
    for index, nbytes in sorted(need.items()):
        used = used_now(index)
        if used is None:
            return f"GPU {index}'s memory cannot be read right now; the kernel waits for room again"
        free = totals[index] - used - others.get(index, 0)
        coming = (freeing or {}).get(index, 0)
        if free + coming < nbytes + margin:
            also = f" (and {format_bytes(coming)} that parks under way are freeing)" if coming else ""
            return (
                f"GPU {index} has {format_bytes(max(0, free))} free right now{also}, short of the "
                f"{format_bytes(nbytes)} it needs plus a margin of {format_bytes(margin)}: memory was taken since the "
                "broker's decision (a process outside the quota?); the kernel waits for room again"
            )
    return None


def _quietly(call: Callable[[int], None], pid: int) -> None:
    try:
        call(pid)
    except CheckpointError as error:
        log.warning("gpu-quota-ext: undoing a park: %s", error)


def keyed(by_index: Mapping[int, int]) -> Dict[Hashable, int]:
    """A copy of bytes by device index, as the broker takes them: its keys are any device name (the host service's
    are UUIDs), ours are indexes."""
    return dict(by_index.items())


def kernel_activity(kernels: ParkedKernels, kernel_id: str) -> Tuple[Optional[str], Optional[float]]:
    """(execution state, wall clock of its last activity) from KernelManagerView.activity."""
    state, last = kernels.activity(kernel_id)
    return state, (last.timestamp() if last is not None else None)


# --- the parker -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParkPlan:
    """How a kernel's park goes (path.py's choice), kept from its check to its next park: the status shows it, and
    its resume goes the same way. Only where fast_park is on."""

    op: int  # the park's op (states.ParkRecord.op when it was checked)
    choice: ParkPath
    served: int = 0  # PAGES: what the library maps, what the park moves and the resume brings back
    arena: int = 0  # PAGES: the arena the kernel makes where it has none big enough (path.arena_bytes)
    host: int = 0  # host memory the park takes beyond what the kernel holds already (path.host_need)
    park_seconds: Optional[float] = None  # PAGES: the library's copy, as the kernel timed it
    resume_seconds: Optional[float] = None
    resume_waited_seconds: Optional[float] = None  # PAGES: of resume_seconds, the wait for a park freeing the room
    arena_kept: int = 0  # PAGES, after a resume: the pinned arena the running kernel kept for its next park
    arena_pids: Tuple[int, ...] = ()  # the processes that resumed with it: a restarted kernel holds no arena

    def json(self) -> dict:
        """The park object's "path" (shared.contract.PARK_PATH_FIELDS)."""
        return {
            "path": self.choice.path,
            "reason": self.choice.reason,
            "stays_on_device": self.choice.stays_on_device,
            "park_seconds": self.park_seconds,
            "resume_seconds": self.resume_seconds,
            "resume_waited_seconds": self.resume_waited_seconds,
        }


def resident_bytes(pids: Tuple[int, ...]) -> int:
    """The processes' resident memory now (those gone count 0): where a park's bytes land on the host."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except (psutil.Error, OSError):
            pass  # ended: its bytes left the host with it
    return total


class Parker:
    def __init__(
        self,
        settings: ParkSettings,
        driver: CheckpointDriver,
        kernels: ParkedKernels,
        ledger: GrantReads,
        devices: Mapping[int, Device],
        monitor: Sampling,
        hard_cap: Optional[HardLimitReads] = None,
        host: Callable[[], Tuple[Optional[int], Optional[int]]] = host_room,
        broker: Optional[RoomBroker] = None,
        channel: Optional[KernelChannel] = None,
        bootstrapped: Callable[[str], bool] = lambda kernel_id: False,
        reports_to_host: bool = False,
    ):
        self.settings = settings
        # A lease reads the park report (a hub host's server): only then is it published after samples and changes.
        self.reports_to_host = reports_to_host
        self.driver = driver
        self.kernels = kernels  # usage.KernelManagerView: ids, activity, iopub status, the restarter
        self.ledger = ledger
        self.devices = dict(devices)
        self.monitor = monitor
        self.hard_cap = hard_cap
        self.host = host
        self.broker: RoomBroker = broker or OwnBroker()
        self.channel = channel
        self.bootstrapped = bootstrapped  # the kernel runs gpu_quota_ext's bootstrap: it answers on control
        self.room_flags = RoomFlags(channel) if channel is not None else None  # who is short of room (headroom.py)
        self.driver_problem: Optional[str] = "the checkpoint driver has not been opened yet"
        self.records: Dict[str, ParkRecord] = {}
        # The highest op any record has had: a record made afresh (after forget(), or after a plain record was
        # dropped) starts from it, so that an outcome of a driver call still out for the kernel's old processes
        # (a restart while it was being parked) never matches an op of the new ones.
        self._last_op = 0
        self.transitions = 0  # state changes logged (tests wait on it)
        self.decisions = 0  # broker rounds applied (tests wait on it)
        self._sampled: Optional[asyncio.Event] = None  # set by each sample: a park waits for a fresh one
        self._streams: Dict[str, Callable[[], None]] = {}  # kernel -> stops following its iopub status
        self._tasks: set = set()
        self._opening: Optional[asyncio.Future] = None
        self._deciding: Optional[asyncio.Task] = None
        self._restoring = threading.Lock()  # held across each restore's last check and its driver calls
        self._checks: Dict[Tuple[str, int], asyncio.Future] = {}  # (kernel, op) -> its park's check has run
        self._decide_again = False
        self._stopped = False
        self._reported_at: Optional[float] = None  # when the last lease report read the kernels' activity
        # The lease's report as the event loop last published it: (when it was read, each kernel's KERNEL_PARK),
        # replaced whole, so the lease's thread reads it without a lock and never runs round().
        self._host_report: Tuple[Optional[float], Tuple[dict, ...]] = (None, ())
        self._host_report_due = False  # a publish is scheduled on the loop (_store: once per turn)
        # Host memory promised to parks under way (host_account.py), with each one's processes and their resident
        # memory when it was promised (what has landed since is their growth).
        self.host_account = HostAccount()
        self._host_base: Dict[str, Tuple[Tuple[int, ...], int]] = {}
        self.host_short_since: Optional[float] = None  # host memory ran short with kernels parked (an episode)
        self.host_short_reason: Optional[str] = None
        self.host_short_episodes = 0
        self._host_check: Optional[asyncio.Lock] = None  # held from a park's host check to its promise (made on
        # the event loop: Python 3.9's Lock binds the loop it was made on)
        # Kernels whose process died while held (lost.py): what their user is told once, kept under the kernel id
        # through jupyter_server's restart, until the restarted kernel says it has printed it.
        self.lost: Dict[str, LostNotice] = {}
        self._restart_hooks: Dict[str, Callable[[], None]] = {}  # kernel -> stops its restart callback
        self._telling: set = set()  # kernels asked about their notice, answer not yet in
        # kernel -> its last activity when it said it holds the notice unsaid
        self._lost_held: Dict[str, Optional[float]] = {}
        self._plans: Dict[str, ParkPlan] = {}  # kernel -> how its current or last park goes (fast_park on)
        # kernel -> what of its need the parks under way are still freeing, by device, as the broker's go said it (a
        # swap, Plan.freeing): on a hub host they are other users' parks, which this server cannot see. Kept from the
        # go to its restore.
        self._go_freeing: Dict[str, Dict[Hashable, int]] = {}
        self._releasing_arenas = False  # kept arenas are being given back (host memory short)
        # Structured events (events.py) for an admin's tools: jupyter_server's event logger once the server
        # extension hands it over (send_events), and who asked for each kernel's latest park or resume.
        self.events: Optional[EventSink] = None
        self._asked_by: Dict[str, str] = {}

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
            # Without a GPU the inventory has already said so, once; no driver for parking is no news there
            # (the park state and the status still carry the reason).
            level = logging.INFO if self.devices else logging.DEBUG
            log.log(level, "gpu-quota-ext: parking is not possible on this server: %s", detail)

    def send_events(self, sink: Optional[EventSink]) -> None:
        """Emit park, resume, refusal and loss events to `sink` (events.park_event_logger: the server's event
        logger, None where it has none) from now on."""
        self.events = sink

    async def ready(self) -> None:
        """Wait for the driver to be opened (or found missing)."""
        if self._opening is not None:
            await asyncio.wait({self._opening})

    async def stop(self) -> None:
        self._stopped = True
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
        limit = self.settings.wait_limit
        if record is not None and record.shows_park:
            waited = now - record.waiting_since if record.state == "waiting" and record.waiting_since else None
            host_bytes = sum(record.parked.values()) if record.parked and record.state != LOST else None
            reason = record.stuck or record.reason
            parkable = record.stuck is None and record.state != LOST
            return park_json(
                record.state, record.since, idle_for, host_bytes, parkable, reason, waited, limit, record.told,
                lost=notice_json(self.lost.get(kernel_id)), path=self._path_json(kernel_id),
            )
        problem = self.problem(kernel_id)
        room = None
        if record is not None:
            room = "asking" if record.room_need else record.room_outcome
        reason = (record.reason if record is not None and room else None) or problem or (
            record.reason if record is not None else None
        )
        state = activity_state(execution_state)
        lost = notice_json(self.lost.get(kernel_id))
        return park_json(
            state, last, idle_for, None, problem is None, reason, None, limit, room=room, lost=lost,
            path=self._path_json(kernel_id),
        )

    def _path_json(self, kernel_id: str) -> Optional[dict]:
        plan = self._plans.get(kernel_id)
        return plan.json() if plan is not None else None

    def holds_gpu_state(self, kernel_id: str) -> bool:
        """The driver holds (or is moving) this kernel's GPU state: its processes cannot run CUDA now."""
        record = self.records.get(kernel_id)
        return record is not None and record.state in HELD

    def problem(self, kernel_id: str) -> Optional[str]:
        """Why parking cannot work for this kernel now (from the last sample), or None."""
        layers = self.hard_cap.layers(kernel_id) if self.hard_cap is not None else None
        grant = self.ledger.get(kernel_id)
        sample = self.monitor.latest
        record = self.records.get(kernel_id)
        devices = grant.devices if grant is not None else ()
        readable = getattr(sample, "state", None) in ("ok", "degraded")
        unreadable = tuple(
            i for i in devices if readable and (i not in sample.devices or sample.devices[i].used is None)
        )
        return not_parkable(
            self.driver_problem,
            bool(layers is not None and layers.hard),
            bool(grant is not None and grant.devices),
            sum(sample.kernels.get(kernel_id, {}).values()),
            tuple(sample.pids.get(kernel_id, ())),
            foreign=tuple(sample.foreign.get(kernel_id, ())),
            stuck=record.stuck if record is not None else None,
            unreadable=unreadable,
            broker_problem=getattr(self.broker, "problem", None),
        )

    def _kernel_ids(self) -> set:
        try:
            return set(self.kernels.kernel_ids())
        except Exception as error:  # a kernel manager that cannot list (stopping): parking must not stop with it
            log.debug("gpu-quota-ext: parking: the server's kernels were not listed (%r); the kernels with a park "
                      "record are taken as its kernels", error)
            return set(self.records)

    def _activity(self, kernel_id: str) -> str:
        return activity_state(kernel_activity(self.kernels, kernel_id)[0])

    # --- events: every change of a record goes through transition() ------------------------------

    def _handle(self, kernel_id: str, event: Event) -> ParkRecord:
        """Apply one event to the kernel's record, log a change of state, carry out the effects."""
        now = time.time()
        old = self.records.get(kernel_id) or ParkRecord(state=RUNNING, since=now, op=self._last_op)
        new, effects = transition(old, event, now)
        self._last_op = max(self._last_op, new.op)
        if new is not old:
            self._store(kernel_id, old, new)
        for effect in effects:
            self._carry_out(kernel_id, effect)
        return new

    def _store(self, kernel_id: str, old: ParkRecord, new: ParkRecord) -> None:
        plain = (
            new.state == RUNNING and not new.reason and not new.refused and not new.room and not new.room_need
        ) and not new.room_outcome
        if plain:
            self.records.pop(kernel_id, None)
        else:
            self.records[kernel_id] = new
        if new.state not in (ParkState.WAITING, ParkState.RESUMING):
            self._go_freeing.pop(kernel_id, None)  # it no longer waits for a restore that the go's word was for
        old_shown = old.state if old.shows_park else self._activity(kernel_id)
        new_shown = new.state if new.shows_park else self._activity(kernel_id)
        if old_shown != new_shown:
            self.transitions += 1
            log.info("%s", describe_transition(kernel_id, old_shown, new_shown, new))
        elif new.state == RUNNING and new.refused and new.reason and new.reason != old.reason:
            log.info("gpu-quota-ext: kernel %s: %s", kernel_id, new.reason)
        if self.events is not None:  # the same change as the log line, for an admin's tools (events.py)
            send(self.events, transition_event(kernel_id, old, new, self._seen(kernel_id, old_shown, new_shown)))
        watched = new.state in HELD or new.state == "pending"
        if watched and kernel_id not in self._streams:
            self._watch(kernel_id)
        elif not watched and kernel_id in self._streams:
            self._unwatch(kernel_id)
        if new.state in HELD and kernel_id not in self._restart_hooks:
            self._hook_restart(kernel_id)
        elif new.state not in HELD:
            self._unhook_restart(kernel_id)
        self._publish_host_report_soon()

    def _seen(self, kernel_id: str, shown_before: str, shown_after: str) -> Seen:
        """What an event says beside the records: the states shown, who asked, the way the park went."""
        plan = self._pages_plan(kernel_id)
        return Seen(
            shown_before,
            shown_after,
            asked_by=self._asked_by.get(kernel_id),
            path=plan.choice.path if plan is not None else CHECKPOINT,
            host_bytes=plan.host if plan is not None else None,
            at=time.time(),
        )

    def _carry_out(self, kernel_id: str, effect: Effect) -> None:
        if isinstance(effect, StartPark):
            self._spawn(self._park(kernel_id, effect.op))
        elif isinstance(effect, Checkpoint):
            self._promise_host(kernel_id, effect.pids)
            self._spawn(self._checkpoint(kernel_id, effect.op, effect.pids))
            if self._releasing(kernel_id):
                # Its bytes come free from now on, piece by piece: a fast resume waiting for them may start now
                # rather than at the next sample (a swap, broker.py), which would lose most of the overlap.
                self.decide_soon()
        elif isinstance(effect, Restore):
            self._spawn(self._restore(kernel_id, effect.op, effect.pids))
        elif isinstance(effect, Decide):
            self.decide_soon()

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- requests (REST, %gpucap, the sidebar, the host service) ------------------------------------

    def _known(self, kernel_id: str) -> None:
        if kernel_id not in self._kernel_ids():
            raise UnknownKernel(kernel_id)

    async def request_park(self, kernel_id: str, who: str = "user") -> Tuple[bool, dict]:
        """Park now (idle) or once the current cell has finished (busy). (accepted, the kernel's park object).
        Decided on a sample taken after the request (a tensor the last cell made is what the kernel holds), and
        answered once the park's own check has run, so a refusal comes with its reason."""
        self._known(kernel_id)
        await self.ready()
        record = self.records.get(kernel_id)
        if (record is None or not record.shows_park) and self.problem(kernel_id) is not None:
            await self._fresh_sample()  # the last sample may predate what the kernel holds now
        record = self._ask_park(kernel_id, f"{who} request", automatic=False, asked_by=USER)
        if record.state == "parking" and not record.pids:
            check = self._checks.setdefault((kernel_id, record.op), asyncio.get_running_loop().create_future())
            await asyncio.wait({check}, timeout=self.settings.trim_timeout + self.settings.fresh_sample_wait + 5)
        return self._accepted(kernel_id), self.kernel_json(kernel_id)

    def _ask_park(self, kernel_id: str, why: str, automatic: bool, asked_by: str) -> ParkRecord:
        busy = self._activity(kernel_id) == "busy"
        self._asked_by[kernel_id] = asked_by
        return self._handle(kernel_id, AskPark(why, self.problem(kernel_id), busy, automatic))

    def _accepted(self, kernel_id: str) -> bool:
        record = self.records.get(kernel_id)
        return record is not None and (record.state in HELD or record.state == "pending") and record.state != LOST

    async def request_resume(self, kernel_id: str, who: str = "user") -> Tuple[bool, dict]:
        """Resume now (parked: once the broker has room), right after parking (parking); a pending park is called
        off. Where parking cannot work at all, the answer says why (409), as park's does."""
        self._known(kernel_id)
        record = self.records.get(kernel_id)
        if record is None or record.state == RUNNING:
            return self.problem(kernel_id) is None, self.kernel_json(kernel_id)
        self._asked_by[kernel_id] = USER
        self._handle(kernel_id, AskResume(f"{who} request"))
        return record.state != LOST, self.kernel_json(kernel_id)

    async def request_room(self, kernel_id: str, device: Optional[int] = None) -> Tuple[bool, dict, str]:
        """A kernel's allocation found the device itself full: with park_on_device_full on, the broker makes room
        up to its cap (on `device`, or each of its devices). (accepted, its park object, why not)."""
        self._known(kernel_id)
        grant = self.ledger.get(kernel_id)
        if self.settings.on_device_full != "on":
            return False, self.kernel_json(kernel_id), "park_on_device_full is off on this server"
        await self.ready()
        if self.driver_problem is not None:  # no kernel can park for it: say so now rather than at the wait limit
            return False, self.kernel_json(kernel_id), f"this server cannot park kernels: {self.driver_problem}"
        if not getattr(self.broker, "makes_room_for_running", False):
            why = "on a hub host the host service's broker makes room for resumes only, not yet on a full device"
            return False, self.kernel_json(kernel_id), why
        if grant is None or not grant.devices or (device is not None and device not in grant.devices):
            return False, self.kernel_json(kernel_id), "no such GPU among this kernel's"
        used = self.monitor.latest.kernels.get(kernel_id, {})
        need = {
            i: grant.caps[i] - used.get(i, 0)
            for i in grant.devices
            if (device is None or i == device) and grant.caps[i] > used.get(i, 0)
        }
        if not need:
            return False, self.kernel_json(kernel_id), "it holds its whole cap already: the cap was the limit"
        self._handle(kernel_id, AskRoom(need))
        return True, self.kernel_json(kernel_id), ""

    @property
    def reported_at(self) -> Optional[float]:
        """When the last lease report (host_report) read the kernels' activity."""
        return self._reported_at

    def park_for_host(self, kernel_ids: List[str], reported_at: Optional[float] = None) -> None:
        """The host service chose these kernels of ours to park, to make room for another kernel of the host.
        Each is parked only if it is still idle here, has not been active since the lease's report the service
        decided on (up to a lease period old: idle long enough then, it may have run a cell since), and is
        parkable. `reported_at`: when the report of the lease that brought the request was read (taken in the
        lease's thread as the answer came: the next renewal's report may be read before this runs)."""
        reported = reported_at if reported_at is not None else self._reported_at
        for kernel_id in kernel_ids:
            if kernel_id not in self._kernel_ids() or kernel_id in self.records and self.records[kernel_id].shows_park:
                continue
            execution_state, last = kernel_activity(self.kernels, kernel_id)
            if activity_state(execution_state) != "idle":
                continue
            if reported is not None and last is not None and last > reported:
                continue  # active since: the service's park_min_idle no longer holds; its next report says so
            self._ask_park(kernel_id, "to make room for another kernel of this host", automatic=True,
                           asked_by=HOST_SERVICE)

    # --- the kernel's activity -------------------------------------------------------------------

    def turned_busy(self, kernel_id: str) -> None:
        """The kernel started handling a request: a parked kernel asks for room to come back to."""
        if kernel_id in self.records:
            self._handle(kernel_id, Busy())

    def turned_idle(self, kernel_id: str) -> None:
        """The kernel finished handling a request: a pending park goes ahead; a cell that waited has ended."""
        if kernel_id in self.records:
            self._handle(kernel_id, Idle())

    def on_sample(self, sample: "Sample") -> None:
        """After each monitor sample (event loop): reservations whose restore the sample has seen, activity the
        iopub stream did not report, the idle timer, and the broker when someone waits. Never raises: the
        monitor's watchdog runs after it on the same sample."""
        if self._stopped:
            return
        try:
            self._review(sample)
        except Exception as error:  # whatever it was, the watchdog after us must see this sample; the next one retries
            log.warning("gpu-quota-ext: parking skipped one sample: %r", error)
        if self.reports_to_host:
            self.publish_host_report()

    def _review(self, sample: "Sample") -> None:
        if getattr(sample, "state", None) in ("ok", "degraded") and self._sampled is not None:
            self._sampled.set()  # the parks waiting for a fresh reading have it
        live = self._kernel_ids()
        for kernel_id in [k for k in self.records if k not in live]:
            self.forget(kernel_id)
        self._tell_lost(live)
        if self.driver_problem is not None:
            return
        now = time.time()
        self._review_host(now)
        taken = getattr(sample, "time", None)
        for kernel_id in live:
            record = self.records.get(kernel_id)
            if record is not None and taken is not None and (record.room_until or record.deferred_at) is not None:
                record = self._handle(kernel_id, Sampled(taken))
            execution_state, last = kernel_activity(self.kernels, kernel_id)
            state = activity_state(execution_state)
            if record is not None and record.shows_park:
                # A busy the iopub stream missed; an idle only where no stream reports it (jupyter_server's own
                # execution state may lag the stream's by a message: an idle read here could call off a cell's
                # wait that the stream has just seen begin).
                if state == "busy":
                    self._handle(kernel_id, Busy())
                elif kernel_id not in self._streams:
                    self._handle(kernel_id, Idle())
                continue
            if state == "busy":
                if record is not None and record.refused:
                    self._handle(kernel_id, Busy())
                continue
            if record is not None and record.refused:
                continue  # it did not park last time: not again until it has been busy
            if due_for_park(self.settings, state, idle_seconds(execution_state, last, now)):
                if self.problem(kernel_id) is None:
                    self._ask_park(
                        kernel_id, f"idle for {self.settings.idle_after:.0f} s", automatic=True, asked_by=TIMER
                    )
        if self.host_short_since is not None or any(
            r.state in ("waiting", "parking") or r.room or r.room_need for r in self.records.values()
        ):
            self.decide_soon()
        self._tell_room_flags(live)

    def _tell_room_flags(self, live: set) -> None:
        """Tell each running kernel, when it changes, whether its headroom is free on its device (headroom.py), so
        that its next cell asks for room before its code runs. Only where room is made for running kernels."""
        flags = self.room_flags
        makes_room = self.settings.on_device_full == "on" and getattr(self.broker, "makes_room_for_running", False)
        if flags is None or not makes_room:
            return
        round_ = self.round()
        used = {k.kernel_id: k.used for k in round_.kernels}
        for kernel_id, device in short_kernels(round_, [k for k in live if self.bootstrapped(k)]).items():
            holding = device is not None and device is not UNKNOWN and used[kernel_id].get(device, 0) > 0
            if device is not UNKNOWN and flags.needs_telling(kernel_id, device, holding):
                self._spawn(flags.tell(kernel_id, device, holding))

    def forget(self, kernel_id: str) -> None:
        """The kernel's processes are gone (shut down, restarted, dead): nothing of its parking remains."""
        record = self.records.pop(kernel_id, None)
        self._plans.pop(kernel_id, None)
        self._asked_by.pop(kernel_id, None)
        self._release_host(kernel_id)
        if record is not None and record.state in HELD:
            log.info(
                "gpu-quota-ext: kernel %s was %s; its processes ended, and its GPU state on the host with them",
                kernel_id,
                record.state,
            )
        self._unwatch(kernel_id)
        self._unhook_restart(kernel_id)
        if self.room_flags is not None:
            self.room_flags.forget(kernel_id)
        self._go_freeing.pop(kernel_id, None)
        if record is not None and (record.state in ("waiting", "parking") or record.room):
            self.decide_soon()

    # --- a kernel lost while held: told once (lost.py) ------------------------------------------------

    def _hook_restart(self, kernel_id: str) -> None:
        """While the driver holds the kernel, hear of its restarter finding its process dead (the OOM killer, a
        kill -9): the restarter's "restart" event comes before the restart, while the record still says what the
        kernel was. A user's restart or shutdown does not fire it: they asked for it."""
        stop = self.kernels.on_restart(kernel_id, lambda: self._process_ended(kernel_id))
        if stop is not None:
            self._restart_hooks[kernel_id] = stop

    def _unhook_restart(self, kernel_id: str) -> None:
        stop = self._restart_hooks.pop(kernel_id, None)
        if stop is not None:
            stop()

    def _process_ended(self, kernel_id: str) -> None:
        """The restarter found the held kernel's process dead and starts it again (event loop)."""
        record = self.records.get(kernel_id)
        if record is None or record.state not in HELD:
            return
        exit_code = self.kernels.exit_code(kernel_id)
        notice = lost_notice(record.state, time.time(), exit_code)
        self.lost[kernel_id] = notice
        self._lost_held.pop(kernel_id, None)
        log.warning("gpu-quota-ext: kernel %s: %s; jupyter_server restarts it, and its user is told so at its next "
                    "cell", kernel_id, notice.why)
        send(self.events, loss_event(kernel_id, record, notice.why, exit_code))

    def lost_env(self, kernel_id: str) -> Optional[str]:
        """The notice for the kernel's new process, given in its environment at launch (shared.env_vars.LOST), so
        that its very first cell says it; None when there is none."""
        notice = self.lost.get(kernel_id)
        return notice_env(notice) if notice is not None else None

    def _tell_lost(self, live: set) -> None:
        """Ask each restarted kernel with a notice whether it has printed it (and give it the words, in case its
        environment did not carry them); a kernel gone for good takes its notice with it."""
        for kernel_id in [k for k in self.lost if k not in live]:
            del self.lost[kernel_id]
            self._lost_held.pop(kernel_id, None)
        if self.channel is None:
            return
        for kernel_id in list(self.lost):
            if kernel_id in self._telling or not self.bootstrapped(kernel_id):
                continue
            last = kernel_activity(self.kernels, kernel_id)[1]
            if kernel_id in self._lost_held and self._lost_held[kernel_id] == last:
                continue  # it holds the words and has run nothing since (this request is not its activity)
            self._spawn(self._ask_lost(kernel_id, self.lost[kernel_id], last))

    async def _ask_lost(self, kernel_id: str, notice: LostNotice, last: Optional[float]) -> None:
        self._telling.add(kernel_id)
        try:
            answer = await self.channel.ask(kernel_id, notice_request(notice), 2.0)  # type: ignore[union-attr]
            if self.lost.get(kernel_id) != notice:
                return  # lost again meanwhile: the new notice is asked about afresh
            if shown(answer):
                del self.lost[kernel_id]
                self._lost_held.pop(kernel_id, None)
                log.info("gpu-quota-ext: kernel %s: its user was told that it was lost", kernel_id)
            elif isinstance(answer, dict) and answer.get("shown") is False:
                self._lost_held[kernel_id] = last  # asked again once it has been active: a cell says it
        except asyncio.CancelledError:
            raise
        except Exception as error:  # never break the parker's sample
            log.debug("gpu-quota-ext: kernel %s: lost notice not asked: %r", kernel_id, error)
        finally:
            self._telling.discard(kernel_id)

    # --- the broker -------------------------------------------------------------------------------

    def decide_soon(self) -> None:
        """Ask the broker, once, soon; a request while it decides asks again after."""
        if self._stopped:
            return
        if self._deciding is not None and not self._deciding.done():
            self._decide_again = True
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on the event loop (a script's cleanup): the next sample asks the broker
        self._deciding = loop.create_task(self._decide())
        self._tasks.add(self._deciding)
        self._deciding.add_done_callback(self._tasks.discard)

    async def _decide(self) -> None:
        while True:
            self._decide_again = False
            try:
                round_ = self.round()
                plan = await self.broker.decide(round_)
                self.apply(plan)
            except Exception as error:  # the host service's broker is over HTTP; the next sample asks again
                log.warning("gpu-quota-ext: the parking broker skipped a round: %r", error)
            if not self._decide_again or self._stopped:
                return

    def _said(
        self,
        kernel_id: str,
        record: Optional[ParkRecord],
        execution_state: Optional[str],
        last: Optional[float],
        sample: "Sample",
        now: float,
    ) -> Said:
        """What this server knows of one kernel for shown.shown_as: its record (or jupyter_server's busy/idle), as of
        now. Its park's bytes are in the sample when the sample was taken before the park ended. Its park is not timed
        against park_time: this server sees its driver call, out until it returns or is marked stuck (the host
        service, which cannot see it, times it; and ends its host promise by this server's report)."""
        held = record if record is not None and record.shows_park else None
        state = held.state if held is not None else activity_state(execution_state)
        return Said(
            state=state,
            at=now,
            idle_for=idle_seconds(execution_state, last, now),
            parkable=state == ParkState.IDLE
            and self.problem(kernel_id) is None
            and not (record is not None and record.refused),
            in_reading=held is not None
            and state == ParkState.PARKED
            and (sample.time is None or held.since >= sample.time),
            stuck=held is not None and held.stuck is not None,
        )

    def round(self) -> Round:
        """This server's view for the broker: its GPUs, its kernels, who waits, what is reserved."""
        sample = self.monitor.latest
        now = time.time()
        readable = getattr(sample, "state", None) in ("ok", "degraded")
        devices = tuple(
            DeviceView(
                key=index,
                name=f"GPU {index}",
                total=device.total,
                used=sample.devices[index].used if readable and index in sample.devices else None,
            )
            for index, device in sorted(self.devices.items())
        )
        kernels: List[KernelView] = []
        demands: List[BrokerDemand] = []
        reservations: List[Reservation] = []
        for grant in self.ledger.grants():
            if not grant.devices:
                continue
            kernel_id = grant.kernel_id
            record = self.records.get(kernel_id)
            execution_state, last = kernel_activity(self.kernels, kernel_id)
            used = keyed(sample.kernels.get(kernel_id, {})) if readable else {}
            view = shown_as(self._said(kernel_id, record, execution_state, last, sample, now), now)
            kernels.append(
                KernelView(
                    kernel_id=kernel_id,
                    state=view.state,
                    used=used,
                    caps=keyed(grant.caps),
                    idle_for=view.idle_for,
                    parkable=view.parkable,
                    label=f"kernel {kernel_id[:8]}",
                    stays=self._stays(kernel_id, view.state),
                    host_cost=self._host_cost(kernel_id, used),
                    releases_as_copied=view.state == ParkState.PARKING and self._releasing(kernel_id),
                )
            )
            if record is None:
                continue
            if record.state == ParkState.WAITING and record.deferred_at is None:
                # A fast-path resume waits, bounded, for bytes being freed, and fails recoverably: it may go while the
                # park that makes its room copies (a swap); the checkpoint path's restore never may.
                fast = self._pages_plan(kernel_id) is not None and self.channel is not None
                demands.append(
                    BrokerDemand(kernel_id, keyed(record.parked), record.waiting_since or now, may_wait=fast)
                )
            if record.room:
                reservations.append(Reservation(kernel_id, keyed(record.room)))
            if record.room_need and record.state in (RUNNING, ParkState.PENDING):
                demands.append(BrokerDemand(kernel_id, keyed(record.room_need), record.room_asked or now, running=True))
            if self.host_short_since is not None and record.state == ParkState.PARKED:
                demands.append(BrokerDemand(kernel_id, keyed(record.parked), self.host_short_since, background=True))
        available, cgroup = self.host()
        self._note_landing()
        return Round(
            devices=devices,
            kernels=tuple(kernels),
            demands=tuple(demands),
            reservations=tuple(reservations),
            host=HostView(available, cgroup, self.host_account.outstanding(), self.host_account.kernels()),
            settings=self.settings.broker,
            now=now,
        )

    def host_report(self) -> List[dict]:
        """Each kernel's park state for the host's broker (the lease's "park"). Called from the lease's thread: it
        reads the report the event loop last published (publish_host_report), never the parker's state, and notes
        when that report read the kernels' activity (park_for_host)."""
        at, report = self._host_report
        self._reported_at = at
        return [dict(kernel) for kernel in report]

    def publish_host_report(self) -> None:
        """Read the lease's report now (event loop: after each sample, and after a record changed). Never raises:
        the last one published stays (none before the first sample: the service counts the kernels running)."""
        self._host_report_due = False
        try:
            at = time.time()
            kernels = self.round().kernels
            report = tuple(reported(k) for k in kernels)
        except Exception as error:  # the lease's thread reads the last report, which stays as it was
            log.debug("gpu-quota-ext: the kernels' park states for the lease were not read: %r", error)
            return
        self._host_report = (at, report)

    def _publish_host_report_soon(self) -> None:
        """A record changed: publish once the loop's current turn is done (one publish for many changes)."""
        if self._host_report_due or self._stopped or not self.reports_to_host:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on the event loop (a script's cleanup): the next sample publishes
        self._host_report_due = True
        loop.call_soon(self.publish_host_report)

    def apply(self, plan: Plan) -> None:
        """Carry out one round's decisions (event loop)."""
        self.decisions += 1
        for victim, for_kernel in plan.park:
            record = self.records.get(victim)
            if (record is not None and record.shows_park) or self._activity(victim) != "idle":
                continue
            # A kernel id of this server's own broker, or the host service's words ("another kernel of this host").
            whom = for_kernel if " " in for_kernel else f"kernel {for_kernel[:8]}"
            asked_by = BROKER if isinstance(self.broker, OwnBroker) else HOST_SERVICE
            self._ask_park(victim, f"to make room for {whom}", automatic=True, asked_by=asked_by)
        granted = False
        for kernel_id in plan.go:
            record = self.records.get(kernel_id)
            if record is not None and record.state == ParkState.WAITING:
                self._go_freeing[kernel_id] = dict(plan.freeing.get(kernel_id, {}))  # this go's word, not an older's
            if record is not None and record.state == "parked" and self.host_short_since is not None:
                # A background resume (host memory short): asked as the server's own, then granted its room.
                self._asked_by[kernel_id] = HOST_MEMORY
                self._handle(kernel_id, AskResume("host memory is short"))
            if self._waits(kernel_id):
                self._handle(kernel_id, RoomGranted())
                granted = True
        if granted:
            # A restore's room is reserved from now: the running kernels whose caps reach into it are told at once
            # (not at the next sample), so that none starts a cell that takes those bytes while the restore copies.
            self._tell_room_flags(self._kernel_ids())
        for kernel_id, message in plan.told.items():
            if self._waits(kernel_id) and not self.records[kernel_id].told:
                log.warning("gpu-quota-ext: kernel %s %s", kernel_id, message)
                self._handle(kernel_id, RoomTold(message))
        for kernel_id, reason in plan.waiting.items():
            if self._waits(kernel_id) and not self.records[kernel_id].told:
                self._handle(kernel_id, RoomWait(reason))

    def _waits(self, kernel_id: str) -> bool:
        """A parked kernel that waits for room to come back to, or a running one that asked for room."""
        record = self.records.get(kernel_id)
        return record is not None and (record.state == "waiting" or bool(record.room_need))

    # --- park and resume -------------------------------------------------------------------------

    async def _drive(
        self, kernel_id: str, op: int, call: str, fn: Callable[..., Outcome], *args: object
    ) -> Union[Outcome, CheckpointError]:
        """Run a driver sequence in its thread; its result, or its CheckpointError returned (not raised). A
        call out longer than call_timeout marks the kernel stuck (shown in its state) and keeps waiting."""
        future = off_loop(fn, *args, name=f"gpu-quota-{call}")
        done, _ = await asyncio.wait({future}, timeout=self.settings.call_timeout)
        if not done:
            reason = stuck_reason(call, self.settings.call_timeout)
            log.warning("gpu-quota-ext: kernel %s: %s", kernel_id, reason)
            self._handle_if_current(kernel_id, op, Stuck(op, reason))
            await asyncio.wait({future})
            self._handle_if_current(kernel_id, op, Stuck(op, None))
        error = future.exception()
        if error is None:
            return future.result()
        if isinstance(error, CheckpointError):
            return error
        return CheckpointError(call, -1, -1, repr(error))

    def _current(self, kernel_id: str, op: int) -> bool:
        record = self.records.get(kernel_id)
        return record is not None and record.op == op

    def _handle_if_current(self, kernel_id: str, op: int, event: Event) -> None:
        if self._current(kernel_id, op):
            self._handle(kernel_id, event)

    async def _fresh_sample(self) -> None:
        """Wait for a sample whose reading began after now, at most `fresh_sample_wait` seconds. (The sample out
        when asked was read before: the monitor takes one at a time, and asks for the next one then.)"""
        wait = self.settings.fresh_sample_wait
        if wait <= 0:
            return
        asked = time.time()
        deadline = time.monotonic() + wait
        while (getattr(self.monitor.latest, "time", None) or 0.0) <= asked:
            if self._sampled is None or self._sampled.is_set():
                self._sampled = asyncio.Event()
            self.monitor.sample_soon()
            try:
                await asyncio.wait_for(asyncio.shield(self._sampled.wait()), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                log.info("gpu-quota-ext: parking: no new GPU sample within %.0f s; the last one says what moves", wait)
                return

    async def _park(self, kernel_id: str, op: int) -> None:
        """Before the driver: the kernel empties its caches, then a fresh sample says what it holds now."""
        try:
            await self._check_park(kernel_id, op)
        finally:
            check = self._checks.pop((kernel_id, op), None)
            if check is not None and not check.done():
                check.set_result(None)

    async def _check_park(self, kernel_id: str, op: int) -> None:
        # A kernel without the bootstrap (not a Python kernel) never had the library: it says so by having no say.
        facts: Optional[dict] = {"preloaded": False}
        if self.channel is not None and self.bootstrapped(kernel_id):
            answer = await self.channel.ask(kernel_id, {"action": "trim"}, self.settings.trim_timeout)
            if answer and isinstance(answer.get("freed"), int) and answer["freed"] > 0:
                log.info("gpu-quota-ext: kernel %s emptied %d bytes of cached GPU memory before parking",
                         kernel_id, answer["freed"])
            facts = None
            if fast_park_on(self.settings.fast_park):  # after the trim: what the library maps is what stays in use
                facts = await self.channel.ask(kernel_id, {"action": "facts"}, self.settings.trim_timeout)
        await self._fresh_sample()
        if not self._current(kernel_id, op):
            return  # forgotten or changed meanwhile
        sample = self.monitor.latest
        pids = tuple(sample.pids.get(kernel_id, ()))
        parked = {i: n for i, n in sample.kernels.get(kernel_id, {}).items() if n > 0}
        host_bytes = sum(parked.values())
        plan = self._plan(kernel_id, op, facts, parked, len(pids))
        if plan is not None and plan.choice.path == PAGES:
            # What moves is what the library maps (the context stays); the host takes a new arena, or nothing.
            parked = {index: plan.served for index in parked}
            host_bytes = plan.host
        # One host check at a time, from the check to the promise (_carry_out's Checkpoint, in _handle): parks
        # checked in the same second see each other's bytes. Without a host service nothing in it awaits.
        if self._host_check is None:
            self._host_check = asyncio.Lock()
        async with self._host_check:
            if not self._current(kernel_id, op):
                return
            refused = self.problem(kernel_id)
            if refused is not None:
                refused = f"did not park: {refused}"
            else:
                if await self._make_host_room(kernel_id, host_bytes) and not self._current(kernel_id, op):
                    return
                refused = self._host_refusal(kernel_id, host_bytes)
                ask_host = getattr(self.broker, "promise_host", None)
                if refused is None and ask_host is not None:
                    # On a hub host the host service holds the account for every user's parks.
                    refused, decided = await ask_host(self.round(), kernel_id, host_bytes)
                    self.apply(decided)
                    if not self._current(kernel_id, op):
                        return  # changed meanwhile; the service's promise ends with its next report of the kernel
            if plan is not None:
                self._plans[kernel_id] = plan
            self._handle(kernel_id, ParkChecked(op, pids, parked, refused))

    def _plan(
        self, kernel_id: str, op: int, facts: Optional[dict], parked: Mapping[int, int], processes: int
    ) -> Optional[ParkPlan]:
        """The path of this park (path.choose_path on the kernel's facts and the sample's), None where fast_park
        is off: then nothing about paths is said, and every kernel parks as it always has."""
        if not fast_park_on(self.settings.fast_park):
            return None
        known = kernel_facts(self.settings.fast_park, facts, parked, processes)
        choice = choose_path(known)
        if choice.path != PAGES:
            return ParkPlan(op, choice)
        served = known.served_bytes
        arena_now = facts.get("arena_bytes") if isinstance(facts, dict) else 0
        arena_now = arena_now if isinstance(arena_now, int) and not isinstance(arena_now, bool) else 0
        # The kernel's word for its arena, no more than the one this server knows it kept (at its last fast resume):
        # a claimed arena would let its park promise the host nothing.
        arena_now = min(arena_now, self._arena_kept(kernel_id))
        return ParkPlan(op, choice, served, arena_bytes(served), host_need(served, arena_now))

    def _stays(self, kernel_id: str, shown: str) -> int:
        """What the kernel's park left on the device, as it is shown now: the fast path's context while parked."""
        plan = self._pages_plan(kernel_id)
        if plan is None or shown not in (ParkState.PARKED, ParkState.WAITING):
            return 0
        return plan.choice.stays_on_device

    def _host_cost(self, kernel_id: str, used: Mapping[Hashable, int]) -> Optional[int]:
        """Host memory the kernel's next park would take where it kept its arena after a fast resume (the arena
        is pinned already, out of the host's available memory); None: all its bytes, as for any other kernel."""
        kept = self._arena_kept(kernel_id)
        plan = self._plans.get(kernel_id)
        if plan is None or kept <= 0:
            return None
        # What the next park moves: all it holds but its CUDA context, which stays on the device.
        return max(0, sum(used.values()) - plan.choice.stays_on_device - kept)

    def _pages_plan(self, kernel_id: str) -> Optional[ParkPlan]:
        """The kernel's park went (or goes) through the fast path: its resume goes the same way."""
        plan = self._plans.get(kernel_id)
        record = self.records.get(kernel_id)
        if plan is None or plan.choice.path != PAGES or record is None or record.op < plan.op:
            return None
        return plan

    def _driver_for(self, kernel_id: str, plan: Optional[ParkPlan], keep: bool = True) -> CheckpointDriver:
        """The driver of this park or resume: the checkpoint driver, or the fast path's through the kernel. A fast
        park releases each piece of device memory as soon as it is copied (a resume waiting for it starts sooner);
        a fast resume's wait for room is set by _restore, where a park under way frees its room."""
        if plan is None or self.channel is None:
            return self.driver
        ask = threadsafe_ask(self.channel, kernel_id, asyncio.get_running_loop())
        return PagesDriver(
            ask, arena=plan.arena, keep_arena=keep, timeout=self.settings.call_timeout, release_as_copied=True
        )

    def _releasing(self, kernel_id: str) -> bool:
        """The kernel's park is under way through the fast path, past its check (its driver call asked, or about to
        be): its device memory comes free piece by piece as it is copied."""
        record = self.records.get(kernel_id)
        return (
            record is not None
            and record.state in (ParkState.PARKING, ParkState.PARKED)
            and bool(record.parked)
            and self.channel is not None
            and self._pages_plan(kernel_id) is not None
        )

    def _freeing(self, but: str) -> Dict[int, int]:
        """What the fast-path parks under way (other than `but`'s) will still free as they copy, by device: their
        parked bytes (what the library maps). A park that has ended is in the device's reading already."""
        freeing: Dict[int, int] = {}
        for kernel_id, record in self.records.items():
            if kernel_id != but and record.state == ParkState.PARKING and self._releasing(kernel_id):
                for index, nbytes in record.parked.items():
                    freeing[index] = freeing.get(index, 0) + nbytes
        return freeing

    def _swap_freeing(
        self, kernel_id: str, need: Mapping[int, int], go_freeing: Mapping[Hashable, int]
    ) -> Dict[int, int]:
        """What a fast resume of the kernel may count on being freed, by device of its need: the most of what this
        server's own fast parks under way free and what the broker's go said (`go_freeing`: on a hub host, other
        users' parks too). The most, not the sum: on a single server both count the same parks."""
        own = self._freeing(but=kernel_id)
        coming = {index: max(own.get(index, 0), go_freeing.get(index, 0)) for index in need}
        return {index: n for index, n in coming.items() if n > 0}

    async def _checkpoint(self, kernel_id: str, op: int, pids: Tuple[int, ...]) -> None:
        plan = self._pages_plan(kernel_id)
        driver = self._driver_for(kernel_id, plan)
        try:
            outcome = await self._drive(
                kernel_id, op, "checkpoint", park_processes, driver, pids, self.settings.lock_timeout_ms
            )
        finally:
            self._release_host(kernel_id)  # returned (or cancelled): the host's reading holds what it moved
        error = failure_reason("park", outcome.code, str(outcome)) if isinstance(outcome, CheckpointError) else None
        if plan is not None and isinstance(driver, PagesDriver) and self._plans.get(kernel_id) is plan:
            self._plans[kernel_id] = replace(
                plan, park_seconds=driver.seconds, resume_seconds=None, resume_waited_seconds=None
            )
        self._handle_if_current(kernel_id, op, ParkDone(op, error))

    # --- host memory: one account for every park (host_account.py) ----------------------------------

    def host_reading(self) -> HostReading:
        return HostReading(*self.host())

    def _host_refusal(self, kernel_id: str, nbytes: int) -> Optional[str]:
        if self.host_short_since is not None:
            return f"did not park: {self.host_short_reason}"
        self._note_landing()
        return self.host_account.refusal(kernel_id, nbytes, self.host_reading(), self.settings.host_margin)

    def _kept_arenas(self, but: Optional[str] = None) -> Dict[str, int]:
        """Running kernels' pinned arenas kept since their fast resume (path.keep_arena)."""
        kept = {k: self._arena_kept(k) for k in self._plans if k != but}
        return {k: nbytes for k, nbytes in kept.items() if nbytes > 0}

    def _arena_kept(self, kernel_id: str) -> int:
        """The arena the kernel kept at its last fast resume, while a process that resumed with it is still the
        kernel's in the monitor's sample (a kernel restarted since holds none)."""
        plan = self._plans.get(kernel_id)
        if plan is None or plan.arena_kept <= 0:
            return 0
        now = getattr(self.monitor.latest, "pids", {}).get(kernel_id, ())
        return plan.arena_kept if set(plan.arena_pids) & set(now) else 0

    async def _make_host_room(self, kernel_id: str, nbytes: int) -> bool:
        """Where this park finds too little host memory and the arenas other kernels kept would make up for it,
        those kernels give them back first (path.arenas_to_release); whether any did. Only the server's own
        account is read: on a hub host the service decides after it, on memory that includes what came free."""
        kept = self._kept_arenas(but=kernel_id)
        if not kept or self.channel is None or self.host_short_since is not None:
            return False
        self._note_landing()
        short = self.host_account.short_by(nbytes, self.host_reading(), self.settings.host_margin)
        released = False
        for other in arenas_to_release(kept, short):
            released = await self._release_arena(other, "a park needs the host's memory") or released
        return released

    async def _release_arena(self, kernel_id: str, why: str) -> bool:
        if self.channel is None:
            return False
        answer = await self.channel.ask(kernel_id, {"action": "release"}, self.settings.trim_timeout)
        plan = self._plans.get(kernel_id)
        if not (isinstance(answer, dict) and answer.get("code") == 0):
            log.info("gpu-quota-ext: kernel %s did not give back its kept arena: %s", kernel_id,
                     answer.get("message") if isinstance(answer, dict) else "no answer")
            return False
        if plan is not None and plan.arena_kept > 0:
            self._plans[kernel_id] = replace(plan, arena_kept=0)
        log.info("gpu-quota-ext: kernel %s gave back its kept arena (%s): %s", kernel_id,
                 format_bytes(answer.get("bytes") or 0), why)
        return True

    async def _release_every_arena(self, why: str) -> None:
        self._releasing_arenas = True
        try:
            for kernel_id in self._kept_arenas():
                await self._release_arena(kernel_id, why)
        finally:
            self._releasing_arenas = False

    def _promise_host(self, kernel_id: str, pids: Tuple[int, ...]) -> None:
        record = self.records.get(kernel_id)
        nbytes = sum(record.parked.values()) if record is not None else 0
        plan = self._pages_plan(kernel_id)
        if plan is not None:
            nbytes = plan.host  # the arena the kernel is about to make, before it makes it (or none: it has one)
        self.host_account = self.host_account.promise(kernel_id, nbytes)
        self._host_base[kernel_id] = (tuple(pids), resident_bytes(pids))

    def _release_host(self, kernel_id: str) -> None:
        self.host_account = self.host_account.release(kernel_id)
        self._host_base.pop(kernel_id, None)

    def _note_landing(self) -> None:
        """What each park under way has brought to host memory so far: its processes' growth since its promise."""
        if self._host_base:
            landed = {k: resident_bytes(pids) - base for k, (pids, base) in self._host_base.items()}
            self.host_account = self.host_account.landing(landed)

    def _review_host(self, now: float) -> None:
        """Host memory short with kernels parked (another program took it): stop parking, tell the admin once,
        and bring parked kernels back where the device has room (the broker's background resumes, largest first)
        rather than leave the OOM killer to choose a process. Ends once the margin is free again."""
        reading = self.host_reading()
        parked = sum(sum(r.parked.values()) for r in self.records.values() if r.state in ("parked", "waiting"))
        was_short = self.host_short_since is not None
        # The arenas kept by running kernels are this server's memory on the host as much as parked bytes are.
        short = host_short(reading, parked + sum(self._kept_arenas().values()), self.settings.host_margin, was_short)
        if short and not was_short:
            self.host_short_since = now
            self.host_short_episodes += 1
            self.host_short_reason = host_short_words(reading, parked)
            log.warning("gpu-quota-ext: %s", self.host_short_reason)
        if short and self.channel is not None and not self._releasing_arenas and self._kept_arenas():
            # The cheapest memory to give back: pinned for a next park, holding nothing now.
            self._spawn(self._release_every_arena("host memory is short"))
        elif was_short and not short:
            log.warning(
                "gpu-quota-ext: host memory is back (%s available): parking goes on",
                format_bytes(reading.least() or 0),
            )
            self.host_short_since = None
            self.host_short_reason = None

    def host_json(self) -> dict:
        """The status's "host_memory": what the host has, what parks under way will still bring, and whether it ran
        short (then nothing parks and parked kernels come back where the device has room)."""
        reading = self.host_reading()
        return {
            "available": reading.available,
            "cgroup_room": reading.cgroup_room,
            "promised": self.host_account.outstanding(),
            "parked": sum(sum(r.parked.values()) for r in self.records.values() if r.state in ("parked", "waiting")),
            "margin": self.settings.host_margin,
            "short": self.host_short_since is not None,
            "short_since": self.host_short_since,
            "reason": self.host_short_reason,
            "short_episodes": self.host_short_episodes,
        }

    async def _restore(self, kernel_id: str, op: int, pids: Tuple[int, ...]) -> None:
        record = self.records[kernel_id]
        need = dict(record.parked)
        # Restores granted to other kernels and not yet seen: the memory they are about to take.
        others: Dict[int, int] = {}
        for other_id, other in self.records.items():
            if other_id != kernel_id and other.state == "resuming":
                for index, nbytes in other.room.items():
                    others[index] = others.get(index, 0) + nbytes
        totals = {index: device.total for index, device in self.devices.items()}

        plan = self._pages_plan(kernel_id)
        keep = True
        if plan is not None:
            # The arena is still held (in the reading): what the host would have without it is the reading plus it.
            available = self.host_reading().least()
            keep = available is not None and keep_arena(plan.arena, available + plan.arena, self.settings.host_margin)
        driver = self._driver_for(kernel_id, plan, keep)
        go_freeing = self._go_freeing.pop(kernel_id, {})
        # A fast resume may count on what fast parks under way are freeing (a swap), and waits for it inside the
        # kernel, bounded; the checkpoint path's restore counts only what is free now: it cannot wait or give back.
        freeing: Dict[int, int] = {}
        if isinstance(driver, PagesDriver):
            freeing = self._swap_freeing(kernel_id, need, go_freeing)
            driver.wait_for_room = min(SWAP_WAIT, self.settings.call_timeout / 2) if freeing else 0.0

        def checked_restore() -> Union[str, bool]:
            with self._restoring:  # one restore at a time: each one's check sees the ones before it done
                short = room_right_now(
                    need, totals, self.monitor.device_used_now, others, self.settings.device_margin, freeing
                )
                if short is not None:
                    return short
                return resume_processes(driver, pids)

        outcome = await self._drive(kernel_id, op, "restore", checked_restore)
        if plan is not None and isinstance(driver, PagesDriver) and self._plans.get(kernel_id) is plan:
            back = outcome is True  # resume_processes: every process back (a str: not asked; an error)
            kept = back and keep
            self._plans[kernel_id] = replace(
                plan,
                resume_seconds=driver.seconds,
                resume_waited_seconds=driver.waited,
                arena_kept=plan.arena if kept else 0,
                arena_pids=tuple(pids) if kept else (),
            )
        if isinstance(outcome, CheckpointError) and not any(psutil.pid_exists(pid) for pid in pids):
            # Its processes ended while the call ran (the kernel shut down, or killed: the restarter's notice says
            # why): the restore lost nothing, and nothing is left to restore. Gone, as a kernel whose processes
            # exited while parked, not "its GPU state is lost" (a restore into a full device). A pid reused since
            # keeps the loss: the safe reading.
            log.info("gpu-quota-ext: kernel %s: its processes ended during the restore (%s)", kernel_id, outcome)
            outcome = False
        if isinstance(outcome, CheckpointError) and plan is not None:
            # The fast path's resume gives back what it took and keeps every byte on the host: the kernel is
            # parked and whole, and waits for room again (the checkpoint path's failed restore is for good).
            outcome = resume_deferred_reason(outcome.code, outcome.name, sum(need.values()))
            log.warning("gpu-quota-ext: kernel %s: the fast resume did not go through: %s", kernel_id, outcome)
        elif isinstance(outcome, str):
            log.warning("gpu-quota-ext: kernel %s: restore not asked: %s", kernel_id, outcome)
        if isinstance(outcome, str):
            self._handle_if_current(kernel_id, op, RestoreDeferred(op, outcome))
            self.monitor.sample_soon()  # the broker decides again on a reading taken after this one
        elif isinstance(outcome, CheckpointError):
            log.error("gpu-quota-ext: kernel %s: the restore failed (%s); its GPU state is lost", kernel_id, outcome)
            self._handle_if_current(kernel_id, op, ResumeDone(op, lost_reason(str(outcome), sum(need.values()))))
        else:
            self._handle_if_current(kernel_id, op, ResumeDone(op, None, gone=not outcome))

    # --- the kernel's iopub: busy and idle as they happen -------------------------------------------

    def _watch(self, kernel_id: str) -> None:
        """Follow the kernel's busy and idle as they happen while it is pending or parked, so that a cell asks for
        room at once (where the kernel has no iopub channel, the per-sample check still sees it)."""

        def on_state(state: str) -> None:
            if state == "busy":
                self.turned_busy(kernel_id)
            else:
                self.turned_idle(kernel_id)

        stop = self.kernels.watch_status(kernel_id, on_state)
        if stop is not None:
            self._streams[kernel_id] = stop

    def _unwatch(self, kernel_id: str) -> None:
        stop = self._streams.pop(kernel_id, None)
        if stop is not None:
            stop()

