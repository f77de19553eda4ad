"""Parking as structured events, through jupyter_server's event system (jupyter_events), the way jupyter_server
reports its own kernel actions (event_schemas/kernel_actions/v1.yaml): an admin's tools follow parks, resumes,
refusals and losses by schema id and fields instead of parsing the log's prose. The log lines stay, for people.

One schema per event, in event_schemas/<name>/v1.yaml beside this module (shipped in the wheel with the
package). Their ids follow jupyter_server's own scheme, https://events.jupyter.org/<package>/<event>/v<n>: a tool
that already routes jupyter_server's events routes these the same way, and the project has no address of its
own to name them by (pyproject.toml: no [project.urls]). An id is a name, never fetched.

`transition_event(kernel_id, old, new, seen)` is the pure part: two records of one kernel (states.ParkRecord) and
what the parker saw beside them give one event or None. `loss_event` is the same for a held kernel whose process
died (no transition: the restarter reports it). `send` is the I/O: one emit, a bad event logged, never raised.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, NamedTuple, Optional, Protocol

from jsonschema.exceptions import ValidationError  # type: ignore[import-untyped]  # no stubs, no py.typed

from ..shared.park_state import ParkState
from .path import CHECKPOINT
from .states import CELL, LOST, RUNNING, ParkRecord

if TYPE_CHECKING:  # jupyter_server's own class, for the signatures only
    from jupyter_server.serverapp import ServerApp

log = logging.getLogger("gpu_quota_ext")

SCHEMAS = Path(__file__).parent / "event_schemas"
BASE = "https://events.jupyter.org/gpu_quota_ext"
PARK = f"{BASE}/park/v1"
RESUME = f"{BASE}/resume/v1"
REFUSAL = f"{BASE}/refusal/v1"
LOSS = f"{BASE}/loss/v1"
SCHEMA_IDS = (PARK, RESUME, REFUSAL, LOSS)

# Who asked for a park or a resume (the events' "asked_by").
USER = "user"  # the REST route: the sidebar, a script, %gpucap in the kernel itself
TIMER = "timer"  # the idle timer (park_idle_after)
BROKER = "broker"  # this server's broker, to make room for another of its kernels
HOST_SERVICE = "host_service"  # the hub host's service, to make room for a kernel of the host
ASKED_BY_CELL = "cell"  # a cell sent to a parked kernel
HOST_MEMORY = "host_memory"  # host memory ran short: the server brings parked kernels back


def schema_path(schema_id: str) -> Path:
    """The YAML file of one of SCHEMA_IDS."""
    return SCHEMAS / (schema_id[len(BASE) + 1:] + ".yaml")


class ParkEvent(NamedTuple):
    schema_id: str
    data: Dict[str, Any]


@dataclass(frozen=True)
class Seen:
    """What the parker knows beside the two records when it stores the second one."""

    shown_before: str  # the state the kernel was shown in (a ParkState; busy or idle where the record is RUNNING)
    shown_after: str
    asked_by: Optional[str] = None  # who asked for the kernel's latest park or resume (USER, TIMER, ...)
    path: str = CHECKPOINT  # the way its park went (path.PAGES or path.CHECKPOINT)
    host_bytes: Optional[int] = None  # the pages path's new host memory (its arena); None: the bytes moved
    at: Optional[float] = None  # when (wall clock); None: when the new record's state began


def transition_event(kernel_id: str, old: ParkRecord, new: ParkRecord, seen: Seen) -> Optional[ParkEvent]:
    """The event of one stored change of a kernel's record, or None. Pure."""
    held = sum(old.parked.values())
    if old.state == ParkState.PARKING and new.state == ParkState.PARKED:
        moved = sum(new.parked.values())
        return ParkEvent(PARK, {
            "kernel_id": kernel_id,
            "state": ParkState.PARKED.value,
            "path": seen.path,
            "bytes": moved,
            "host_bytes": moved if seen.host_bytes is None else seen.host_bytes,
            "seconds": _seconds(old.since, new.since),
            "asked_by": seen.asked_by or USER,
            "reason": old.reason,  # what the status said while it parked; a user's park says nothing
        })
    if old.state == ParkState.RESUMING and new.state == RUNNING:
        gone = new.reason is not None  # states._resuming: only "its processes exited" comes back with a reason
        return ParkEvent(RESUME, {
            "kernel_id": kernel_id,
            "state": str(seen.shown_after),
            "path": seen.path,
            "bytes": 0 if gone else held,
            "seconds": _seconds(old.since, new.since),
            "waited": _seconds(old.waiting_since, old.since) if old.waiting_since is not None else None,
            "asked_by": _resume_asker(old, seen),
            "reason": new.reason,
        })
    if old.state == ParkState.RESUMING and new.state == LOST:
        return ParkEvent(LOSS, {
            "kernel_id": kernel_id,
            "cause": "restore_failed",
            "state": LOST.value,
            "reason": new.reason or "",
            "bytes": held,
            "exit_code": None,
        })
    if old.state == ParkState.RESUMING and new.state == ParkState.WAITING and new.reason:
        return _refusal(kernel_id, "resume", new.reason, seen, _resume_asker(old, seen),
                        _seconds(old.since, new.since), held)
    if new.told and not old.told and new.reason and old.state == ParkState.WAITING:
        now = seen.at if seen.at is not None else new.since  # a cell's wait told goes on waiting: no new since
        waited = _seconds(old.waiting_since, now) if old.waiting_since is not None else None
        return _refusal(kernel_id, "wait", new.reason, seen, _resume_asker(old, seen), waited, held)
    if new.state == RUNNING and new.refused and new.reason:
        if old.state == RUNNING and old.refused and old.reason == new.reason:
            return None  # said already; said again once the kernel has run a cell (Busy clears it)
        under_way = _seconds(old.since, new.since) if old.state == ParkState.PARKING else 0.0
        return _refusal(kernel_id, "park", new.reason, seen, seen.asked_by or USER, under_way, None)
    return None


