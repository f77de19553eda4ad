"""The status the API and the admin's page show, built from the book and the last host sample. Pure.

A user sees their own kernels, their own unmanaged usage and the devices' totals; an admin sees every
user. Usage is NVML's (the host sampler's), per kernel and per device; `over_cap` marks a kernel using
more than its cap (its own server's watchdog acts on it: interrupt and restart are the server's). Per
kernel: the PIDs its server registered and those the last sample believed (`pids`, checked by uid), and
`idle_held` when no verified live process held its grant for a lease period. `refused_pids`: registrations
the sampler did not believe (a PID of another Unix user); a user sees those of their own leases, without
whose the process is. The host's broker (room.py): each kernel's `park` state as its server last reported it,
the kernels `waiting` for device memory (how long, why), the `reservations` of resumes under way and the
`park_requests` for idle kernels, and the `kept_idle` memory of kernels idle that could not be parked
(limits.kept_idle: per kernel, and per user in their row); an admin also sees how many leases wait in a long poll
(`long_polls`), how many calls were answered 429 (`refused_calls`, guard.py) and the host memory promised to parks
under way, every user's (`host_memory`: HostRoom.promise_host).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence

from .book import HostBook
from .sampler import Action, Sample
from .user_policy import UserPolicy


def build_status(
    book: HostBook,
    sample: Optional[Sample],
    state: str,
    actions: Sequence[Action],
    policies: Mapping[str, UserPolicy],
    viewer: str,
    admin: bool,
    now: float,
    room: Optional[Mapping] = None,
) -> dict:
    """The status `viewer` may see; `room`: HostRoom.status() of the same viewer (none: nothing brokered yet)."""
    room = room or {}
    mine = lambda user: admin or user == viewer  # noqa: E731
    users = _UserRows(policies)
    kernels = _kernel_rows(book, sample, viewer, admin, now, room.get("park", {}), users)
    kept_idle = list(room.get("kept_idle", []))
    users.add_kept_idle(kept_idle)  # to the rows the kernels made, before unmanaged usage makes more
    unmanaged = _unmanaged_rows(sample, mine, users)
    refused = _refused_rows(sample, mine, admin)
    if not admin:
        users.row(viewer)
    return {
        "viewer": {"name": viewer, "admin": admin},
        "state": state,
        "sampled_at": sample.taken_at if sample else None,
        "problem": sample.problem if sample else None,
        "devices": _device_rows(book, sample, admin),
        "users": users.sorted(),
        "kernels": kernels,
        "unmanaged": unmanaged,
        "refused_pids": refused,
        "actions": _action_rows(actions, mine),
        "waiting": list(room.get("waiting", [])),
        "reservations": list(room.get("reservations", [])),
        "park_requests": list(room.get("park_requests", [])),
        "kept_idle": kept_idle,
        **({"long_polls": room["long_polls"]} if admin and "long_polls" in room else {}),
        **({"refused_calls": room["refused_calls"]} if admin and "refused_calls" in room else {}),
        **({"host_memory": room["host_memory"]} if admin and "host_memory" in room else {}),
    }


class _UserRows:
    """A row per user the status names, made at the user's first mention (a kernel, unmanaged usage, the viewer),
    with the sums of what is theirs."""

    def __init__(self, policies: Mapping[str, UserPolicy]):
        self._policies = policies
        self._rows: Dict[str, dict] = {}

    def row(self, name: str) -> dict:
        if name not in self._rows:
            policy = self._policies.get(name)
            self._rows[name] = {"name": name, "policy": policy.describe() if policy else None, "kernels": 0,
                                "granted": 0, "used": 0, "unmanaged": 0, "kept_idle": 0}
        return self._rows[name]

    def add_kept_idle(self, kept_idle: Iterable[Mapping]) -> None:
        """Each user's memory kept idle, in the rows made so far."""
        for item in kept_idle:
            if item["user"] in self._rows:
                self._rows[item["user"]]["kept_idle"] += sum(item["held"].values())

    def sorted(self) -> List[dict]:
        return sorted(self._rows.values(), key=lambda u: u["name"])


