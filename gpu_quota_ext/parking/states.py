"""A kernel's parking, as a state machine: one record per kernel and a pure `transition(record, event, now)` that
returns the next record and the effects the parker (parker.py) carries out. No I/O, no clock.

    running --park (idle)--> parking --checked--> parking --done--> parked
    running --its allocation found the device full (ask room)--> running, asking --room made or told--> running
    running --park (busy)--> pending --idle--> parking
    parking --a cell began before the driver was asked--> pending (a user's park) or running (called off)
    parking --a resume was asked before the driver was asked--> running (called off)
    parking --refused, failed--> running (with the reason; no automatic park until it is busy again)
    parked --a cell (busy) or a resume request--> waiting --room granted--> resuming --done--> running
    waiting --the cell ended--> parked            waiting --the wait limit--> told (a request ends: parked)
    resuming --the room was gone when read afresh, right before the call--> waiting (nothing was asked)
    resuming --the restore failed--> lost (for good: the driver cannot restore it again)
    anything --gone (shut down, restarted, dead)--> no record

`running` shows as jupyter_server's own busy or idle. A restore is asked (the effect `Restore`) only on
`RoomGranted`, the broker's word that room is reserved for it, and only once per park: a failed restore leaves
the process checkpointed for good (NVIDIA's driver answers every later call with 304), so the kernel is `lost`,
its user told what is lost and what they can still do, and nothing is retried.

Effects carry the record's `op`, the number of the driver call they start; the parker hands it back with the
call's outcome, and an outcome whose op is not the record's (a kernel restarted meanwhile) changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Tuple, Union

from ..shared.park_state import ParkState

# The record's states: ParkState's, where the parker holds (or is about to move) the kernel's GPU state, and RUNNING,
# where it holds nothing: the record's own word, never on the wire (the kernel is shown as jupyter_server's BUSY or
# IDLE; shown.py decides what the broker sees).
RUNNING = "running"
LOST = ParkState.LOST  # a restore failed: its GPU state cannot come back
# HELD: the driver holds (or is moving) its GPU state
HELD = (ParkState.PARKING, ParkState.PARKED, ParkState.WAITING, ParkState.RESUMING, LOST)
STATES = (RUNNING, ParkState.PENDING) + HELD
CELL, REQUEST = "cell", "request"  # why a parked kernel waits for room: a cell of its own, or a resume request


@dataclass(frozen=True)
class ParkRecord:
    """What the parker knows of one kernel beyond jupyter_server's busy/idle."""

    state: str = RUNNING  # RUNNING or a ParkState (STATES)
    since: float = 0.0  # wall clock when the state began
    pids: Tuple[int, ...] = ()  # the processes parked together
    parked: Mapping[int, int] = field(default_factory=dict)  # device -> bytes moved (or moving) to the host
    reason: Optional[str] = None  # what it waits for, why its last park did not happen, what was lost
    refused: bool = False  # its last park did not happen: no automatic park until it has been busy again
    resume_wanted: Optional[str] = None  # CELL or REQUEST: turned busy or was asked to resume while parking
    automatic: bool = False  # the park under way was not a user's request (the idle timer, a broker)
    demand: Optional[str] = None  # CELL or REQUEST: why it waits for room (waiting)
    waiting_since: Optional[float] = None
    told: bool = False  # its wait passed the limit and it was told so
    stuck: Optional[str] = None  # a driver call that has not returned
    op: int = 0  # the number of its latest driver call
    room: Mapping[int, int] = field(default_factory=dict)  # bytes reserved for its restore ...
    room_until: Optional[float] = None  # ... until a sample taken after this (the restore's end) shows them
    deferred_at: Optional[float] = None  # its restore was not asked (no room right then): no new grant until a
    # sample taken after this has been seen (the broker would decide on the same old reading again)
    room_need: Mapping[int, int] = field(default_factory=dict)  # a running kernel found the device full: the room
    # it asked for, up to its cap (park_on_device_full), while the broker makes it
    room_asked: Optional[float] = None  # when it asked; once answered, when the answer came
    room_outcome: Optional[str] = None  # "made" or "told": how its last ask ended (until it asks again or parks)

    @property
    def shows_park(self) -> bool:
        """Its state is the parker's, not jupyter_server's busy/idle."""
        return self.state != RUNNING


