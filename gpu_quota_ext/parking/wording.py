"""Parking in words: the reasons a park or resume did not happen, a call that has not returned, a lost kernel,
the log line of a transition, and a kernel's "park" object of the status answer. Pure.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ..shared.contract import PARK_FIELDS
from ..shared.park_state import ParkState
from ..shared.sizes import format_bytes
from .checkpoint import (
    CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_NOT_PERMITTED,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_TIMEOUT,
)
from .decisions import MPS_REASON
from .states import ParkRecord


def failure_reason(action: str, code: Optional[int], detail: str) -> str:
    """Why a park failed, in words; the driver's name and code kept."""
    if code == CUDA_ERROR_NOT_SUPPORTED:
        return f"did not {action}: {MPS_REASON.split(':', 1)[0]} or the driver cannot checkpoint it ({detail})"
    if code == CUDA_ERROR_NOT_PERMITTED:
        return f"did not {action}: the driver refuses another Unix user's process ({detail})"
    if code == CUDA_ERROR_TIMEOUT:
        return f"did not {action}: its GPU work did not finish in time for the lock ({detail})"
    if code == CUDA_ERROR_NOT_FOUND:
        return f"did not {action}: a process of the kernel has exited ({detail})"
    return f"did not {action}: {detail}"


def lost_reason(detail: str, host_bytes: Optional[int]) -> str:
    """What a failed restore means for the user, and what they can still do."""
    held = f" ({format_bytes(host_bytes)})" if host_bytes else ""
    return (
        f"its GPU memory{held} could not be brought back: {detail}. The driver cannot restore it again: what was "
        "on the GPU is lost. Variables in host memory are still there: save what you need (no GPU call will "
        "return), then restart the kernel; that frees its host memory"
    )


def stuck_reason(call: str, seconds: float) -> str:
    return (
        f"the driver's {call} has not returned after {seconds:.0f} s (park_call_timeout); the kernel stays as the "
        "driver has it until it does"
    )


def park_json(
    state: str,
    since: Optional[float],
    idle_for: Optional[float],
    host_bytes: Optional[int],
    parkable: bool,
    reason: Optional[str],
    waited: Optional[float] = None,
    wait_limit: Optional[float] = None,
    told: bool = False,
    room: Optional[str] = None,
    lost: Optional[dict] = None,
    path: Optional[dict] = None,
) -> Dict[str, Any]:
    """A kernel's "park" object (shared.contract.PARK_FIELDS)."""
    answer = {
        "state": state,
        "since": since,
        "idle_seconds": None if idle_for is None else round(idle_for, 1),
        "host_bytes": host_bytes,
        "parkable": parkable,
        "reason": reason,
        "waited": None if waited is None else round(waited, 1),
        "wait_limit": wait_limit,
        "told": told,
        "room": room,
        "lost": lost,
        "path": path,
    }
    assert tuple(answer) == PARK_FIELDS
    return answer


def describe_transition(kernel_id: str, old: str, new: str, record: ParkRecord) -> str:
    """One log line for a transition."""
    line = f"gpu-quota-ext: kernel {kernel_id} park state {old} -> {new}"
    if new == ParkState.PARKED and old == ParkState.PARKING:
        processes = ", ".join(map(str, record.pids))
        moved = sum(record.parked.values())
        line += f": {format_bytes(moved)} of GPU memory moved to host memory (processes {processes})"
    elif record.reason:
        line += f": {record.reason}"
    return line
