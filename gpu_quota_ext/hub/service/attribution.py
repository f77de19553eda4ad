"""The host watchdog's pure part: whose is each GPU process, is it inside a grant, and what to do.

Given one sample of the host (every process NVML lists, with its Unix user and the kernel it belongs to,
found by the sampler from the PIDs servers register in their leases), this says per kernel how much it
uses on each device, and which memory is held outside every grant: that is the user's *unmanaged*
usage (a kernel of a server without the extension, a terminal's `python train.py`, a kernel on a device
its grant does not include). The policy for it is "warn" (shown, logged) or "kill" (after `grace`
seconds of being seen). Processes of root and of the service's own user are never killed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

UNMANAGED_ACTIONS = ("warn", "kill")


@dataclass(frozen=True)
class GpuProcess:
    """One process on one device, as the sampler found it."""

    pid: int
    uuid: str
    used: int
    uid: Optional[int]  # None: the process ended (or is hidden) before we could look
    unix_user: Optional[str]
    kernel_id: Optional[str] = None  # the registered kernel whose process tree holds it


@dataclass(frozen=True)
class Unmanaged:
    user: str  # the hub user (by the Unix user template), else "unix:NAME" or "pid:N"
    pid: int
    uuid: str
    used: int
    uid: Optional[int]
    why: str


@dataclass
class Attributed:
    kernel_used: Dict[str, Dict[str, int]] = field(default_factory=dict)  # kernel id -> uuid -> bytes
    unmanaged: List[Unmanaged] = field(default_factory=list)

    def unmanaged_by_user(self) -> Dict[str, int]:
        totals: Dict[str, int] = {}
        for item in self.unmanaged:
            totals[item.user] = totals.get(item.user, 0) + item.used
        return totals


def hub_user_of(unix_user: Optional[str], template: str) -> Optional[str]:
    """The hub user a Unix user is, by the spawner's naming: "{username}" (LocalProcessSpawner, one Unix
    user per hub user) or "jupyter-{username}" (The Littlest JupyterHub). None when it does not match."""
    if not unix_user:
        return None
    prefix, _, suffix = template.partition("{username}")
    if (
        not unix_user.startswith(prefix)
        or not unix_user.endswith(suffix)
        or len(unix_user) <= len(prefix) + len(suffix)
    ):
        return None
    return unix_user[len(prefix) : len(unix_user) - len(suffix)]


def attribute(
    processes: Sequence[GpuProcess],
    granted: Mapping[str, Tuple[str, Tuple[str, ...]]],
    template: str,
) -> Attributed:
    """`granted`: kernel id -> (its user, the uuids its grant holds). A process of a kernel counts as that
    kernel's usage on devices its grant holds; anything else is unmanaged usage of the process's user."""
    result = Attributed()
    for proc in processes:
        held = granted.get(proc.kernel_id) if proc.kernel_id else None
        if held is not None and proc.kernel_id is not None and proc.uuid in held[1]:
            per = result.kernel_used.setdefault(proc.kernel_id, {})
            per[proc.uuid] = per.get(proc.uuid, 0) + proc.used
            continue
        if held is not None:
            user, why = held[0], f"kernel {proc.kernel_id} uses a GPU its grant does not hold"
        else:
            user = hub_user_of(proc.unix_user, template) or (
                f"unix:{proc.unix_user}" if proc.unix_user else f"pid:{proc.pid}"
            )
            why = "a process outside every grant"
        result.unmanaged.append(Unmanaged(user, proc.pid, proc.uuid, proc.used, proc.uid, why))
    return result


@dataclass(frozen=True)
class Decision:
    action: str  # "warn" or "kill"
    item: Unmanaged
    message: str


def decide(
    unmanaged: Sequence[Unmanaged],
    first_seen: Mapping[Tuple[int, str], float],
    now: float,
    policy: str,
    grace: float,
    protected_uids: Sequence[int],
) -> Tuple[List[Decision], Dict[Tuple[int, str], float]]:
    """What to do with this sample's unmanaged processes, and the new first-seen times. A process is
    warned about once (when first seen); under "kill" it is killed once it was seen for `grace` seconds,
    unless its user is protected (root, the service's own), which is only warned about."""
    seen = {(u.pid, u.uuid): first_seen.get((u.pid, u.uuid), now) for u in unmanaged}
    decisions = []
    for item in unmanaged:
        since = seen[(item.pid, item.uuid)]
        new = (item.pid, item.uuid) not in first_seen
        if policy == "kill" and item.uid is not None and item.uid not in protected_uids and now - since >= grace:
            decisions.append(
                Decision(
                    "kill", item, f"killed PID {item.pid} of {item.user}: {item.used} bytes on {item.uuid}, {item.why}"
                )
            )
        elif new:
            decisions.append(
                Decision(
                    "warn", item, f"PID {item.pid} of {item.user} holds {item.used} bytes on {item.uuid}: {item.why}"
                )
            )
    return decisions, seen