# --- events -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Busy:
    """The kernel began handling a request (a cell, a widget message)."""


@dataclass(frozen=True)
class Idle:
    """The kernel finished handling it."""


@dataclass(frozen=True)
class AskPark:
    why: str  # "user request", "idle for 30 min", "to make room for kernel ..."
    problem: Optional[str]  # why it cannot park now (decisions.not_parkable), or None
    busy: bool
    automatic: bool = False


@dataclass(frozen=True)
class AskResume:
    why: str = "user request"


@dataclass(frozen=True)
class AskRoom:
    """A running kernel's allocation found the device full: make room up to its cap (`need`, by device)."""

    need: Mapping[int, int]


@dataclass(frozen=True)
class ParkChecked:
    """The parker's look right before the driver is asked: the kernel's processes and bytes now, or why not."""

    op: int
    pids: Tuple[int, ...]
    parked: Mapping[int, int]
    refused: Optional[str]


@dataclass(frozen=True)
class ParkDone:
    op: int
    error: Optional[str]  # None: parked


@dataclass(frozen=True)
class RoomGranted:
    """The broker reserved room for the restore."""


@dataclass(frozen=True)
class RoomWait:
    reason: str


@dataclass(frozen=True)
class RoomTold:
    message: str


@dataclass(frozen=True)
class ResumeDone:
    op: int
    error: Optional[str]  # None: running again
    gone: bool = False  # its processes exited meanwhile: nothing to restore


@dataclass(frozen=True)
class RestoreDeferred:
    """Right before the driver call the room was not there any more (read afresh): no restore was asked."""

    op: int
    reason: str


@dataclass(frozen=True)
class Stuck:
    op: int
    reason: Optional[str]  # None: the call has returned


@dataclass(frozen=True)
class Sampled:
    """A sample came in, taken at `taken` (wall clock)."""

    taken: float


Event = Union[
    Busy,
    Idle,
    AskPark,
    AskResume,
    AskRoom,
    ParkChecked,
    ParkDone,
    RoomGranted,
    RoomWait,
    RoomTold,
    ResumeDone,
    RestoreDeferred,
    Stuck,
    Sampled,
]

# --- effects ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartPark:
    """Empty the kernel's caches, take a fresh sample, then answer ParkChecked."""

    op: int


@dataclass(frozen=True)
class Checkpoint:
    op: int
    pids: Tuple[int, ...]


@dataclass(frozen=True)
class Restore:
    op: int
    pids: Tuple[int, ...]


@dataclass(frozen=True)
class Decide:
    """What the broker decides may have changed: ask it."""


Effect = Union[StartPark, Checkpoint, Restore, Decide]
Effects = Tuple[Effect, ...]


def moved(record: ParkRecord, state: str, now: float, **changes) -> ParkRecord:
    """`record` in `state` (since `now` when the state changes)."""
    assert state in STATES, state
    since = record.since if state == record.state else now
    return replace(record, state=state, since=since, **changes)


def running(record: ParkRecord, now: float, reason: Optional[str] = None, refused: bool = False) -> ParkRecord:
    """Back on the device: nothing of the park kept but the reservation of a restore just ended (and a running
    kernel's own ask for room, which a park of it does not change)."""
    return ParkRecord(
        room_need=record.room_need,
        room_asked=record.room_asked,
        room_outcome=record.room_outcome,
        state=RUNNING,
        since=now if record.state != RUNNING else record.since,
        reason=reason,
        refused=refused,
        op=record.op,
        room=record.room,
        room_until=record.room_until,
    )


