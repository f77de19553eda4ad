"""Parking, the decisions: a kernel's park state and what moves it, the idle timer, the host-memory
guard, resume retries with backoff. Pure: no I/O, no clock (callers pass `now`), no driver.

A kernel's state is one of shared.contract.PARK_STATES. `busy` and `idle` are jupyter_server's own view
of the kernel (its execution state); the rest are the parker's:

    idle/busy --park--> pending (busy: after the current cell) --idle--> parking --done--> parked
    parked --busy or resume--> resuming --done--> idle/busy
    resuming --out of device memory--> waiting --retry--> resuming
    parking --failed--> idle/busy, with the reason; anything --gone/restarted--> forgotten

A parked kernel keeps its grant: the ledger never hears of parking.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Mapping, Optional, Tuple

from ..settings import PARK, validated
from ..shared.contract import PARK_FIELDS, PARK_STATES
from ..shared.sizes import GiB, format_bytes
from .checkpoint import (
    CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_NOT_PERMITTED,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_TIMEOUT,
)

HELD = ("parking", "parked", "resuming", "waiting")  # the driver holds (or is moving) the kernel's GPU state
RETRY_FIRST = 1.0  # seconds before the first retry of a resume that found no device memory
RETRY_MOST = 30.0  # ... doubling up to this
LOCK_TIMEOUT_MS = 10_000  # how long the lock waits for a kernel's GPU work to finish before parking gives up
FRESH_SAMPLE_WAIT = 10.0  # seconds; then a park goes by the last sample
CALL_TIMEOUT = 600.0  # seconds a park or resume may take before its state says the driver does not answer

MPS_REASON = "an MPS client cannot be parked: the driver's checkpoint lock refuses it (CUDA_ERROR_NOT_SUPPORTED, 801)"


@dataclass(frozen=True)
class ParkSettings:
    idle_after: Optional[float] = None  # seconds idle before an automatic park; None: off
    host_margin: int = 2 * GiB  # host memory that must stay free beyond the kernel's GPU bytes
    call_timeout: float = CALL_TIMEOUT
    lock_timeout_ms: int = LOCK_TIMEOUT_MS
    fresh_sample_wait: float = FRESH_SAMPLE_WAIT  # seconds a park waits for a sample taken after it was asked

    def describe(self) -> dict:
        return {"park_idle_after": self.idle_after, "park_host_margin": self.host_margin}


def build_park_settings(*args: Any, **given: Any) -> ParkSettings:
    """The park settings (the table's PARK rows: in its order, or by name), validated; a SettingError names the
    bad one and its value."""
    return ParkSettings(**validated(PARK, args, given))


@dataclass(frozen=True)
class ParkRecord:
    """What the parker knows about one kernel beyond jupyter_server's busy/idle."""

    state: str  # one of PARK_STATES
    since: float  # wall clock
    pids: Tuple[int, ...] = ()  # the processes parked together
    gpu_bytes: Optional[Mapping[int, int]] = None  # device index -> bytes the kernel held when it parked
    host_bytes: Optional[int] = None
    reason: Optional[str] = None
    attempt: int = 0  # resume attempts that found no device memory
    resume_wanted: bool = False  # turned busy (or asked to resume) while parking: resume right after


def moved(record: ParkRecord, state: str, now: float, **changes: Any) -> ParkRecord:
    """`record` in `state` (since `now` when the state changes)."""
    assert state in PARK_STATES, state
    since = record.since if state == record.state else now
    return replace(record, state=state, since=since, **changes)


def activity_state(execution_state: Optional[str]) -> str:
    """jupyter_server's execution state as a park state: busy, or idle (starting, unknown, dead: not busy)."""
    return "busy" if execution_state == "busy" else "idle"


def idle_seconds(execution_state: Optional[str], last_activity: Optional[float], now: float) -> Optional[float]:
    if execution_state == "busy" or last_activity is None:
        return None
    return max(0.0, now - last_activity)


def not_parkable(
    driver_problem: Optional[str],
    mps_client: bool,
    has_devices: bool,
    gpu_bytes: int,
    pids: Tuple[int, ...],
    foreign: Tuple[int, ...] = (),
    stuck: Optional[str] = None,
) -> Optional[str]:
    """Why parking cannot work for this kernel now, or None. The first reason that applies, most basic first."""
    if driver_problem:
        return f"no checkpoint driver: {driver_problem}"
    if mps_client:
        return MPS_REASON
    if not has_devices:
        return "this kernel has no GPU"
    if stuck:
        return stuck
    if foreign:
        return (
            f"process {', '.join(map(str, foreign))} belongs to another Unix user; the driver parks only the server's "
            "own"
            " user's processes"
        )
    if not pids or gpu_bytes <= 0:
        return "this kernel holds no GPU memory"
    return None


def host_guard(gpu_bytes: int, available: Optional[int], cgroup_room: Optional[int], margin: int) -> Optional[str]:
    """Why host memory cannot take `gpu_bytes` now (None: it can). `available`: the host's available memory;
    `cgroup_room`: what the server's memory cgroup still allows (None: no limit). The GPU state goes to the
    parked processes' own memory, so both must hold it plus the margin."""
    needed = gpu_bytes + margin
    if available is not None and available < needed:
        return (
            f"did not park: the host has {format_bytes(available)} of memory available and parking needs "
            f"{format_bytes(gpu_bytes)} plus a margin of {format_bytes(margin)}"
        )
    if cgroup_room is not None and cgroup_room < needed:
        return (
            f"did not park: the server's memory cgroup has room for {format_bytes(cgroup_room)} more and parking needs "
            f"{format_bytes(gpu_bytes)} plus a margin of {format_bytes(margin)}"
        )
    return None


def due_for_park(settings: ParkSettings, state: str, idle_for: Optional[float]) -> bool:
    """The idle timer: an idle kernel past park_idle_after parks (when it can)."""
    return (
        settings.idle_after is not None and state == "idle" and idle_for is not None and idle_for >= settings.idle_after
    )


def retry_delay(attempt: int, first: float = RETRY_FIRST, most: float = RETRY_MOST) -> float:
    """Seconds before retry `attempt` (1, 2, ...) of a resume: doubling from `first`, at most `most`."""
    return min(most, first * (2 ** max(0, min(attempt - 1, 30))))


def is_out_of_memory(code: Optional[int]) -> bool:
    return code == CUDA_ERROR_OUT_OF_MEMORY


def waiting_reason(gpu_bytes: Mapping[int, int], attempt: int, delay: float) -> str:
    where = ", ".join(f"{format_bytes(n)} on GPU {i}" for i, n in sorted((gpu_bytes or {}).items())) or "its GPU memory"
    return (
        f"waiting for device memory others hold now: it needs {where}; retry {attempt} in {delay:.0f} s"
        " (nothing is lost, the grant is kept)"
    )


def failure_reason(action: str, call: str, code: Optional[int], detail: str) -> str:
    """Why a park or resume failed, in words; the driver's name and code kept."""
    if code == CUDA_ERROR_NOT_SUPPORTED:
        return f"did not {action}: {MPS_REASON.split(':', 1)[0]} or the driver cannot checkpoint it ({detail})"
    if code == CUDA_ERROR_NOT_PERMITTED:
        return f"did not {action}: the driver refuses another Unix user's process ({detail})"
    if code == CUDA_ERROR_TIMEOUT:
        return f"did not {action}: its GPU work did not finish in time for the lock ({detail})"
    if code == CUDA_ERROR_NOT_FOUND:
        return f"did not {action}: a process of the kernel has exited ({detail})"
    return f"did not {action}: {detail}"


def stuck_reason(call: str, seconds: float) -> str:
    return (
        f"the driver's {call} has not returned after {seconds:.0f} s; the kernel stays as the driver has it until "
        "it does"
    )


def park_json(
    state: str,
    since: Optional[float],
    idle_for: Optional[float],
    host_bytes: Optional[int],
    parkable: bool,
    reason: Optional[str],
) -> Dict[str, Any]:
    """A kernel's "park" object (shared.contract.PARK_FIELDS)."""
    answer = {
        "state": state,
        "since": since,
        "idle_seconds": None if idle_for is None else round(idle_for, 1),
        "host_bytes": host_bytes,
        "parkable": parkable,
        "reason": reason,
    }
    assert tuple(answer) == PARK_FIELDS
    return answer


def describe_transition(kernel_id: str, old: str, new: str, record: ParkRecord) -> str:
    """One log line for a transition."""
    line = f"gpu-quota-ext: kernel {kernel_id} park state {old} -> {new}"
    if new == "parked":
        processes = ", ".join(map(str, record.pids))
        line += f": {format_bytes(record.host_bytes)} of GPU memory moved to host memory (processes {processes})"
    elif record.reason:
        line += f": {record.reason}"
    return line