def loss_event(kernel_id: str, record: ParkRecord, why: str, exit_code: Optional[int]) -> ParkEvent:
    """The event of a held kernel whose process died (lost.py's notice says `why`). Pure."""
    return ParkEvent(LOSS, {
        "kernel_id": kernel_id,
        "cause": "process_ended",
        "state": str(record.state),
        "reason": why,
        "bytes": sum(record.parked.values()),
        "exit_code": exit_code,
    })


def _refusal(
    kernel_id: str, action: str, reason: str, seen: Seen, asked_by: str, seconds: Optional[float],
    nbytes: Optional[int],
) -> ParkEvent:
    return ParkEvent(REFUSAL, {
        "kernel_id": kernel_id,
        "action": action,
        "state": str(seen.shown_after),
        "reason": reason,
        "asked_by": asked_by,
        "seconds": seconds,
        "bytes": nbytes,
    })


def _resume_asker(record: ParkRecord, seen: Seen) -> str:
    """A cell of its own, or the one who asked (a user, or the server where host memory ran short)."""
    if record.demand == CELL:
        return ASKED_BY_CELL
    return seen.asked_by if seen.asked_by in (USER, HOST_MEMORY) else USER


def _seconds(start: Optional[float], end: float) -> float:
    return round(max(0.0, end - (start if start is not None else end)), 3)


# --- the I/O: jupyter_server's event logger -------------------------------------------------------------


class EventSink(Protocol):
    """What the parker needs of jupyter_events.EventLogger."""

    def emit(self, *, schema_id: str, data: Dict[str, Any]) -> Optional[Dict[str, Any]]: ...


def park_event_logger(serverapp: Optional[ServerApp]) -> Optional[EventSink]:
    """The server's event logger with the park events' schemas registered, or None where the server has none
    (a jupyter_server before the event system): then nothing is emitted, and the log says it all as before."""
    event_logger = getattr(serverapp, "event_logger", None)
    if event_logger is None:
        return None
    registered = set(getattr(getattr(event_logger, "schemas", None), "schema_ids", ()))
    for schema_id in SCHEMA_IDS:
        if schema_id not in registered:  # a second extension app on the same server registers nothing twice
            event_logger.register_event_schema(schema_path(schema_id))
    return event_logger


def send(sink: Optional[EventSink], event: Optional[ParkEvent]) -> None:
    """Emit `event` (None: nothing happened worth one). An event its own schema refuses is this module's bug: it
    is logged with its data and dropped, and the parker goes on (its log line has been written)."""
    if sink is None or event is None:
        return
    try:
        sink.emit(schema_id=event.schema_id, data=event.data)
    except ValidationError as error:
        log.error("gpu-quota-ext: the event %s was not emitted, its data do not match its schema (%s): %r",
                  event.schema_id, error.message, event.data)