def transition(record: ParkRecord, event: Event, now: float) -> Tuple[ParkRecord, Effects]:
    """The next record and what the parker must do. Pure: the same inputs give the same answer."""
    state = record.state
    if isinstance(event, Sampled):
        if record.deferred_at is not None and event.taken > record.deferred_at:
            return replace(record, deferred_at=None), (Decide(),)
        if record.room_until is not None and event.taken > record.room_until:
            return replace(record, room={}, room_until=None), (Decide(),)
        return record, ()
    if isinstance(event, Stuck):
        if event.op != record.op or state not in (ParkState.PARKING, ParkState.RESUMING):
            return record, ()
        return replace(record, stuck=event.reason), ()
    if state == RUNNING:
        return _running(record, event, now)
    if state == ParkState.PENDING:
        return _pending(record, event, now)
    if state == ParkState.PARKING:
        return _parking(record, event, now)
    if state == ParkState.PARKED:
        return _parked(record, event, now)
    if state == ParkState.WAITING:
        return _waiting(record, event, now)
    if state == ParkState.RESUMING:
        return _resuming(record, event, now)
    return record, ()  # lost: nothing brings it back; a restart or shutdown forgets it


def _begin_park(record: ParkRecord, now: float, why: Optional[str], automatic: bool) -> Tuple[ParkRecord, Effects]:
    op = record.op + 1
    parking = moved(
        record, ParkState.PARKING, now, op=op, reason=why, refused=False, resume_wanted=None, pids=(), parked={},
        room_need={}, room_asked=None, room_outcome=None, automatic=automatic,
    )
    return parking, (StartPark(op),)


def _running(record: ParkRecord, event: Event, now: float) -> Tuple[ParkRecord, Effects]:
    if isinstance(event, AskRoom):
        if not event.need:
            return record, ()
        asked = replace(record, room_need=dict(event.need), room_asked=now, room_outcome=None, reason=None)
        return asked, (Decide(),)
    if record.room_need and isinstance(event, (RoomGranted, RoomWait, RoomTold)):
        if isinstance(event, RoomWait):
            return (replace(record, reason=event.reason) if event.reason != record.reason else record), ()
        made = isinstance(event, RoomGranted)
        reason = "room made: the device has its cap free now" if made else event.message  # type: ignore[union-attr]
        done = replace(record, room_need={}, room_asked=now, room_outcome="made" if made else "told", reason=reason)
        return done, ()
    if isinstance(event, Busy):
        if record.room_need or record.room_outcome:
            return record, ()  # its ask for room, and how it went, are said until it asks again or parks
        if record.refused or record.reason:
            return replace(record, refused=False, reason=None), ()
        return record, ()
    if isinstance(event, AskPark):
        if event.problem is not None:
            return replace(record, refused=True, reason=event.problem), ()
        if event.busy:
            reason = f"parks when its current cell has finished ({event.why})"
            return moved(record, ParkState.PENDING, now, reason=reason, refused=False), ()
        return _begin_park(record, now, event.why if event.automatic else None, event.automatic)
    return record, ()


def _pending(record: ParkRecord, event: Event, now: float) -> Tuple[ParkRecord, Effects]:
    if isinstance(event, Idle):
        return _begin_park(record, now, None, False)
    if isinstance(event, AskResume):
        return running(record, now), ()
    return record, ()


def _parking(record: ParkRecord, event: Event, now: float) -> Tuple[ParkRecord, Effects]:
    if isinstance(event, ParkChecked) and event.op == record.op:
        if event.refused is not None:
            return running(record, now, reason=event.refused, refused=True), (Decide(),)
        if record.resume_wanted == CELL and not record.automatic:
            # A cell began before the driver was asked: a user's park waits for it to finish, as asked while busy.
            reason = "parks when its current cell has finished (user request)"
            return moved(record, ParkState.PENDING, now, reason=reason, resume_wanted=None), ()
        if record.resume_wanted is not None:
            # A cell began (or a resume was asked) before the driver was asked: a busy kernel is not parked.
            return running(record, now), (Decide(),)
        return replace(record, pids=event.pids, parked=dict(event.parked)), (Checkpoint(record.op, event.pids),)
    if isinstance(event, ParkDone) and event.op == record.op:
        if event.error is not None:
            return running(record, now, reason=event.error, refused=True), (Decide(),)
        parked = moved(record, ParkState.PARKED, now, reason=None, stuck=None)
        if record.resume_wanted is not None:
            return _want_room(parked, record.resume_wanted, now)
        return replace(parked, resume_wanted=None), (Decide(),)
    if isinstance(event, Busy):
        return replace(record, resume_wanted=CELL), ()
    if isinstance(event, AskResume):
        return replace(record, resume_wanted=REQUEST), ()
    if isinstance(event, Idle) and record.resume_wanted == CELL:
        return replace(record, resume_wanted=None), ()  # the cell ended without needing the GPU
    if isinstance(event, AskPark):
        return replace(record, resume_wanted=None), ()
    return record, ()


