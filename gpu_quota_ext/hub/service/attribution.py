"""The host watchdog's pure part: which registered PIDs are believed, whose is each GPU process, is it
inside a grant, and what to do.

A server's lease lists its kernels' PIDs; that is a claim, sent by a user's server, which the user controls.
`verify` believes a registered PID only while the process's real uid (read from /proc at every sample: PIDs
are reused) is the Unix user of the lease's owner (the service's `unix_user_template`); any other is
refused: it counts for nobody, it is never acted on, and the sampler logs it once and shows it.

Given one sample of the host (every process NVML lists, with its Unix user and the kernel whose verified
process tree holds it), `attribute` says per kernel how much it uses on each device, and which memory is
held outside every grant: that is the user's *unmanaged* usage (a kernel of a server without the
extension, a terminal's `python train.py`, a kernel on a device its grant does not include). The policy
for it is "warn" (shown, logged) or "kill" (after `grace` seconds of being seen). A kill is only ever of a
process whose real uid is the Unix user of the user whose usage it is; processes of root and of the
service's own user are never killed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ...settings import SERVICE_SETTINGS

UNMANAGED_ACTIONS = SERVICE_SETTINGS["unmanaged_action"].choices  # ("warn", "kill"): the setting's row says


@dataclass(frozen=True)
class Registration:
    """One PID a server's lease names as a process of one of its user's kernels: a claim until verified."""

    user: str
    server: str
    kernel_id: str
    pid: int


@dataclass(frozen=True)
class RefusedPid:
    """A registration `verify` did not believe, and why."""

    registration: Registration
    uid: int  # the process's real uid
    expected: Optional[int]  # the lease owner's Unix uid (None: they have none on this host)
    why: str


@dataclass
class Verified:
    roots: Dict[int, str] = field(default_factory=dict)  # pid -> kernel id: the registrations that hold
    refused: List[RefusedPid] = field(default_factory=list)

    def pids_of(self) -> Dict[str, Tuple[int, ...]]:
        """kernel id -> its verified PIDs."""
        found: Dict[str, List[int]] = {}
        for pid, kernel_id in sorted(self.roots.items()):
            found.setdefault(kernel_id, []).append(pid)
        return {kernel_id: tuple(pids) for kernel_id, pids in found.items()}


def verify(
    registrations: Iterable[Registration],
    real_uid: Mapping[int, Optional[int]],
    user_uid: Mapping[str, Optional[int]],
) -> Verified:
    """The registrations to believe now. `real_uid`: pid -> the process's real uid (None or absent: no such
    process, so it counts for nobody and is no one's attempt); `user_uid`: hub user -> their Unix user's uid
    (None: no such Unix user on this host). A PID two kernels claim goes to the first in order, whoever
    else names it."""
    result = Verified()
    for item in sorted(registrations, key=lambda r: (r.user, r.server, r.kernel_id, r.pid)):
        uid = real_uid.get(item.pid)
        if uid is None:
            continue
        expected = user_uid.get(item.user)
        if expected is None:
            why = f"{item.user} has no Unix user on this host (unix_user_template): their PIDs cannot be checked"
        elif uid != expected:
            why = f"PID {item.pid} runs as uid {uid}, not as {item.user}'s Unix user (uid {expected})"
        else:
            result.roots.setdefault(item.pid, item.kernel_id)
            continue
        result.refused.append(RefusedPid(item, uid, expected, why))
    return result


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
    user_uid: Optional[int] = None  # the Unix uid of `user`, whose usage it is: only a process of it may be killed


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
    user_uid: Optional[Mapping[str, Optional[int]]] = None,
) -> Attributed:
    """`granted`: kernel id -> (its user, the uuids its grant holds); `user_uid`: hub user -> their Unix uid.
    A process of a kernel counts as that kernel's usage on devices its grant holds; anything else is
    unmanaged usage: of the kernel's user (on a device its grant does not hold), else of the process's own
    user."""
    user_uid = user_uid or {}
    result = Attributed()
    for proc in processes:
        held = granted.get(proc.kernel_id) if proc.kernel_id else None
        if held is not None and proc.kernel_id is not None and proc.uuid in held[1]:
            per = result.kernel_used.setdefault(proc.kernel_id, {})
            per[proc.uuid] = per.get(proc.uuid, 0) + proc.used
            continue
        if held is not None:
            user, why = held[0], f"kernel {proc.kernel_id} uses a GPU its grant does not hold"
            owner = user_uid.get(user)
        else:
            user = hub_user_of(proc.unix_user, template) or (
                f"unix:{proc.unix_user}" if proc.unix_user else f"pid:{proc.pid}"
            )
            why = "a process outside every grant"
            owner = proc.uid  # named after its own Unix user: its usage is that user's
        result.unmanaged.append(Unmanaged(user, proc.pid, proc.uuid, proc.used, proc.uid, why, owner))
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
    unless its user is protected (root, the service's own), or it is not a process of the user whose usage
    it is (`user_uid`): those are only warned about."""
    seen = {(u.pid, u.uuid): first_seen.get((u.pid, u.uuid), now) for u in unmanaged}
    decisions = []
    for item in unmanaged:
        since = seen[(item.pid, item.uuid)]
        new = (item.pid, item.uuid) not in first_seen
        killable = item.uid is not None and item.uid == item.user_uid and item.uid not in protected_uids
        if policy == "kill" and killable and now - since >= grace:
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
