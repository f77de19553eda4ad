"""The host's book: every user's grants in one ledger, who owns each, and the servers' leases.

Pure logic, no I/O of its own: it is given a `Journal` (store.py's `Store`, or a list in tests) and the
time (`now`, seconds since the epoch: leases outlive a restart of the service, so wall-clock time).

- A kernel id belongs to the user whose server asked first: another user's call on it is `Forbidden`,
  whatever the request says (the user comes from the hub, not from the body).
- Every change is written to the journal inside the same lock as the ledger's change, so the record on
  disk is always one the ledger held.
- Leases: a server renews its lease listing the kernels it runs and their PIDs. Its grants that the
  list no longer names are released (unless younger than `start_grace`: a kernel is granted before its
  server lists it); a server whose lease runs out loses every grant.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple

from ...devices import Device
from ...ledger import AdmissionRefused, ChangeOutcome, Grant, LocalLedger, UnknownKernel
from ...policy import CapSpec, Policy
from .user_policy import UserPolicy


class Forbidden(Exception):
    """The kernel is another user's."""


@dataclass(frozen=True)
class Owned:
    """A grant with what the host adds: which server of its user holds it and since when."""

    grant: Grant
    server: str
    granted_at: float


@dataclass(frozen=True)
class Lease:
    user: str
    server: str
    expires: float
    kernels: Mapping[str, Tuple[int, ...]] = field(default_factory=dict)  # kernel id -> its processes' PIDs


class Journal(Protocol):
    """Where the book's changes go (store.py)."""

    def save_grant(self, owned: Owned) -> None: ...

    def delete_grants(self, kernel_ids: Sequence[str]) -> None: ...

    def save_lease(self, lease: Lease) -> None: ...

    def delete_lease(self, user: str, server: str) -> None: ...


class HostLedger(LocalLedger):
    """The local ledger, able to take back grants it held before a restart (admitted then: not again)."""

    def restore(self, grant: Grant) -> None:
        with self._lock:
            self._store(grant)


def grant_to_record(grant: Grant, devices: Mapping[int, Device]) -> dict:
    """A grant as stored and sent: its JSON with each device's uuid (indexes are this host's own)."""
    data = grant.to_json()
    for entry in data["devices"]:
        entry["uuid"] = devices[entry["index"]].uuid
    return data


def grant_from_record(data: Mapping, devices_by_uuid: Mapping[str, Device]) -> Tuple[Grant, List[str]]:
    """The stored record back into a grant on this host's devices; devices gone since are dropped
    (their uuids returned)."""
    kept = [d for d in data["devices"] if d["uuid"] in devices_by_uuid]
    gone = [d["uuid"] for d in data["devices"] if d["uuid"] not in devices_by_uuid]
    index = {d["uuid"]: devices_by_uuid[d["uuid"]].index for d in kept}
    reason = data.get("cpu_only_reason")
    if gone and not kept:
        reason = f"its GPUs {gone} are gone from this host"
    grant = Grant(
        kernel_id=data["kernel_id"],
        user=data["user"],
        kernelspec=data["kernelspec"],
        devices=tuple(index[d["uuid"]] for d in kept),
        caps={index[d["uuid"]]: int(d["cap"]) for d in kept},
        policy_caps={index[d["uuid"]]: int(d["policy_cap"]) for d in kept},
        max_caps={index[d["uuid"]]: int(d["max_cap"]) for d in kept},
        source=data["source"],
        placed=bool(data["placed"]),
        cpu_only_reason=reason,
    )
    return grant, gone


