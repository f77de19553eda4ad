"""The host's book: every user's grants in one ledger, who owns each, and the servers' leases.

Pure logic, no I/O of its own: it is given a `Journal` (store.py's `Store`, or a list in tests) and the
time (`now`, seconds since the epoch: leases outlive a restart of the service, so wall-clock time).

- A kernel id belongs to the user whose server asked first: another user's call on it is `Forbidden`,
  whatever the request says (the user comes from the hub, not from the body).
- Every change is written to the journal inside the same lock as the ledger's change, so the record on
  disk is always one the ledger held.
- Leases: a server renews its lease listing the kernels it runs and their PIDs. Its grants that the
  list no longer names are released (unless younger than `start_grace`: a kernel is granted before its
  server lists it); a server whose lease runs out loses every grant. A lease keeps only the user's own
  kernels (the first PIDS_PER_KERNEL PIDs of each), and only while its server holds a grant: what one user
  can leave here is bounded by their limits.
- The PIDs are claims: the sampler verifies them (attribution.verify) at every round and tells the book
  which kernels a live process of their user held (`note_round`). A grant no verified process held for a
  lease period is *idle-held* (`idle`): a token can renew a lease with empty PID lists for ever, so the
  service releases those (`release_idle`) unless its admin chose to keep them, shown as idle-held.
- Per-user limits (limits.py, from each user's UserPolicy): the most kernels a user holds grants for, and
  the most their grants add up to on each device. A start past either is refused or CPU-only as the
  user's on_full says (the count always refuses); a cap raise past the budget is clamped or refused as
  the host's on_over_max says.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple

from ...devices import Device
from ...ledger import AdmissionRefused, ChangeOutcome, Grant, LocalLedger, UnknownKernel
from ...policy import Policy
from ...shared.sizes import CapSpec, PolicyError, format_bytes
from .attribution import Registration
from .limits import kernels_refusal, over_budget, room_for, user_totals
from .user_policy import BUILT_IN_LIMITS, UserLimits, UserPolicy

# PIDs of one kernel a lease keeps. The kernel's own process comes first (its server's direct child); its
# descendants are found by their process tree, so a kernel needs more only for processes that left it.
PIDS_PER_KERNEL = 64


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


def idle_grants(
    owned: Iterable[Owned],
    held_at: Mapping[str, float],
    checked_since: Optional[float],
    last_check: Optional[float],
    now: float,
    period: float,
    check_gap: float,
) -> List[str]:
    """The kernel ids whose grant no verified live process held for `period` seconds. `held_at`: kernel id ->
    the last round a verified process of it was alive; `checked_since`: since when the rounds have run without
    a gap longer than `check_gap` (a hung driver call, the sampler off: then nothing is idle, for want of
    looking). A grant is given `period` from its start, and from when the checks (re)started."""
    if checked_since is None or last_check is None or now - last_check > check_gap:
        return []
    return [
        o.grant.kernel_id
        for o in owned
        if now - max(o.granted_at, held_at.get(o.grant.kernel_id, checked_since), checked_since) >= period
    ]


class HostBook:
    def __init__(
        self,
        devices: Sequence[Device],
        policy: Policy,
        journal: Journal,
        lease_seconds: float,
        start_grace: float,
        limits: UserLimits = BUILT_IN_LIMITS,
        check_gap: float = 30.0,
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
        self.host_limits = limits  # for a user whose policy the book has not been told yet (after a restart)
        self._limits: Dict[str, UserLimits] = {}
        # user -> device index -> idle memory their kernels keep that could not be parked (limits.kept_idle), counted
        # against their budget once more; empty unless the service's unparkable_idle is "count"
        self._kept_idle: Dict[str, Dict[int, int]] = {}
        self.check_gap = check_gap
        self._held_at: Dict[str, float] = {}
        self._checked_since: Optional[float] = None
        self._last_check: Optional[float] = None

    @property
    def devices(self) -> Dict[int, Device]:
        return {d.index: d for d in self.ledger.devices}

    def device_indexes(self, uuids: Iterable[str]) -> List[int]:
        """The indexes of the host's devices among `uuids`, in the host's order (others are not this host's)."""
        wanted = set(uuids)
        return [d.index for d in self.ledger.devices if d.uuid in wanted]

    def device_index(self, uuid: str) -> Optional[int]:
        """The index of the host's device `uuid`; None: not one of this host's."""
        return next((d.index for d in self.ledger.devices if d.uuid == uuid), None)

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
            self._drop_empty_leases()  # a store of an older version may hold leases of servers without grants

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
            self._limits[user] = policy.limits
            mine = [o.grant for o in self._owned.values() if o.grant.user == user]
            refusal = kernels_refusal(len(mine), policy.limits)
            if refusal:
                raise AdmissionRefused(refusal)
            allowed, over = self._within_budget(user, mine, policy, allowed)
            if over:
                if policy.on_full == "refuse":
                    raise AdmissionRefused(over)
                grant = self.ledger.grant(kernel_id, user, kernelspec, policy.decision, ())
                grant = replace(grant, cpu_only_reason=over)
                self.ledger.restore(grant)
            else:
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
            outcome = self._change_within_budget(held, requested, device, source)
            self._save_outcome(held, outcome)
            return outcome

    def reset(self, user: str, kernel_id: str, admin: bool) -> ChangeOutcome:
        with self._lock:
            held = self._mine(user, kernel_id, admin)
            source = "user request" if held.grant.user == user else f"admin {user}"
            outcome = self.ledger.reset(kernel_id, source=source)
            over = self._past_budget(held.grant.user, outcome.grant)
            if over:
                self.ledger.restore(held.grant)
                outcome = ChangeOutcome("refused", held.grant, f"the policy cap does not fit any more: {over}")
            self._save_outcome(held, outcome)
            return outcome

    def set_limits(self, user: str, limits: UserLimits) -> None:
        """What the hub's mapping says of `user` now (the service asks the hub at each grant and status)."""
        with self._lock:
            self._limits[user] = limits

    def set_kept_idle(self, kept: Mapping[str, Mapping[int, int]]) -> None:
        """User -> device index -> bytes of idle memory their kernels keep that could not be parked, as of the last
        sample: counted against each user's budget on top of their grants, for new kernels and raised caps."""
        with self._lock:
            self._kept_idle = {user: dict(held) for user, held in kept.items() if held}

    def kept_idle_of(self, user: str) -> Dict[int, int]:
        with self._lock:
            return dict(self._kept_idle.get(user, {}))

    def limits_of(self, user: str) -> UserLimits:
        with self._lock:
            return self._limits.get(user, self.host_limits)

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
                k: tuple(p)[:PIDS_PER_KERNEL]
                for k, p in kernels.items()
                if k in self._owned and self._owned[k].grant.user == user
            }
            gone = [
                kid
                for kid, o in self._owned.items()
                if o.grant.user == user
                and o.server == server
                and kid not in mine
                and now - o.granted_at >= self.start_grace
            ]
            self._release(gone)
            if any(o.grant.user == user and o.server == server for o in self._owned.values()):
                lease = Lease(user, server, now + self.lease_seconds, mine)
                self.journal.save_lease(lease)
                self._leases[(user, server)] = lease
            elif self._leases.pop((user, server), None) is not None:
                self.journal.delete_lease(user, server)  # nothing left to keep: no row for a server with no grant
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
            self._drop_empty_leases()
            return gone

    def registrations(self) -> List[Registration]:
        """Every PID the live leases register for one of their user's kernels: claims, for the sampler to verify."""
        with self._lock:
            return [
                Registration(lease.user, lease.server, kid, pid)
                for lease in self._leases.values()
                for kid, pids in lease.kernels.items()
                if kid in self._owned and self._owned[kid].grant.user == lease.user
                for pid in pids
            ]

    # --- which grants a live process holds -------------------------------------------------------

    def note_round(self, verified: Mapping[str, Tuple[int, ...]], now: float) -> None:
        """One round of the sampler's checks: kernel id -> its verified live PIDs."""
        with self._lock:
            if self._last_check is None or now - self._last_check > self.check_gap:
                self._checked_since = now  # checks (re)started: every grant gets a full period from here
            self._last_check = now
            for kid, pids in verified.items():
                if kid in self._owned and pids:
                    self._held_at[kid] = now
            self._held_at = {kid: at for kid, at in self._held_at.items() if kid in self._owned}

    def idle(self, now: float) -> List[str]:
        """Grants no verified live process of their user held for a lease period."""
        with self._lock:
            return idle_grants(
                self._owned.values(),
                self._held_at,
                self._checked_since,
                self._last_check,
                now,
                self.lease_seconds,
                self.check_gap,
            )

    def release_idle(self, now: float) -> List[str]:
        with self._lock:
            gone = self.idle(now)
            self._release(gone)
            self._drop_empty_leases()
            return gone

    # --- inside the lock ----------------------------------------------------------------------

    def _within_budget(
        self, user: str, mine: Sequence[Grant], policy: UserPolicy, allowed: Optional[Sequence[int]]
    ) -> Tuple[Optional[Sequence[int]], Optional[str]]:
        """(the devices a new kernel of this user may be placed on, None) or (_, why none may be)."""
        devices = self.devices
        candidates = list(devices) if allowed is None else [i for i in allowed if i in devices]
        wanted = {}
        for index in candidates:
            total = devices[index].total
            try:
                wanted[index] = min(
                    policy.decision.cap.to_bytes(total, f"device {index}"),
                    policy.decision.max_cap.to_bytes(total, f"device {index}"),
                )
            except PolicyError:
                continue  # the ledger says why this device cannot take the cap
        over = over_budget(self._with_kept_idle(user, user_totals(mine)), wanted, devices, policy.limits)
        if not over:
            return allowed, None
        within = [i for i in candidates if i not in over]
        if within and self.policy.placement != "none":  # "none": the kernel sees every device, needs all
            return within, None
        return allowed, "; ".join(over[i] for i in sorted(over)) + self._kept_idle_note(user)

    def _past_budget(self, user: str, grant: Grant) -> Optional[str]:
        """Why `grant` (a changed grant of `user`) passes the user's budget on one of its devices, or None."""
        others = self._others_totals(user, grant.kernel_id)
        over = over_budget(others, {i: grant.caps[i] for i in grant.devices}, self.devices, self.limits_of(user))
        return "; ".join(over[i] for i in sorted(over)) + self._kept_idle_note(user) if over else None

    def _change_within_budget(
        self, held: Owned, requested: CapSpec, device: Optional[int], source: str
    ) -> ChangeOutcome:
        """The ledger's change, with the owner's user budget as one more limit: a raise past it is clamped to
        what is left of it, or refused, as the host's on_over_max says. Lowering a cap always fits."""
        grant = held.grant
        limits = self.limits_of(grant.user)
        others = self._others_totals(grant.user, grant.kernel_id)
        targets = grant.devices if device is None else (device,)
        clamped: Dict[int, int] = {}
        for index in targets:
            if index not in grant.caps:
                break  # not one of the kernel's devices: the ledger refuses it
            room = room_for(others, self.devices[index], limits)
            wanted = requested.to_bytes(self.devices[index].total, f"device {index}")
            if room is None or wanted <= max(room, grant.caps[index]):
                continue
            if self.policy.on_over_max == "refuse" or room <= grant.caps[index]:
                return ChangeOutcome(
                    "refused",
                    grant,
                    f"{format_bytes(wanted)} on device {index} is above what your user_budget "
                    f"({limits.user_budget}) leaves for this kernel: {format_bytes(room)}"
                    + self._kept_idle_note(grant.user),
                )
            clamped[index] = room
        if not clamped:
            return self.ledger.change(grant.kernel_id, requested, device, source=source)
        notes, outcome = [], None
        for index in targets:
            spec = CapSpec(nbytes=clamped[index], text=format_bytes(clamped[index])) if index in clamped else requested
            outcome = self.ledger.change(grant.kernel_id, spec, index, source=source)
            if outcome.status == "refused":
                self.ledger.restore(grant)
                return ChangeOutcome("refused", grant, outcome.message)
            notes.append(
                f"clamped to {format_bytes(clamped[index])} on device {index}: what your user_budget "
                f"({limits.user_budget}) leaves for this kernel"
                if index in clamped
                else outcome.message
            )
        assert outcome is not None
        return ChangeOutcome("clamped", outcome.grant, "; ".join(notes))

    def _others_totals(self, user: str, kernel_id: str) -> Dict[int, int]:
        """What the user's kernels other than `kernel_id` hold on each device (their kept idle memory included)."""
        grants = self._owned.values()
        mine = user_totals(o.grant for o in grants if o.grant.user == user and o.grant.kernel_id != kernel_id)
        return self._with_kept_idle(user, mine)

    def _with_kept_idle(self, user: str, totals: Dict[int, int]) -> Dict[int, int]:
        for index, n in self._kept_idle.get(user, {}).items():
            totals[index] = totals.get(index, 0) + n
        return totals

    def _kept_idle_note(self, user: str) -> str:
        kept = sum(self._kept_idle.get(user, {}).values())
        if not kept:
            return ""
        return (
            f" (counting {format_bytes(kept)} your idle kernels keep on the GPU that could not be parked, on top of "
            "their grants: park or shut them down to free it)"
        )

    def _drop_empty_leases(self) -> None:
        servers = {(o.grant.user, o.server) for o in self._owned.values()}
        for key in [key for key in self._leases if key not in servers]:
            self.journal.delete_lease(*key)
            del self._leases[key]

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
            self._held_at.pop(kid, None)
