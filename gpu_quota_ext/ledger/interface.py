"""The ledger's interface: grants, the answers to cap requests, and the `Ledger` protocol (its reads alone:
`GrantReads`).

A grant says "kernel K may use `cap` bytes on device D". Every change of a cap goes through a ledger, so
the ledger's answer is the truth the launch hook, the magic, the API and the sidebar all show. The server
depends on this interface only: `LocalLedger` (local.py) keeps the record in this server's memory;
a remote ledger asks the host's quota service, which keeps one record for every user of the host.

Calls may block (a remote ledger waits for the service, up to its timeout), so the manager makes every
write (grant, change, reset, release) off the event loop. Reads (get, grants, device_grants, devices) answer
from memory at once: a remote ledger keeps a copy of this server's grants as the service last answered.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import (
    Callable,
    Dict,
    List,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    Set,
    Tuple,
    runtime_checkable,
)

from ..devices import Device
from ..policy import PolicyDecision
from ..shared.sizes import CapSpec


class AdmissionRefused(Exception):
    """No device has budget left for this kernel and policy says refuse (`on_full = "refuse"`), or the ledger
    cannot admit it for another `reason` (a host service that cannot be reached or used: remote.py)."""

    def __init__(self, message: str, reason: str = "GPU budget full"):
        super().__init__(message)
        self.reason = reason  # a few words for the HTTP answer's "reason"


class UnknownKernel(KeyError):
    """The ledger holds no grant for this kernel id."""


@dataclass(frozen=True)
class Grant:
    """A kernel's caps. `caps` maps device index -> bytes; empty `devices` means the kernel runs on CPU."""

    kernel_id: str
    user: str
    kernelspec: str
    devices: Tuple[int, ...]
    caps: Mapping[int, int]
    policy_caps: Mapping[int, int]  # what policy gave at start: `%gpucap reset` returns here
    max_caps: Mapping[int, int]
    source: str  # who set the current cap: "default", "rule 0 (user=alice)", "kernel request", ...
    placed: bool  # True when the launch hook chose the devices through CUDA_VISIBLE_DEVICES
    cpu_only_reason: Optional[str] = None

    def to_json(self) -> dict:
        return {
            "kernel_id": self.kernel_id,
            "user": self.user,
            "kernelspec": self.kernelspec,
            "source": self.source,
            "placed": self.placed,
            "cpu_only_reason": self.cpu_only_reason,
            "devices": [
                {"index": d, "cap": self.caps[d], "max_cap": self.max_caps[d], "policy_cap": self.policy_caps[d]}
                for d in self.devices
            ],
        }


@dataclass(frozen=True)
class ChangeOutcome:
    """The ledger's answer to a cap request: "granted", "clamped" (to what) or "refused" (why)."""

    status: str
    grant: Grant
    message: str


class HeldGrants:
    """The reads every ledger answers from memory at once (GrantReads): `_grants` (kernel id -> Grant) under `_lock`,
    which the implementation sets up and writes."""

    _grants: Dict[str, Grant]
    _lock: threading.Lock

    def get(self, kernel_id: str) -> Optional[Grant]:
        with self._lock:
            return self._grants.get(kernel_id)

    def grants(self) -> List[Grant]:
        with self._lock:
            return list(self._grants.values())


def _no_processes(kernel_ids: Set[str]) -> Dict[str, List[int]]:
    return {}


def _no_park_report() -> Sequence[dict]:
    return []


def _no_park_requests(kernel_ids: List[str]) -> None:
    return None


@dataclass(frozen=True)
class LeaseHooks:
    """What the server tells a host service's lease (lease.py), and what it does with the lease's answers; each is
    called in the lease's thread and must not raise past a log line (the lease goes on without it)."""

    # kernel ids -> {kernel id: its processes' PIDs} (usage.attribution, as for the monitor)
    processes: Callable[[Set[str]], Dict[str, List[int]]] = _no_processes
    # this server's kernels' park states (KERNEL_PARK of the wire), as the event loop last published them
    park_report: Callable[[], Sequence[dict]] = _no_park_report
    # the kernels of this server the service asks to park (the parker decides, on the event loop)
    on_park_requests: Callable[[List[str]], None] = _no_park_requests


class HostService(Protocol):
    """The host's quota service behind a ledger (a user server of a hub host, remote.py): beyond the grants it
    brokers the host's device memory (`brokers`, `room`: what parking.HostRooms asks) and keeps a lease that
    carries this server's park states and the service's park requests (`subscribe`, once, by the manager)."""

    @property
    def brokers(self) -> bool:
        """False for a service of an older version that cannot broker (no room route, no park requests)."""

    def room(self, body: dict) -> dict:
        """POST ROOM_PATH: the service's answer (raises OSError when it cannot be reached)."""

    def subscribe(self, hooks: LeaseHooks) -> None:
        """What the lease reports and whom it tells about park requests, from the next renewal on."""


class GrantReads(Protocol):
    """The reads of a ledger, answered from memory at once (HeldGrants has them): what the parker and the kernels'
    lifecycle need of it, who write nothing."""

    def get(self, kernel_id: str) -> Optional[Grant]: ...

    def grants(self) -> List[Grant]: ...


@runtime_checkable
class Ledger(GrantReads, Protocol):
    """What the server needs of a ledger: its reads (GrantReads) and its writes, which raise AdmissionRefused,
    PolicyError or UnknownKernel."""

    def grant(
        self,
        kernel_id: str,
        user: str,
        kernelspec: str,
        decision: PolicyDecision,
        allowed: Optional[Sequence[int]] = None,
    ) -> Grant:
        """Admit a starting kernel with policy's `decision`; `allowed` narrows placement to these device
        indexes. A kernel that holds a grant already (a restart) keeps it."""

    def change(
        self, kernel_id: str, requested: CapSpec, device: Optional[int] = None, source: str = "kernel request"
    ) -> ChangeOutcome:
        """A new cap on one granted device (or all), within max_cap and the device's budget."""

    def reset(self, kernel_id: str, source: str = "kernel request") -> ChangeOutcome:
        """Back to what policy gave the kernel at start, as far as the budget allows."""

    def release(self, kernel_id: str) -> Optional[Grant]:
        """The kernel is gone: its budget is free again. Idempotent."""

    def device_grants(self) -> List[dict]:
        """Per device: index, name, uuid, total, budget, granted bytes and kernel count (what is granted,
        not what is used: usage is the monitor's)."""

    @property
    def devices(self) -> List[Device]: ...

    def decided_by(self) -> Optional[str]:
        """Who decides caps and admission when this server does not (its own c.GpuQuota policy then does not
        apply): a line for the status API, e.g. "the host's GPU quota service at <url>"; None: this server."""

    def host_service(self) -> Optional[HostService]:
        """The host's quota service this ledger asks (it brokers device memory for every user of the host and
        takes this server's lease hooks), or None: this server decides alone. The manager wires parking by it."""

    def close(self) -> None:
        """The server stops: end whatever the ledger runs in the background (a remote ledger's lease)."""
