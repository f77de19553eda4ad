"""Parking, the rules the parker applies before it asks anything of the driver: the settings, whether a kernel
can park at all, the idle timer, the host-memory guard. Pure: no I/O, no clock (callers pass `now`).

The kernel's state machine is states.py; the broker (which resume runs, who parks to make room) is broker.py;
the words the states are shown in are wording.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..settings import PARK, validated
from ..shared.park_state import ParkState
from ..shared.sizes import GiB
from .broker import BrokerSettings

LOCK_TIMEOUT_MS = 10_000  # how long the lock waits for a kernel's GPU work to finish before parking gives up
FRESH_SAMPLE_WAIT = 10.0  # seconds; then a park goes by the last sample
TRIM_TIMEOUT = 5.0  # seconds a kernel has to empty its allocators' caches before it parks with them

MPS_REASON = "an MPS client cannot be parked: the driver's checkpoint lock refuses it (CUDA_ERROR_NOT_SUPPORTED, 801)"


@dataclass(frozen=True)
class ParkSettings:
    idle_after: Optional[float] = None  # seconds idle before an automatic park; None: off
    host_margin: int = 2 * GiB  # host memory that must stay free beyond the kernel's GPU bytes
    min_idle: float = 60.0  # seconds idle before the broker may park a kernel to make room for another
    wait_limit: Optional[float] = 300.0  # seconds a cell waits for room before it is told; None: no limit
    device_margin: int = GiB  # device memory kept free beyond a restore's bytes
    call_timeout: float = 600.0  # seconds a driver call may take before the state says it has not returned
    on_device_full: str = "auto"  # "on": a kernel short of room under its cap gets room made; "auto": see below
    fast_park: str = "auto"  # "on"/"auto": torch kernels park by copying their pages (path.py chooses per kernel)
    lock_timeout_ms: int = LOCK_TIMEOUT_MS
    fresh_sample_wait: float = FRESH_SAMPLE_WAIT  # seconds a park waits for a sample taken after it was asked
    trim_timeout: float = TRIM_TIMEOUT

    def describe(self) -> dict:
        return {
            "park_idle_after": self.idle_after,
            "park_host_margin": self.host_margin,
            "park_min_idle": self.min_idle,
            "park_wait_limit": self.wait_limit,
            "park_device_margin": self.device_margin,
            "park_call_timeout": self.call_timeout,
            "park_on_device_full": self.on_device_full,
        }

    @property
    def broker(self) -> BrokerSettings:
        return BrokerSettings(
            device_margin=self.device_margin,
            host_margin=self.host_margin,
            min_idle=self.min_idle,
            wait_limit=self.wait_limit,
        )


def on_device_full_for(choice: str, overcommit: Optional[float]) -> str:
    """park_on_device_full's "auto" (the default): "on" where caps may add up to more than a device (overcommit
    above 1, or no admission control), because there idle kernels can hold the room a running kernel's cap
    promises, and only parking them keeps that promise; "off" where every cap fits beside the others (a full
    device there is memory taken outside the quota, which parking cannot give back)."""
    if choice != "auto":
        return choice
    return "on" if overcommit is None or overcommit > 1 else "off"


def build_park_settings(*args: Any, **given: Any) -> ParkSettings:
    """The park settings (the table's PARK rows: in its order, or by name), validated; a SettingError names the
    bad one and its value."""
    return ParkSettings(**validated(PARK, args, given))


def activity_state(execution_state: Optional[str]) -> str:
    """jupyter_server's execution state as a park state: busy, or idle (starting, unknown, dead: not busy)."""
    return ParkState.BUSY if execution_state == "busy" else ParkState.IDLE


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
    unreadable: Tuple[int, ...] = (),
    broker_problem: Optional[str] = None,
) -> Optional[str]:
    """Why parking cannot work for this kernel now, or None. The first reason that applies, most basic first.
    `unreadable`: the kernel's GPUs NVML could not read in the last sample (what it holds there is unknown,
    which is not nothing); `broker_problem`: why nothing could give a parked kernel room to come back to."""
    if driver_problem:
        return f"no checkpoint driver: {driver_problem}"
    if broker_problem:
        return broker_problem
    if mps_client:
        return MPS_REASON
    if not has_devices:
        return "this kernel has no GPU"
    if stuck:
        return stuck
    if foreign:
        return (
            f"process {', '.join(map(str, foreign))} belongs to another Unix user; the driver parks only the "
            "server's own user's processes"
        )
    if unreadable:
        where = ", ".join(f"GPU {i}" for i in unreadable)
        return f"what it holds on {where} is unknown: NVML could not read {'it' if len(unreadable) == 1 else 'them'}"
    if not pids or gpu_bytes <= 0:
        return "this kernel holds no GPU memory"
    return None


def due_for_park(settings: ParkSettings, state: str, idle_for: Optional[float]) -> bool:
    """The idle timer: an idle kernel past park_idle_after parks (when it can)."""
    return (
        settings.idle_after is not None and state == "idle" and idle_for is not None and idle_for >= settings.idle_after
    )