def _kernel_rows(
    book: HostBook,
    sample: Optional[Sample],
    viewer: str,
    admin: bool,
    now: float,
    parks: Mapping,
    users: _UserRows,
) -> List[dict]:
    """A row per kernel `viewer` may see (by user, then by when it was granted), each added to its user's row."""
    leases = {(lease.user, lease.server): lease for lease in book.leases()}
    kernel_used = sample.attributed.kernel_used if sample else {}
    verified = sample.verified.pids_of() if sample else {}
    idle = set(book.idle(now))
    kernels = []
    for owned in sorted(book.visible(viewer, admin), key=lambda o: (o.grant.user, o.granted_at)):
        grant = owned.grant
        record = book.record(grant)
        used = kernel_used.get(grant.kernel_id, {})
        for entry in record["devices"]:
            entry["used"] = used.get(entry["uuid"]) if sample else None
        lease = leases.get((grant.user, owned.server))
        row = users.row(grant.user)
        row["kernels"] += 1
        row["granted"] += sum(grant.caps.values())
        row["used"] += sum(used.values())
        kernels.append({
            **record,
            "server": owned.server,
            "granted_at": owned.granted_at,
            "registered_pids": list(lease.kernels.get(grant.kernel_id, ())) if lease else [],
            "pids": list(verified.get(grant.kernel_id, ())),
            "idle_held": grant.kernel_id in idle,
            "lease_expires_in": round(lease.expires - now, 1) if lease else None,
            "over_cap": any(e["used"] is not None and e["used"] > e["cap"] for e in record["devices"]),
            "park": parks.get(grant.kernel_id),
        })
    return kernels


def _unmanaged_rows(sample: Optional[Sample], mine: Callable[[str], bool], users: _UserRows) -> List[dict]:
    """The viewer's share of the GPU memory outside every grant, each also added to its user's row."""
    unmanaged = []
    if sample:
        for item in sample.attributed.unmanaged:
            if mine(item.user):
                users.row(item.user)["unmanaged"] += item.used
                unmanaged.append(
                    {"user": item.user, "pid": item.pid, "uuid": item.uuid, "used": item.used, "why": item.why}
                )
    return unmanaged


def _refused_rows(sample: Optional[Sample], mine: Callable[[str], bool], admin: bool) -> List[dict]:
    """The registrations the sampler did not believe: a user is told of their own, not whose the process is."""
    refused = []
    for item in sample.verified.refused if sample else ():
        reg = item.registration
        if mine(reg.user):
            refused.append({
                "user": reg.user, "server": reg.server, "kernel_id": reg.kernel_id, "pid": reg.pid,
                "why": item.why if admin else f"PID {reg.pid} is not a process of your Unix user",
                **({"uid": item.uid} if admin else {}),
            })
    return refused


def _device_rows(book: HostBook, sample: Optional[Sample], admin: bool) -> List[dict]:
    """Each device's grants; what NVML says it uses only for an admin (it is every user's)."""
    uuid_of = {i: d.uuid for i, d in book.devices.items()}
    device_rows = []
    for entry in book.ledger.device_grants():
        uuid = uuid_of[entry["index"]]
        device_rows.append({**entry, "used": (sample.device_used.get(uuid) if sample else None) if admin else None})
    return device_rows


def _action_rows(actions: Sequence[Action], mine: Callable[[str], bool]) -> List[dict]:
    """The watchdog's last 50 actions the viewer may see."""
    return [
        {
            "at": a.at,
            "action": a.action,
            "user": a.user,
            "pid": a.pid,
            "uuid": a.uuid,
            "used": a.used,
            "message": a.message,
        }
        for a in actions
        if mine(a.user)
    ][-50:]