def _want_room(record: ParkRecord, demand: str, now: float) -> Tuple[ParkRecord, Effects]:
    waiting = moved(
        record,
        ParkState.WAITING,
        now,
        demand=demand,
        waiting_since=now,
        told=False,
        resume_wanted=None,
        reason="asking for device memory to come back to",
    )
    return waiting, (Decide(),)


def _parked(record: ParkRecord, event: Event, now: float) -> Tuple[ParkRecord, Effects]:
    if isinstance(event, Busy):
        return _want_room(record, CELL, now)
    if isinstance(event, AskResume):
        return _want_room(record, REQUEST, now)
    return record, ()


def _back_to_parked(record: ParkRecord, now: float, reason: Optional[str], told: bool = False) -> ParkRecord:
    """Parked again, nobody waiting. `told`: it got here because its wait passed the limit, which stays said
    (the status's `told`, with the reason) until its next wait begins."""
    return moved(
        record, ParkState.PARKED, now, demand=None, waiting_since=None, told=told, reason=reason, deferred_at=None
    )


def _waiting(record: ParkRecord, event: Event, now: float) -> Tuple[ParkRecord, Effects]:
    if isinstance(event, RoomGranted):
        if record.deferred_at is not None:
            return record, ()  # a grant decided on the reading that was found wrong: wait for a newer one
        op = record.op + 1
        resuming = moved(record, ParkState.RESUMING, now, op=op, reason=None, room=dict(record.parked), room_until=None)
        return resuming, (Restore(op, record.pids),)
    if isinstance(event, RoomWait):
        return (replace(record, reason=event.reason) if event.reason != record.reason else record), ()
    if isinstance(event, RoomTold):
        if record.demand == REQUEST:
            return _back_to_parked(record, now, event.message, told=True), (Decide(),)
        return replace(record, told=True, reason=event.message), ()
    if isinstance(event, Idle) and record.demand == CELL:
        # The cell ended (the kernel side gave up at the limit, or the user interrupted it): nobody waits now.
        told = record.told
        return _back_to_parked(record, now, record.reason if told else None, told=told), (Decide(),)
    if isinstance(event, Busy) and record.demand == REQUEST:
        return replace(record, demand=CELL), ()
    if isinstance(event, AskPark) and record.demand == REQUEST:
        return _back_to_parked(record, now, None), (Decide(),)
    return record, ()


def _resuming(record: ParkRecord, event: Event, now: float) -> Tuple[ParkRecord, Effects]:
    if isinstance(event, RestoreDeferred) and event.op == record.op:
        # Nothing was asked of the driver: the kernel waits for room again, as long as it has waited already.
        waiting = moved(record, ParkState.WAITING, now, reason=event.reason, room={}, room_until=None, stuck=None)
        return replace(waiting, deferred_at=now), ()
    if not isinstance(event, ResumeDone) or event.op != record.op:
        return record, ()
    if event.error is None or event.gone:
        back = replace(record, room_until=now) if not event.gone else replace(record, room={}, room_until=None)
        reason = "its processes exited while it was parked" if event.gone else None
        return running(back, now, reason=reason), (Decide(),)
    lost = moved(record, LOST, now, reason=event.error, room={}, room_until=None, stuck=None, demand=None)
    return lost, (Decide(),)
