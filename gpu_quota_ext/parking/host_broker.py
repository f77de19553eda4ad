"""The host's broker, asked by a user server of a hub host: on such a host the budget is one, so the view is one.
The host service (hub/service/room.py) runs the same decisions (broker.py) over every user's kernels and its own
NVML, and answers for this server's kernels that wait; it reaches this server's idle kernels it chose to park
through the lease's answer (ledger/lease.py hands them to the manager's `on_park_requests` hook, which passes them
to `Parker.park_for_host` on the event loop). The room calls go over ledger/transport.py (HTTP to the service).

This module only translates: a Round of this server (device indexes) to the wire (device UUIDs,
shared.service_contract ROOM_PATH), and the answer back to a Plan. The call itself blocks (HTTP to the service):
it runs off the event loop.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Dict, Hashable, List, Mapping, Optional, Protocol, Sequence, Set, Tuple, runtime_checkable

from ..shared.park_state import ParkState
from ..shared.service_contract import MAX_BYTES
from ..threads import off_loop
from .broker import KernelView, Plan, Round, told_words

log = logging.getLogger("gpu_quota_ext")


@runtime_checkable
class HostRooms(Protocol):
    """What a ledger's host service offers for brokering device memory (ledger.HostService; RemoteLedger)."""

    @property
    def brokers(self) -> bool:
        """False for a service that cannot broker (an older version without the room route)."""

    def room(self, body: dict) -> dict:
        """POST ROOM_PATH: the service's answer (raises OSError when it cannot be reached)."""


def kernel_park(
    kernel_id: str,
    state: str,
    idle_for: Optional[float],
    parkable: bool,
    stays: int = 0,
    releases_as_copied: bool = False,
) -> dict:
    """KERNEL_PARK of the wire: one kernel's park state as the host's broker reads it. "stays" only where a fast
    park left bytes on the device, "releases_as_copied" only for a park under way that gives its device memory back
    piece by piece as it copies (a swap's room, broker.py): services older than them refuse a key they do not
    know, and only a server with fast_park on sends them."""
    entry: dict = {
        "kernel_id": kernel_id,
        "state": state,
        "idle_for": None if idle_for is None else round(float(idle_for), 1),
        "parkable": bool(parkable),
    }
    if stays > 0:
        entry["stays"] = int(stays)
    if releases_as_copied and state == ParkState.PARKING:
        entry["releases_as_copied"] = True
    return entry


def reported(kernel: KernelView) -> dict:
    """The kernel's KERNEL_PARK, as the lease's report and every room call send it."""
    return kernel_park(
        kernel.kernel_id, kernel.state, kernel.idle_for, kernel.parkable, kernel.stays, kernel.releases_as_copied
    )


def room_request(round_: Round, uuid_of: Mapping[Hashable, str]) -> dict:
    """This server's demands and kernels, devices named by UUID. "may_wait" only for a fast-path resume (it may go
    while the parks making its room still copy): services older than it refuse a key they do not know."""
    demands = []
    for demand in round_.demands:
        if demand.running:
            continue  # a resume's parked bytes only: the wire has no running kernel's demand
        entry: dict = {
            "kernel_id": demand.kernel_id,
            "need": {uuid_of[i]: n for i, n in demand.need.items() if i in uuid_of},
        }
        if demand.may_wait:
            entry["may_wait"] = True
        demands.append(entry)
    return {"park": [reported(k) for k in round_.kernels], "demands": demands}


def plan_from(answer: object, mine: List[str], uuid_of: Mapping[Hashable, str]) -> Plan:
    """The service's answer as a Plan, keeping only this server's kernels (`mine`) and well-formed entries; its
    devices named by this server's keys again (`uuid_of`, this server's key -> device UUID)."""
    if not isinstance(answer, dict):
        return Plan()

    def ids(key: str) -> List[str]:
        value = answer.get(key)
        return [k for k in value if isinstance(k, str) and k in mine] if isinstance(value, list) else []

    def words(key: str) -> Dict[str, str]:
        value = answer.get(key)
        if not isinstance(value, dict):
            return {}
        return {k: v for k, v in value.items() if k in mine and isinstance(v, str)}

    go = tuple(ids("go"))
    return Plan(
        go=go,
        park=tuple((k, "another kernel of this host") for k in ids("park")),
        waiting=words("waiting"),
        told=words("told"),
        freeing=freeing_from(answer.get("freeing"), go, {uuid: key for key, uuid in uuid_of.items()}),
    )


def freeing_from(value: object, go: Sequence[str], key_of: Mapping[str, Hashable]) -> Dict[str, Dict[Hashable, int]]:
    """The answer's "freeing" (kernel -> device UUID -> bytes, for a swap's go) as Plan.freeing: only for kernels
    that go in the same answer, only devices this server knows and byte counts that can be true. The service is
    trusted, but a word it got wrong must not make a restore count memory that nobody frees."""
    if not isinstance(value, dict):
        return {}
    freeing: Dict[str, Dict[Hashable, int]] = {}
    for kernel_id, by_uuid in value.items():
        if kernel_id not in go or not isinstance(by_uuid, dict):
            continue
        by_key = {
            key_of[uuid]: nbytes
            for uuid, nbytes in by_uuid.items()
            if isinstance(uuid, str) and uuid in key_of and _byte_count(nbytes)
        }
        if by_key:
            freeing[kernel_id] = by_key
    return freeing


