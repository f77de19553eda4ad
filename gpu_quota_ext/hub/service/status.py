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

from typing import Dict, Mapping, Optional, Sequence

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
    parks = room.get("park", {})
    devices = book.devices
    uuid_of = {i: d.uuid for i, d in devices.items()}
    leases = {(lease.user, lease.server): lease for lease in book.leases()}
    kernel_used = sample.attributed.kernel_used if sample else {}
    verified = sample.verified.pids_of() if sample else {}
    idle = set(book.idle(now))
    mine = lambda user: admin or user == viewer  # noqa: E731

    kernels = []
    users: Dict[str, dict] = {}

    def user_row(name: str) -> dict:
        if name not in users:
            policy = policies.get(name)
            users[name] = {"name": name, "policy": policy.describe() if policy else None, "kernels": 0,
                           "granted": 0, "used": 0, "unmanaged": 0, "kept_idle": 0}
        return users[name]

    for owned in sorted(book.visible(viewer, admin), key=lambda o: (o.grant.user, o.granted_at)):
        grant = owned.grant
        record = book.record(grant)
        used = kernel_used.get(grant.kernel_id, {})
        for entry in record["devices"]:
            entry["used"] = used.get(entry["uuid"]) if sample else None
        lease = leases.get((grant.user, owned.server))
        row = user_row(grant.user)
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
    kept_idle = list(room.get("kept_idle", []))
    for item in kept_idle:
        if item["user"] in users:
            users[item["user"]]["kept_idle"] += sum(item["held"].values())
    unmanaged = []
    if sample:
        for item in sample.attributed.unmanaged:
            if mine(item.user):
                user_row(item.user)["unmanaged"] += item.used
                unmanaged.append(
                    {"user": item.user, "pid": item.pid, "uuid": item.uuid, "used": item.used, "why": item.why}
                )
    refused = []
    for item in sample.verified.refused if sample else ():
        reg = item.registration
        if mine(reg.user):
            refused.append({
                "user": reg.user, "server": reg.server, "kernel_id": reg.kernel_id, "pid": reg.pid,
                "why": item.why if admin else f"PID {reg.pid} is not a process of your Unix user",
                **({"uid": item.uid} if admin else {}),
            })
    if not admin:
        user_row(viewer)
    device_rows = []
    for entry in book.ledger.device_grants():
        uuid = uuid_of[entry["index"]]
        device_rows.append({**entry, "used": (sample.device_used.get(uuid) if sample else None) if admin else None})
    return {
        "viewer": {"name": viewer, "admin": admin},
        "state": state,
        "sampled_at": sample.taken_at if sample else None,
        "problem": sample.problem if sample else None,
        "devices": device_rows,
        "users": sorted(users.values(), key=lambda u: u["name"]),
        "kernels": kernels,
        "unmanaged": unmanaged,
        "refused_pids": refused,
        "actions": [
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
        ][-50:],
        "waiting": list(room.get("waiting", [])),
        "reservations": list(room.get("reservations", [])),
        "park_requests": list(room.get("park_requests", [])),
        "kept_idle": kept_idle,
        **({"long_polls": room["long_polls"]} if admin and "long_polls" in room else {}),
        **({"refused_calls": room["refused_calls"]} if admin and "refused_calls" in room else {}),
        **({"host_memory": room["host_memory"]} if admin and "host_memory" in room else {}),
    }