class HostBook:
    def __init__(
        self, devices: Sequence[Device], policy: Policy, journal: Journal, lease_seconds: float, start_grace: float
    ):
        # The ledger never refuses by itself: on_full is each user's (UserPolicy), applied here.
        self.ledger = HostLedger(devices, replace(policy, on_full="cpu-only"))
        self.policy = policy
        self.journal = journal
        self.lease_seconds = lease_seconds
        self.start_grace = start_grace
        self._owned: Dict[str, Owned] = {}
        self._leases: Dict[Tuple[str, str], Lease] = {}
        self._lock = threading.RLock()

    @property
    def devices(self) -> Dict[int, Device]:
        return {d.index: d for d in self.ledger.devices}

    def record(self, grant: Grant) -> dict:
        return grant_to_record(grant, self.devices)

    # --- restart ----------------------------------------------------------------------------

    def restore(self, owned: Iterable[Owned], leases: Iterable[Lease], now: float) -> None:
        """What the store held: every grant back into the ledger, every lease back. A server could not
        renew while the service was down, so each lease gets a full period from now to re-register
        (a server that stopped meanwhile loses its grants one lease after the restart)."""
        with self._lock:
            for item in owned:
                self.ledger.restore(item.grant)
                self._owned[item.grant.kernel_id] = item
            for lease in leases:
                lease = replace(lease, expires=max(lease.expires, now + self.lease_seconds))
                self.journal.save_lease(lease)
                self._leases[(lease.user, lease.server)] = lease

    # --- the API's operations -----------------------------------------------------------------

    def grant(
        self,
        user: str,
        server: str,
        kernel_id: str,
        kernelspec: str,
        policy: UserPolicy,
        allowed: Optional[Sequence[int]],
        now: float,
    ) -> Tuple[Grant, bool]:
        """(grant, created). A kernel the user holds already (a restart) keeps its grant. Raises
        Forbidden (another user's kernel id), AdmissionRefused (nothing fits, the user's on_full is refuse)."""
        with self._lock:
            held = self._owned.get(kernel_id)
            if held is not None:
                if held.grant.user != user:
                    raise Forbidden(kernel_id)
                return held.grant, False
            grant = self.ledger.grant(kernel_id, user, kernelspec, policy.decision, allowed)
            if not grant.devices and grant.cpu_only_reason and policy.on_full == "refuse" and self.ledger.devices:
                self.ledger.release(kernel_id)
                raise AdmissionRefused(grant.cpu_only_reason)
            owned = Owned(grant, server, now)
            try:
                self.journal.save_grant(owned)
                self._touch_lease(user, server, now)
            except Exception:
                self.ledger.release(kernel_id)  # not on disk: not granted
                raise
            self._owned[kernel_id] = owned
            return grant, True

    def get(self, user: str, kernel_id: str, admin: bool) -> Grant:
        with self._lock:
            return self._mine(user, kernel_id, admin).grant

    def change(
        self, user: str, kernel_id: str, admin: bool, requested: CapSpec, device: Optional[int]
    ) -> ChangeOutcome:
        with self._lock:
            held = self._mine(user, kernel_id, admin)
            source = "user request" if held.grant.user == user else f"admin {user}"
            outcome = self.ledger.change(kernel_id, requested, device, source=source)
            self._save_outcome(held, outcome)
            return outcome

    def reset(self, user: str, kernel_id: str, admin: bool) -> ChangeOutcome:
        with self._lock:
            held = self._mine(user, kernel_id, admin)
            source = "user request" if held.grant.user == user else f"admin {user}"
            outcome = self.ledger.reset(kernel_id, source=source)
            self._save_outcome(held, outcome)
            return outcome

    def release(self, user: str, kernel_id: str, admin: bool) -> Grant:
        with self._lock:
            held = self._mine(user, kernel_id, admin)
            self._release([kernel_id])
            return held.grant

    def visible(self, user: str, admin: bool) -> List[Owned]:
        with self._lock:
            return [o for o in self._owned.values() if admin or o.grant.user == user]

    def owned(self) -> List[Owned]:
        with self._lock:
            return list(self._owned.values())

    def leases(self) -> List[Lease]:
        with self._lock:
            return list(self._leases.values())

    # --- leases -----------------------------------------------------------------------------

    def lease(self, user: str, server: str, kernels: Mapping[str, Tuple[int, ...]], now: float) -> List[str]:
        """The server's renewal: what it runs now. Returns the kernel ids released (listed no more).
        Kernels it lists that are another user's are ignored (their PIDs too): Forbidden is not raised,
        so one bad entry does not stop a server's renewal."""
        with self._lock:
            mine = {
                k: tuple(p) for k, p in kernels.items() if k not in self._owned or self._owned[k].grant.user == user
            }
            gone = [
                kid
                for kid, o in self._owned.items()
                if o.grant.user == user
                and o.server == server
                and kid not in mine
                and now - o.granted_at >= self.start_grace
            ]
            lease = Lease(user, server, now + self.lease_seconds, mine)
            self.journal.save_lease(lease)
            self._leases[(user, server)] = lease
            self._release(gone)
            return gone

    def expire(self, now: float) -> List[str]:
        """Release every grant of servers whose lease ran out (stopped, crashed, or cut off)."""
        with self._lock:
            ended = [key for key, lease in self._leases.items() if lease.expires <= now]
            gone = [kid for kid, o in self._owned.items() if (o.grant.user, o.server) in ended]
            self._release(gone)
            for user, server in ended:
                self.journal.delete_lease(user, server)
                del self._leases[(user, server)]
            return gone

    def kernel_pids(self) -> Dict[int, Tuple[str, str]]:
        """Every registered kernel process: PID -> (user, kernel id), from the live leases."""
        with self._lock:
            return {
                pid: (lease.user, kid)
                for lease in self._leases.values()
                for kid, pids in lease.kernels.items()
                for pid in pids
                if kid in self._owned
            }

    # --- inside the lock ----------------------------------------------------------------------

    def _mine(self, user: str, kernel_id: str, admin: bool) -> Owned:
        held = self._owned.get(kernel_id)
        if held is None:
            raise UnknownKernel(kernel_id)
        if held.grant.user != user and not admin:
            raise Forbidden(kernel_id)
        return held

    def _save_outcome(self, held: Owned, outcome: ChangeOutcome) -> None:
        if outcome.grant is held.grant:
            return
        owned = replace(held, grant=outcome.grant)
        try:
            self.journal.save_grant(owned)
        except Exception:
            self.ledger.restore(held.grant)  # not on disk: not changed
            raise
        self._owned[held.grant.kernel_id] = owned

    def _touch_lease(self, user: str, server: str, now: float) -> None:
        lease = self._leases.get((user, server)) or Lease(user, server, now + self.lease_seconds)
        lease = replace(lease, expires=max(lease.expires, now + self.lease_seconds))
        self.journal.save_lease(lease)
        self._leases[(user, server)] = lease

    def _release(self, kernel_ids: Sequence[str]) -> None:
        if not kernel_ids:
            return
        self.journal.delete_grants(list(kernel_ids))
        for kid in kernel_ids:
            self.ledger.release(kid)
            self._owned.pop(kid, None)