def _byte_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < MAX_BYTES


class HostBroker:
    """A RoomBroker that asks the host service. When the service cannot be reached nothing is granted: the
    waiting kernels say so and wait (a resume without the host's word could take another user's room)."""

    makes_room_for_running = False  # the service's wire carries resumes only (park_on_device_full is refused)

    def __init__(self, rooms: HostRooms, uuid_of: Mapping[int, str]):
        self.rooms = rooms
        self.uuid_of: Dict[Hashable, str] = {index: uuid for index, uuid in uuid_of.items()}
        self._named = False  # the service last heard of demands of this server
        # This server's parks under way that release as they copy and that a room call has named: the service hears
        # of each one at once, not at the next lease report (a swap's resume may go while it copies).
        self._told_releasing: Set[str] = set()

    @property
    def problem(self) -> Optional[str]:
        """Why this server must not park now, or None: a host service that does not broker could never give a
        parked kernel room to come back to (other users' kernels are not this server's to count)."""
        if getattr(self.rooms, "brokers", True):
            return None
        return (
            "the host's GPU quota service is of an older version that does not broker device memory: a parked kernel "
            "could not come back"
        )

    async def decide(self, round_: Round) -> Plan:
        mine = [k.kernel_id for k in round_.kernels]
        body = room_request(round_, self.uuid_of)
        releasing = {k.kernel_id for k in round_.kernels if k.state == ParkState.PARKING and k.releases_as_copied}
        self._told_releasing &= releasing  # a park that ended (or failed) is told afresh when it parks again
        if not body["demands"] and not self._named and releasing <= self._told_releasing:
            return Plan()  # only the lease reports this server's kernels when none of them waits
        # (A call naming none ends at once the demands the service has of this server: a wait that ended unserved
        # must not make it park another user's kernel until this server's next lease report. A park that began to
        # release as it copies is named at once: another user's resume may go while it copies, a swap, and the next
        # lease report may come after the park has ended.)
        try:
            answer = await off_loop(self.rooms.room, body, name="gpu-quota-room")
        except Exception as error:  # broad: OSError by contract, but the HTTP stack under it may raise others
            log.debug("gpu-quota-ext: the host service's room call failed: %r", error)
            reason = f"the host's GPU quota service does not answer ({error}); waiting for it"
            return told_at_limit(Plan(waiting={d.kernel_id: reason for d in round_.demands}), round_)
        self._named = bool(body["demands"])
        self._told_releasing |= releasing
        return told_at_limit(plan_from(answer, mine, self.uuid_of), round_)

    async def promise_host(self, round_: Round, kernel_id: str, nbytes: int) -> Tuple[Optional[str], Plan]:
        """Ask the service to promise a park of ours its host memory before its driver call: the service holds one
        account for every user's parks on this host (two users' idle timers in the same second must not both
        get the host's memory). (Why not, or None: promised; the plan the same answer carries, for this server's
        waiting kernels: the call names them, as every room call does.) Without the service's word, nothing
        parks: another user's park may be under way."""
        mine = [k.kernel_id for k in round_.kernels]
        body = room_request(round_, self.uuid_of)
        body["host_park"] = {"kernel_id": kernel_id, "bytes": int(nbytes)}
        try:
            answer = await off_loop(self.rooms.room, body, name="gpu-quota-host-park")
        except Exception as error:  # broad: OSError by contract, but the HTTP stack under it may raise others
            log.debug("gpu-quota-ext: the host service's host park call failed: %r", error)
            if str(error).startswith("HTTP 4"):  # it answered: a refusal (another user's kernel, a bad body)
                return f"did not park: the host's GPU quota service refused it ({error})", Plan()
            why = f"the host's GPU quota service does not answer ({error}); it holds the host's memory for every user"
            return f"did not park: {why}", Plan()
        self._named = bool(body["demands"])
        plan = told_at_limit(plan_from(answer, mine, self.uuid_of), round_)
        host = answer.get("host_park") if isinstance(answer, dict) else None
        if not isinstance(host, dict) or host.get("kernel_id") != kernel_id:
            return "did not park: the host's GPU quota service did not answer for the host's memory", plan
        refused = host.get("refused")
        if refused is None:
            return None, plan
        words = str(refused)[:500]
        return (words if words.startswith("did not park") else f"did not park: {words}"), plan


def told_at_limit(plan: Plan, round_: Round) -> Plan:
    """The wait limit is this server's promise to its user: a demand past it that the service did not tell (it does
    not answer, or its own clock for the demand began later) is told here, with what it waits for. Telling changes
    nothing of the demand: a "go" may still come."""
    limit = round_.settings.wait_limit
    if limit is None:
        return plan
    told = dict(plan.told)
    for demand in round_.demands:
        kernel_id = demand.kernel_id
        if kernel_id in told or kernel_id in plan.go or round_.now - demand.since < limit:
            continue
        told[kernel_id] = told_words(limit, plan.waiting.get(kernel_id) or "the host's GPU quota service did not say")
    return plan if told == dict(plan.told) else replace(plan, told=told)
