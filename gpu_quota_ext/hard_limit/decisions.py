"""Pure: the hard limit a kernel gets from NVIDIA MPS, and why a kernel gets none.

MPS enforces a per-client limit in the driver, at allocation time, for every allocator, read from
`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` when the client's CUDA context is created (measured, docs/measurements.md):
"10G" means 10 GiB, the ordinal is the device as the process sees it (after CUDA_VISIBLE_DEVICES),
and the CUDA context itself counts against the limit (about 514 MiB under a 10 GiB limit). So a
kernel's limit is the number policy chose (its max_cap, or its cap) plus a context allowance, written
in whole MiB, rounded down, never above the device.

MPS serves one Linux user at a time: a client of another uid waits (hangs at its first CUDA call)
until the running MPS server's clients are gone. A kernel is therefore given the hard layer only when
the daemon answered just before its start and no MPS server of another uid runs there.

No I/O here: the daemon, the probe and the processes are mps.py's.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from ..devices import Device, parse_cuda_visible_devices
from ..ledger import Grant
from ..policy import Policy
from ..settings import DEFAULTS, HARD_CAP, default_of, validated
from ..shared.env_vars import LAYERS
from ..shared.sizes import GiB, MiB, format_bytes

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # where MPS looks when CUDA_MPS_PIPE_DIRECTORY is unset
# 640 MiB: the measured context is 514 MiB (538,968,064 B) on an H200, CUDA 13
DEFAULT_CONTEXT_ALLOWANCE: int = default_of("mps_context_allowance")

LIMIT_VARIABLE = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
PIPE_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY"
LOG_VARIABLE = "CUDA_MPS_LOG_DIRECTORY"

# --- settings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HardLimitSettings:
    """The admin's hard-limit settings, validated (c.GpuQuota.hard_cap, mps_*, hard_limit)."""

    mode: str = default_of("hard_cap")  # "off", "auto" (MPS when usable) or "mps" (required)
    daemon: str = default_of("mps_daemon")  # "managed" (this server starts and stops one) or "external" (an admin's)
    limit: str = default_of("hard_limit")  # which number goes in the limit: the kernel's "max_cap" or its "cap"
    context_allowance: int = DEFAULT_CONTEXT_ALLOWANCE
    control: str = default_of("mps_control")
    timeout: float = default_of("mps_timeout")  # seconds any one call of the control program may take

    def describe(self) -> dict:
        """As the status answer shows them: `limit` under its setting's name, and without the control
        program (a path on the server)."""
        shown = asdict(self)
        del shown["control"]
        shown["hard_limit"] = shown.pop("limit")
        return shown


def build_hard_limit_settings(*args: Any, **given: Any) -> HardLimitSettings:
    """The hard limit's settings (the table's HARD_CAP rows: in its order, or by name), validated; a
    SettingError (a PolicyError) names the first bad one and its value."""
    return HardLimitSettings(**validated(HARD_CAP, args, given))


# --- the limit of one kernel ----------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceLimit:
    index: int  # the server's device index (ledger, API)
    ordinal: int  # the device as the kernel's CUDA numbers it
    limit: int  # bytes the driver lets the process hold on it, CUDA context included
    usable: int  # the number policy chose (max_cap or cap): what the kernel's own allocations may reach


