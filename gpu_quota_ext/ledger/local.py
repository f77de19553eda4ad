"""The local ledger: this server's record of grants, in memory. Admission (budget per device) and
placement happen here.

No I/O here. One lock makes each operation atomic, so concurrent kernel starts (from the event loop or
threads) can never over-commit a device. It implements the `Ledger` interface (interface.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..devices import Device
from ..policy import Policy, PolicyDecision
from ..shared.sizes import CapSpec, PolicyError, format_bytes, shown
from .interface import AdmissionRefused, ChangeOutcome, Grant, HeldGrants, UnknownKernel


class _Refused(Exception):
    """Internal: a cap request the ledger turns down, with the reason."""


@dataclass
class _DeviceBook:
    device: Device
    budget: Optional[int]  # None: no admission control on this device
    granted: Dict[str, int] = field(default_factory=dict)  # kernel id -> cap bytes

    @property
    def granted_total(self) -> int:
        return sum(self.granted.values())

    def room(self) -> Optional[int]:
        return None if self.budget is None else self.budget - self.granted_total

    def fits(self, nbytes: int) -> bool:
        room = self.room()
        return room is None or room >= nbytes


def budget_of(device: Device, overcommit: Optional[float]) -> Optional[int]:
    return None if overcommit is None else int(device.total * overcommit)


def choose_devices(
    books: Sequence[_DeviceBook], caps: Mapping[int, int], count: int, strategy: str
) -> Optional[List[int]]:
    """Pick `count` devices that each have room for their cap, or None.

    spread: least granted first (kernels spread out, each gets the emptiest GPU);
    pack: lowest index first (fill GPU 0 up to its budget, keep the others free for big jobs).
    """
    fitting = [b for b in books if b.fits(caps[b.device.index])]
    if len(fitting) < count:
        return None
    if strategy == "pack":
        fitting.sort(key=lambda b: b.device.index)
    else:
        fitting.sort(key=lambda b: (b.granted_total / b.device.total, len(b.granted), b.device.index))
    return sorted(b.device.index for b in fitting[:count])


class LocalLedger(HeldGrants):
    """In-memory ledger for one server (or for the host, held by the quota service)."""

    def __init__(self, devices: Sequence[Device], policy: Policy):
        self._policy = policy
        self._books = {d.index: _DeviceBook(d, budget_of(d, policy.overcommit)) for d in devices}
        self._grants: Dict[str, Grant] = {}
        self._lock = threading.Lock()

    # --- the interface ------------------------------------------------------------------------

    def grant(
        self,
        kernel_id: str,
        user: str,
        kernelspec: str,
        decision: PolicyDecision,
        allowed: Optional[Sequence[int]] = None,
    ) -> Grant:
        """Admit a starting kernel. A kernel that already holds a grant (a restart) keeps it as it is.

        `allowed` narrows placement to these device indexes (a kernelspec that pins its own GPUs).
        Raises AdmissionRefused when nothing fits and policy says refuse.
        """
        with self._lock:
            existing = self._grants.get(kernel_id)
            if existing is not None:
                return existing
            books = [b for i, b in sorted(self._books.items()) if allowed is None or i in allowed]
            new = self._admit(kernel_id, user, kernelspec, decision, books)
            self._grants[kernel_id] = new
            for index in new.devices:
                self._books[index].granted[kernel_id] = new.caps[index]
            return new

    def change(
        self, kernel_id: str, requested: CapSpec, device: Optional[int] = None, source: str = "kernel request"
    ) -> ChangeOutcome:
        """Ask for a new cap on one granted device (or all). Checks max_cap, then the device budget.
        `source` says who asked ("kernel request": %gpucap; "user request": the sidebar or the API)."""
        with self._lock:
            current = self._get(kernel_id)
            targets = self._targets(current, device)
            caps = dict(current.caps)
            notes = []
            try:
                for index in targets:
                    total = self._books[index].device.total
                    wanted = requested.to_bytes(total, f"device {index}")
                    if requested.nbytes is not None and requested.nbytes > total:
                        notes.append(f"device {index} has only {format_bytes(total)}")
                    limit = current.max_caps[index]
                    if wanted > limit:
                        if self._policy.on_over_max == "refuse":
                            raise _Refused(
                                f"{format_bytes(wanted)} on device {index} is above your max_cap of "
                                f"{format_bytes(limit)}"
                            )
                        notes.append(f"clamped to max_cap {format_bytes(limit)} on device {index}")
                        wanted = limit
                    caps[index] = self._fit_budget(current, index, wanted, notes)
            except _Refused as refusal:
                return ChangeOutcome("refused", current, str(refusal))
            updated = replace(current, caps=caps, source=source)
            self._store(updated)
            message = "; ".join(notes) or "cap set to " + ", ".join(
                f"{format_bytes(caps[i])} on device {i}" for i in targets
            )
            return ChangeOutcome("clamped" if notes else "granted", updated, message)

    def reset(self, kernel_id: str, source: str = "kernel request") -> ChangeOutcome:
        """Back to what policy gave the kernel at start, if the budget still has room for it: other
        kernels may have taken what this one gave up since (then clamped or refused like any request).
        `source` says who asked, as for `change`; the grant's source becomes "policy" unless clamped."""
        with self._lock:
            current = self._get(kernel_id)
            caps = dict(current.caps)
            notes: List[str] = []
            try:
                for index in current.devices:
                    caps[index] = self._fit_budget(current, index, current.policy_caps[index], notes)
            except _Refused as refusal:
                return ChangeOutcome("refused", current, f"{refusal}: the policy cap does not fit any more")
            updated = replace(
                current, caps=caps, source=f"{source} (reset, clamped to the budget)" if notes else "policy"
            )
            self._store(updated)
            return ChangeOutcome(
                "clamped" if notes else "granted",
                updated,
                "; ".join(notes) or "cap reset to what policy gives this kernel",
            )

    def release(self, kernel_id: str) -> Optional[Grant]:
        """The kernel was shut down, culled or died: its budget is free again. Idempotent."""
        with self._lock:
            gone = self._grants.pop(kernel_id, None)
            for book in self._books.values():
                book.granted.pop(kernel_id, None)
            return gone

    def device_grants(self) -> List[dict]:
        """Per device: total, budget and granted bytes (what the status API shows)."""
        with self._lock:
            return [
                {
                    "index": b.device.index,
                    "name": b.device.name,
                    "uuid": b.device.uuid,
                    "total": b.device.total,
                    "budget": b.budget,
                    "granted": b.granted_total,
                    "kernels": len(b.granted),
                }
                for _, b in sorted(self._books.items())
            ]

    @property
    def devices(self) -> List[Device]:
        return [b.device for _, b in sorted(self._books.items())]

    def decided_by(self) -> Optional[str]:
        return None  # this server's own policy decides

    def host_service(self) -> None:
        return None  # no host service: this server's own broker decides, and there is no lease

    def close(self) -> None:
        """Nothing runs in the background: the record is memory only."""

    # --- inside the lock ----------------------------------------------------------------------

    def _fit_budget(self, current: Grant, index: int, wanted: int, notes: List[str]) -> int:
        """`wanted` on device `index` if its budget has room, else the most that fits (noted);
        _Refused when policy says refuse or nothing more fits. Lowering a cap always fits."""
        room = self._books[index].room()
        held = current.caps[index]
        if wanted <= held or room is None or wanted - held <= room:
            return wanted
        most = held + max(room, 0)
        if self._policy.on_over_max == "refuse" or most <= held:
            raise _Refused(
                f"device {index} has {format_bytes(max(room, 0))} of budget left; {format_bytes(wanted)} does not fit"
            )
        notes.append(
            f"clamped to {format_bytes(most)}: only {format_bytes(max(room, 0))} of device {index}'s budget was left"
        )
        return most

    def _admit(
        self, kernel_id: str, user: str, kernelspec: str, decision: PolicyDecision, books: Sequence[_DeviceBook]
    ) -> Grant:
        def grant_on(indexes: Sequence[int], placed: bool, reason: Optional[str] = None) -> Grant:
            caps = {i: wanted_on(i) for i in indexes}
            max_caps = {i: decision.max_cap.to_bytes(self._books[i].device.total, f"device {i}") for i in indexes}
            return Grant(
                kernel_id, user, kernelspec, tuple(indexes), caps, dict(caps), max_caps, decision.source, placed, reason
            )

        def wanted_on(index: int) -> int:
            # A cap never exceeds max_cap: written in different forms ("12GiB" and "0.1"), they meet only here.
            total = self._books[index].device.total
            return min(
                decision.cap.to_bytes(total, f"device {index}"), decision.max_cap.to_bytes(total, f"device {index}")
            )

        if not self._books:
            return grant_on((), placed=False)  # no GPU on this server: nothing to cap
        if not books:
            # The kernelspec pins GPUs this server does not manage: it can be neither capped nor watched.
            reason = f"kernelspec {shown(kernelspec)} asks for GPUs this server does not manage"
            if self._policy.on_full == "refuse":
                raise AdmissionRefused(reason)
            return grant_on((), placed=True, reason=reason)
        wanted = {b.device.index: wanted_on(b.device.index) for b in books}
        if self._policy.placement == "none":
            # The kernel sees every device: it needs room on all of them.
            if all(b.fits(wanted[b.device.index]) for b in books):
                return grant_on([b.device.index for b in books], placed=False)
        else:
            chosen = choose_devices(books, wanted, min(decision.devices, len(books)), self._policy.placement)
            if chosen is not None:
                return grant_on(chosen, placed=True)
        reason = (
            f"no GPU has {decision.cap} of budget left for kernelspec {shown(kernelspec)} "
            f"(overcommit {self._policy.overcommit})"
        )
        if self._policy.on_full == "refuse":
            raise AdmissionRefused(reason)
        return grant_on((), placed=True, reason=reason)

    def _get(self, kernel_id: str) -> Grant:
        try:
            return self._grants[kernel_id]
        except KeyError:
            raise UnknownKernel(kernel_id) from None

    def _targets(self, grant: Grant, device: Optional[int]) -> Tuple[int, ...]:
        if not grant.devices:
            raise PolicyError("this kernel holds no GPU (it runs on CPU), so it has no cap to change")
        if device is None:
            return grant.devices
        if device not in grant.devices:
            raise PolicyError(f"device {device} is not one of this kernel's devices {list(grant.devices)}")
        return (device,)

    def _store(self, grant: Grant) -> None:
        self._grants[grant.kernel_id] = grant
        for index in grant.devices:
            self._books[index].granted[grant.kernel_id] = grant.caps[index]
