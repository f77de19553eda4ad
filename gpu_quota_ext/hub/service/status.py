"""The status the API and the admin's page show, built from the book and the last host sample. Pure.

A user sees their own kernels, their own unmanaged usage and the devices' totals; an admin sees every
user. Usage is NVML's (the host sampler's), per kernel and per device; `over_cap` marks a kernel using
more than its cap (its own server's watchdog acts on it: interrupt and restart are the server's).
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
) -> dict:
    devices = book.devices
    uuid_of = {i: d.uuid for i, d in devices.items()}
    leases = {(lease.user, lease.server): lease for lease in book.leases()}
    kernel_used = sample.attributed.kernel_used if sample else {}
    mine = lambda user: admin or user == viewer  # noqa: E731

    kernels = []
    users: Dict[str, dict] = {}

    def user_row(name: str) -> dict:
        if name not in users:
            policy = policies.get(name)
            users[name] = {"name": name, "policy": policy.describe() if policy else None, "kernels": 0,
                           "granted": 0, "used": 0, "unmanaged": 0}
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
            "pids": list(lease.kernels.get(grant.kernel_id, ())) if lease else [],
            "lease_expires_in": round(lease.expires - now, 1) if lease else None,
            "over_cap": any(e["used"] is not None and e["used"] > e["cap"] for e in record["devices"]),
        })
    unmanaged = []
    if sample:
        for item in sample.attributed.unmanaged:
            if mine(item.user):
                user_row(item.user)["unmanaged"] += item.used
                unmanaged.append(
                    {"user": item.user, "pid": item.pid, "uuid": item.uuid, "used": item.used, "why": item.why}
                )
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
    }