def hard_limit_bytes(number: int, total: int, allowance: int) -> int:
    """`number` + the context allowance, never above the device, in whole MiB (rounded down)."""
    return (min(number + allowance, total) // MiB) * MiB


def kernel_ordinals(grant: Grant, devices: Mapping[int, Device], env: Mapping[str, str]) -> Dict[int, int]:
    """{server device index: the ordinal the kernel's CUDA gives it}.

    A placed kernel sees its devices in grant order (launch_env writes CUDA_VISIBLE_DEVICES so); an
    unplaced one sees what its environment's CUDA_VISIBLE_DEVICES keeps, or every device in NVML
    (PCI bus) order. Devices the kernel cannot see get no entry.
    """
    if grant.placed:
        return {index: ordinal for ordinal, index in enumerate(grant.devices)}
    visible = parse_cuda_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    ordinals: Dict[int, int] = {}
    for index in grant.devices:
        device = devices[index]
        if visible is None:
            ordinals[index] = device.nvml_number
            continue
        for position, entry in enumerate(visible):
            if device.matches(entry):
                ordinals[index] = position
                break
    return ordinals


def device_limits(
    grant: Grant, devices: Mapping[int, Device], env: Mapping[str, str], settings: HardLimitSettings
) -> Tuple[DeviceLimit, ...]:
    """The kernel's hard limit on each device it holds and sees, tightened by a limit already in `env`."""
    numbers = grant.max_caps if settings.limit == "max_cap" else grant.caps
    existing = parse_limit_variable(env.get(LIMIT_VARIABLE))
    limits = []
    for index, ordinal in sorted(kernel_ordinals(grant, devices, env).items(), key=lambda item: item[1]):
        limit = hard_limit_bytes(numbers[index], devices[index].total, settings.context_allowance)
        if ordinal in existing:  # the kernelspec or the server's environment set one: the smaller wins
            limit = min(limit, existing[ordinal])
        usable = max(0, min(numbers[index], limit - settings.context_allowance))
        limits.append(DeviceLimit(index, ordinal, limit, usable))
    return tuple(limits)


def limit_variable(limits: Sequence[DeviceLimit]) -> str:
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT's value: "0=10880M,1=20480M" (ordinals as the kernel sees them)."""
    return ",".join(f"{d.ordinal}={d.limit // MiB}M" for d in limits)


_LIMIT_ENTRY = re.compile(r"^\s*(\d+)\s*=\s*(\d+)\s*([kmgt])(?:i?b)?\s*$", re.IGNORECASE)
_UNIT = {"k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}  # binary: "10G" measured as 10 GiB


def parse_limit_variable(value: Optional[str]) -> Dict[int, int]:
    """{ordinal: bytes} from a CUDA_MPS_PINNED_DEVICE_MEM_LIMIT value ("0=10G,1=512M"). Entries without
    a unit or that do not parse are left out: their meaning is unclear, and ours replaces them."""
    limits: Dict[int, int] = {}
    for entry in (value or "").split(","):
        match = _LIMIT_ENTRY.match(entry)
        if match:
            ordinal, number, unit = match.groups()
            limits[int(ordinal)] = int(number) * _UNIT[unit.lower()]
    return limits


# --- the daemon's own default: a ceiling for processes that edit their variable ------------------------


def ceilings(policy: Policy, devices: Sequence[Device], allowance: int) -> Dict[int, int]:
    """{NVML index: bytes} for a managed daemon's `set_default_device_pinned_mem_limit`: the largest hard
    limit any kernel of this server can get on the device (its policy's largest max_cap, plus the context
    allowance). Measured on an H200 (driver 580): a client that removes CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
    gets this default, and one that raises it stays under it. Empty when a callable rule can give any cap.
    Devices whose ceiling would be the whole device get none (it would change nothing)."""
    if callable(policy.rules):
        return {}
    specs = [policy.default_cap, policy.max_cap]
    for rule in policy.rules:
        specs += [rule.cap] + ([rule.max_cap] if rule.max_cap is not None else [])
    found = {}
    for device in devices:
        limit = hard_limit_bytes(max(spec.to_bytes(device.total) for spec in specs), device.total, allowance)
        if limit < (device.total // MiB) * MiB:
            found[device.nvml_number] = limit
    return found


def ceiling_commands(found: Mapping[int, int]) -> str:
    """The control daemon's commands for `ceilings` (device numbers as the daemon sees them: it is started
    with every device visible, in PCI bus order, so they are NVML's)."""
    commands = (f"set_default_device_pinned_mem_limit {i} {limit // MiB}M\n" for i, limit in sorted(found.items()))
    return "".join(commands)


# --- what the daemon said, and the decision ---------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """The daemon's answer just before a kernel start: did it answer, and whose MPS servers run there."""

    answered: bool
    problem: Optional[str] = None  # why it did not answer (timeout, error text)
    servers: Tuple[Tuple[int, Optional[int]], ...] = ()  # (server PID, its owner's uid or None: unreadable)


def probe_problem(probe: Probe, uid: int) -> Optional[str]:
    """Why a kernel of `uid` must not be routed into this daemon now, or None when it may."""
    if not probe.answered:
        return f"the MPS control daemon did not answer: {probe.problem}"
    for pid, owner in probe.servers:
        if owner is None:
            return (
                f"the MPS server on this daemon (PID {pid}) has an owner this server cannot read; MPS serves "
                "one Unix user at a time, so a kernel of another user would wait at its first CUDA call"
            )
        if owner != uid:
            return (
                f"the MPS server on this daemon runs for another Unix user (uid {owner}, PID {pid}); MPS serves "
                f"one user at a time, so this kernel (uid {uid}) would wait at its first CUDA call until that user's "
                "work ends"
            )
    return None


@dataclass(frozen=True)
class KernelLayers:
    """Which layers one kernel started with: the soft caps always (when it holds a GPU), the hard limit
    when MPS was usable for it, and why not otherwise."""

    soft: bool
    limits: Tuple[DeviceLimit, ...] = ()  # empty: no hard limit
    reason: Optional[str] = None  # why there is no hard limit
    mode: str = "off"
    number: str = DEFAULTS["hard_limit"]
    context_allowance: int = DEFAULT_CONTEXT_ALLOWANCE

    @property
    def hard(self) -> bool:
        return bool(self.limits)

    def to_json(self, grant: Optional[Grant] = None) -> dict:
        """The status API's "layers" of a kernel. `restart_needed`: a cap in force now is above what the
        hard limit lets through (hard_limit = "cap" after a raise): it takes effect at the next restart."""
        by_index = {d.index: d for d in self.limits}
        restart = grant is not None and any(grant.caps.get(i, 0) > d.usable for i, d in by_index.items())
        return {
            "soft": self.soft,
            "hard_cap": self.mode,
            "hard_limit": {"mps": {str(d.index): d.limit for d in self.limits}} if self.limits else None,
            "hard_usable": {str(d.index): d.usable for d in self.limits} if self.limits else None,
            "hard_limit_number": self.number if self.limits else None,
            "hard_reason": self.reason,
            "restart_needed": restart,
        }

    def kernel_variable(self) -> str:
        """GPU_QUOTA_LAYERS, read by %gpucap inside the kernel (stdlib JSON)."""
        return json.dumps(
            {
                "hard": "mps" if self.hard else None,
                "reason": self.reason,
                "number": self.number,
                "devices": [
                    {"ordinal": d.ordinal, "index": d.index, "limit": d.limit, "usable": d.usable} for d in self.limits
                ],
            },
            separators=(",", ":"),
        )


@dataclass(frozen=True)
class Route:
    """Where kernels are sent: the daemon's pipe (and log) directory, and an empty directory that keeps a
    kernel without the hard layer out of any daemon (CUDA then runs without MPS, as MPS documents)."""

    pipe_directory: Optional[str]
    log_directory: Optional[str] = None
    no_mps_directory: Optional[str] = None


def decide(
    grant: Grant,
    devices: Mapping[int, Device],
    env: Mapping[str, str],
    settings: HardLimitSettings,
    unavailable: Optional[str],
    probe: Optional[Probe],
    uid: int,
    route: Route,
) -> Tuple[KernelLayers, Dict[str, str]]:
    """The kernel's layers and the variables its environment gets for them.

    `unavailable`: why the layer is off for the whole server (no daemon at start), or None.
    With hard_cap = "off" nothing is added: a server with the layer off starts kernels as before.
    """
    soft = bool(grant.devices)
    common: Dict[str, Any] = {
        "mode": settings.mode,
        "number": settings.limit,
        "context_allowance": settings.context_allowance,
    }
    if settings.mode == "off":
        return KernelLayers(soft, reason="hard limits are off on this server (c.GpuQuota.hard_cap)", **common), {}
    reason = unavailable
    limits: Tuple[DeviceLimit, ...] = ()
    if reason is None and not grant.devices:
        reason = "this kernel holds no GPU"
    if reason is None:
        reason = probe_problem(probe, uid) if probe is not None else "the MPS control daemon was not asked"
    if reason is None:
        limits = device_limits(grant, devices, env, settings)
        if not limits:
            reason = "none of this kernel's GPUs is visible to it through CUDA_VISIBLE_DEVICES"
    layers = KernelLayers(soft, limits, None if limits else reason, **common)
    variables: Dict[str, str] = {LAYERS: layers.kernel_variable()}
    if limits:
        variables[LIMIT_VARIABLE] = limit_variable(limits)
        variables[PIPE_VARIABLE] = route.pipe_directory or DEFAULT_PIPE_DIRECTORY
        if route.log_directory:
            variables[LOG_VARIABLE] = route.log_directory
    elif grant.devices and route.no_mps_directory:
        # Keep it out of every daemon: one whose server belongs to another user would make it wait.
        variables[PIPE_VARIABLE] = route.no_mps_directory
    return layers, variables


def layers_summary(layers: KernelLayers) -> str:
    """One line for logs: "hard limit 40.0 GiB on device 0 (MPS)" or "soft cap only: <why>"."""
    if layers.hard:
        return (
            "hard limit " + ", ".join(f"{format_bytes(d.usable)} on device {d.index}" for d in layers.limits) + " (MPS)"
        )
    return f"soft cap only: {layers.reason}"
