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
from typing import Dict, Hashable, List, Mapping, Optional, Protocol, Tuple, runtime_checkable

from ..threads import off_loop
from .broker import Plan, Round, told_words

log = logging.getLogger("gpu_quota_ext")


@runtime_checkable
class HostRooms(Protocol):
    """What a ledger's host service offers for brokering device memory (ledger.HostService; RemoteLedger)."""

    @property
    def brokers(self) -> bool:
        """False for a service that cannot broker (an older version without the room route)."""

    def room(self, body: dict) -> dict:
        """POST ROOM_PATH: the service's answer (raises OSError when it cannot be reached)."""


def kernel_park(kernel_id: str, state: str, idle_for: Optional[float], parkable: bool, stays: int = 0) -> dict:
    """KERNEL_PARK of the wire: one kernel's park state as the host's broker reads it. "stays" only where a fast
    park left bytes on the device: services older than it refuse a key they do not know, and only a server with
    fast_park on sends it."""
    entry = {
        "kernel_id": kernel_id,
        "state": state,
        "idle_for": None if idle_for is None else round(float(idle_for), 1),
        "parkable": bool(parkable),
    }
    if stays > 0:
        entry["stays"] = int(stays)
    return entry


def room_request(round_: Round, uuid_of: Mapping[Hashable, str]) -> dict:
    """This server's demands and kernels, devices named by UUID."""
    return {
        "park": [kernel_park(k.kernel_id, k.state, k.idle_for, k.parkable, k.stays) for k in round_.kernels],
        "demands": [
            {"kernel_id": d.kernel_id, "need": {uuid_of[i]: n for i, n in d.need.items() if i in uuid_of}}
            for d in round_.demands
            if not d.running  # a resume's parked bytes only: the wire has no running kernel's demand
        ],
    }


def plan_from(answer: object, mine: List[str]) -> Plan:
    """The service's answer as a Plan, keeping only this server's kernels (`mine`) and well-formed entries."""
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

    return Plan(
        go=tuple(ids("go")),
        park=tuple((k, "another kernel of this host") for k in ids("park")),
        waiting=words("waiting"),
        told=words("told"),
    )


class HostBroker:
    """A RoomBroker that asks the host service. When the service cannot be reached nothing is granted: the
    waiting kernels say so and wait (a resume without the host's word could take another user's room)."""

    makes_room_for_running = False  # the service's wire carries resumes only (park_on_device_full is refused)

    def __init__(self, rooms: HostRooms, uuid_of: Mapping[int, str]):
        self.rooms = rooms
        self.uuid_of: Dict[Hashable, str] = {index: uuid for index, uuid in uuid_of.items()}
        self._named = False  # the service last heard of demands of this server

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
        if not body["demands"] and not self._named:
            return Plan()  # only the lease reports this server's kernels when none of them waits
        # (A call naming none ends at once the demands the service has of this server: a wait that ended unserved
        # must not make it park another user's kernel until this server's next lease report.)
        try:
            answer = await off_loop(self.rooms.room, body, name="gpu-quota-room")
        except Exception as error:  # broad: OSError by contract, but the HTTP stack under it may raise others
            log.debug("gpu-quota-ext: the host service's room call failed: %r", error)
            reason = f"the host's GPU quota service does not answer ({error}); waiting for it"
            return told_at_limit(Plan(waiting={d.kernel_id: reason for d in round_.demands}), round_)
        self._named = bool(body["demands"])
        return told_at_limit(plan_from(answer, mine), round_)


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
        plan = told_at_limit(plan_from(answer, mine), round_)
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
