"""The host's broker: one view of every user's kernels for the broker's decisions (parking/broker.py), and what
the service keeps between two of them. Pure: no I/O, no clock (callers pass `now`, wall-clock seconds), like
book.py; the service (broker.py) reads the sample and host memory, and wakes the servers' long polls.

On a hub host the budget is one, so the view is one: a user server whose kernel waits for device memory asks
here (the room call, shared.service_contract.ROOM_PATH) at every sample, and the broker decides over every
user's kernels at once; idle kernels of other servers it chose to park reach their servers through their leases'
answers. What the service believes of each:

- devices: the book's, by uuid; their usage the service's own NVML sample (never a server's word).
- kernels: every grant the book holds; their usage the sampler's verified usage (processes of the kernel's own
  Unix user only, attribution.py); their park state, idle time and "parkable" the last report of their own
  server (the lease's or the room call's "park"): a server's word about its own kernels, which decides whether
  they may be parked and whether a park of theirs is under way, shown to the broker by the same rule as a server's
  own parker uses (parking/shown.py). A kernel never reported counts as running (its headroom claimed) and is
  never parked. A report of "parked" while the sample still shows the kernel's memory, taken no later than the
  first report of "parked" (so before the park ended), counts as a park under way: its bytes are coming, no other
  kernel parks for them; memory a later sample shows is what the driver leaves on the device (parked, not a park).
  A park said to be under way is believed no longer than a park can take (its bytes at PARK_RATE, plus
  PARK_MARGIN), counted from the first report of a park not yet seen done: a blip of "busy" between two
  "parking" reports does not start it again. Then the kernel counts as running. A kernel its
  server took a park request for and, DECLINE_GRACE seconds later, still reports idle and parkable has declined
  it: it counts as not parkable until its server reports another state, and the broker chooses the next idle
  kernel at once (one server's word never stalls the others). A kernel its server took a park
  request for, still reported idle, whose memory a sample taken since shows gone, counts as parked: its server's
  report says so at its next renewal, and the resume it made room for need not wait for that.
  A park said to release each piece as it is copied (KERNEL_PARK's "releases_as_copied": the fast path's) is
  believed to while the kernel is reported "parking" and shown PARKING by the rule above (its park-time bound);
  said of any other state, the word is ignored. What a lie (a checkpoint park said to release) can do: let another
  user's fast-path resume go early and wait, bounded, inside its kernel for memory that does not come free; that
  resume then gives back what it took and stays parked, whole, and waits for room again: a delay, never a loss.
- demands: a server's waiting kernels, with the time the service first heard of each (never the server's word);
  a need is cut to the kernel's cap there plus CONTEXT_ALLOWANCE, or to the most its samples saw it hold there. A
  demand of a kernel the sample shows holding memory (not parked, whatever its server says) is not decided until a
  sample shows it off the device. A room call names all of its server's demands: those it no longer names have
  ended; a lease report saying a kernel no longer waits ends its demand too. A demand said to be a fast-path
  resume ("may_wait": it waits, bounded, for memory being freed, and fails recoverably) is believed only of a
  kernel its server's last report says the fast path parked ("stays" above 0, state parked or waiting): the
  checkpoint path's restore must never go into a device that is not free yet (it would lose the process); a
  server that lies here risks its own user's kernel only (others' parks go on as decided). A swap's "go" (a
  may_wait demand that goes while releasing parks still copy) says what of its need those parks are still freeing
  ("freeing"), which its server cannot see on a hub host; asked again on that room, the "go" says it again.
- reservations: the room a "go" gave a resume, held until a sample taken after it shows the kernel's verified
  usage back on each device, or a sample taken after a report of the kernel running again, or a timeout (its
  bytes at RESTORE_RATE plus RESERVATION_MARGIN): no other decision takes that room meanwhile. A kernel that asks
  again while it holds one (its answer was lost, or its server found the room taken right before the call) is
  answered "go" again, on the same reservation.
- park requests: per (user, server), the idle kernels chosen to park, until that server's lease takes them; one
  taken is not asked again before its server has reported it parking (or busy, or not parkable) since, or
  REQUEST_TTL has passed.
- host memory: one account for every user's parks (parking/host_account.py). Before its driver call, a server's
  park asks here (the room call's "host_park") and is promised its bytes (the most of what the server says and
  what the service's last sample saw the kernel hold) only if the host's memory, less every park under way, keeps the
  margin; parks other servers report under way without a promise are counted whole. A promise ends when its
  server reports the kernel parked or running again, or when a park of its size must have ended (PARK_RATE,
  PARK_MARGIN). Promised bytes are counted whole until then (the service does not read other users' resident
  memory): on a hub host a park may be refused while another's copy is half done, never promised too much.

Words say which kernel waits or parks only to its own user: another user's kernel is "of another user".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import AbstractSet, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ...devices import Device
from ...parking import (
    BrokerSettings,
    Demand,
    DeviceView,
    HostAccount,
    HostReading,
    HostView,
    KernelView,
    Plan,
    Reservation,
    Round,
    Said,
    park_time,
    shown_as,
)
from ...shared.park_state import MOVING, ON_DEVICE, ON_HOST, ParkState
from ...shared.service_contract import CONTEXT_ALLOWANCE, SWAP_WAIT
from .book import Owned

RESTORE_RATE = 2e9  # bytes per second a restore is counted to take at the slowest (an H200 measured ~5.5 GB/s)
RESERVATION_MARGIN = 30.0  # seconds a reservation is held beyond that
REQUEST_TTL = 60.0  # seconds a park request waits for its server's lease, or for its server's next report
DECLINE_GRACE = 5.0  # seconds after its server took a park request before a report of "idle, parkable" declines it
OTHERS = "of another user"  # how the words name another user's kernel

Key = Tuple[str, str]  # (user, server)


class RoomRefused(Exception):
    """A room call the service refuses, whole: nothing of it is kept."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class ParkReport:
    """KERNEL_PARK of the wire: a kernel's park state as its server reported it."""

    state: str
    idle_for: Optional[float] = None
    parkable: bool = False
    stays: int = 0  # parked by the fast path: bytes its park left on the device (at most CONTEXT_ALLOWANCE)
    releases_as_copied: bool = False  # parking through the fast path, each piece given back as it is copied


@dataclass(frozen=True)
class Heard:
    report: ParkReport
    user: str
    server: str
    at: float  # when the service heard it
    since: float = 0.0  # when the service first heard this state (parking and parked: one park) without a break
    parked_at: Optional[float] = None  # when it first heard "parked" without a break: the park ended before this


@dataclass(frozen=True)
class Waiting:
    """A demand as the service keeps it."""

    kernel_id: str
    user: str
    server: str
    need: Mapping[str, int]  # uuid -> bytes, cut to cap + CONTEXT_ALLOWANCE
    since: float  # when the service first heard of it
    asked: float  # when its server last named it
    reason: Optional[str] = None  # what its own user was last told it waits for
    told: Optional[str] = None  # the message at the wait limit
    may_wait: bool = False  # its server says it is a fast-path resume (believed as room.py's docstring says)


@dataclass(frozen=True)
class Held:
    """A reservation: the room a resume was given."""

    kernel_id: str
    user: str
    server: str
    held: Mapping[str, int]  # uuid -> bytes still held
    since: float
    until: float  # held no longer than this
    running_seen: Optional[float] = None  # when a report first said the kernel runs again
    # A swap's go: what of its need the parks under way were still freeing (uuid -> bytes), said again with the "go"
    # when it is asked again on this room (its first answer lost): its server cannot see other users' parks.
    freeing: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Asked:
    """A park request: an idle kernel the broker chose, for another kernel's demand."""

    kernel_id: str
    user: str
    server: str
    for_kernel: str
    for_user: str
    at: float
    delivered: Optional[float] = None  # when its server took it (its lease's answer, or its own room call)


@dataclass(frozen=True)
class Checked:
    """A room call, checked against the book: the reports and demands of the caller's own kernels."""

    reports: Mapping[str, ParkReport]
    demands: Mapping[str, Mapping[str, int]]
    unknown: Tuple[str, ...] = ()  # demands of kernels the service holds no grant for


@dataclass(frozen=True)
class Answer:
    """What a room call answers (the wire's dict: `json()`), and the servers whose long polls wake."""

    go: Tuple[str, ...] = ()
    park: Tuple[str, ...] = ()
    waiting: Mapping[str, str] = field(default_factory=dict)
    told: Mapping[str, str] = field(default_factory=dict)
    wake: Tuple[Key, ...] = ()
    asked: Tuple[Asked, ...] = ()  # the park requests this decision made (for the log)
    # A swap's new go: kernel -> uuid -> bytes of its need that parks under way are still freeing (Plan.freeing).
    freeing: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def json(self) -> dict:
        return {
            "go": list(self.go),
            "park": list(self.park),
            "waiting": dict(self.waiting),
            "told": dict(self.told),
            "freeing": {k: dict(per) for k, per in self.freeing.items()},
        }


def reservation_timeout(held: Mapping[str, int]) -> float:
    """Seconds a reservation is held at most: its bytes at RESTORE_RATE, plus RESERVATION_MARGIN."""
    return sum(held.values()) / RESTORE_RATE + RESERVATION_MARGIN


def check_request(
    owned: Iterable[Owned],
    devices: Mapping[int, Device],
    user: str,
    server: str,
    reports: Mapping[str, ParkReport],
    demands: Mapping[str, Mapping[str, int]],
    seen: Optional[Mapping[str, Mapping[str, int]]] = None,
) -> Checked:
    """The room call of `user`'s server `server`, checked: every kernel it names must be the user's own (RoomRefused
    403 otherwise) and granted to that server (403 naming the server that holds it); every device a need names
    must be one of this host's (400). A kernel the service holds no grant for is left out (reports) or answered
    as such (demands): its server may not have heard of its release yet. Needs are cut to the kernel's cap there
    plus CONTEXT_ALLOWANCE (a device its grant does not hold: CONTEXT_ALLOWANCE), or to the most the service's
    samples saw it hold there (`seen`, HostRoom.seen) where that is more: a reservation short of what the restore
    takes could let another server's restore, granted beside it, leave too little for it."""
    by_id = {o.grant.kernel_id: o for o in owned}
    uuids = {d.uuid: index for index, d in devices.items()}
    for kernel_id in list(reports) + list(demands):
        held = by_id.get(kernel_id)
        if held is None:
            continue
        if held.grant.user != user:
            raise RoomRefused(403, f"kernel {kernel_id} is another user's")
        if held.server != server:
            raise RoomRefused(
                403, f"kernel {kernel_id} is held by your server {held.server or '(default)'!r}, not by {server!r}"
            )
    strange = sorted({uuid for need in demands.values() for uuid in need if uuid not in uuids})
    if strange:
        raise RoomRefused(
            400, f"device {', '.join(strange)} is not one of this host's GPUs ({', '.join(sorted(uuids)) or 'none'})"
        )
    cut: Dict[str, Dict[str, int]] = {}
    unknown = []
    for kernel_id, need in demands.items():
        held = by_id.get(kernel_id)
        if held is None:
            unknown.append(kernel_id)
            continue
        caps = held.grant.caps
        most = (seen or {}).get(kernel_id, {})
        cut[kernel_id] = {
            uuid: min(int(n), max(caps.get(uuids[uuid], 0) + CONTEXT_ALLOWANCE, most.get(uuid, 0)))
            for uuid, n in need.items()
            if n > 0
        }
    return Checked({k: r for k, r in reports.items() if k in by_id}, cut, tuple(unknown))


def own_reports(
    owned: Iterable[Owned], user: str, server: str, reports: Mapping[str, ParkReport]
) -> Dict[str, ParkReport]:
    """The reports of a lease that are of the user's own kernels granted to that server; the rest is ignored, as the
    lease ignores other users' kernels (one bad entry does not cost a server its renewal)."""
    mine = {o.grant.kernel_id for o in owned if o.grant.user == user and o.server == server}
    return {k: r for k, r in reports.items() if k in mine}


def host_round(
    devices: Mapping[int, Device],
    owned: Sequence[Owned],
    device_used: Optional[Mapping[str, Optional[int]]],
    kernel_used: Mapping[str, Mapping[str, int]],
    heard: Mapping[str, Heard],
    demands: Sequence[Waiting],
    reservations: Sequence[Held],
    host: HostView,
    settings: BrokerSettings,
    viewer: str,
    now: float,
    sampled_at: Optional[float] = None,
    taken: Optional[Mapping[str, float]] = None,
) -> Round:
    """The broker's Round for the whole host. `device_used`: the last sample's NVML usage per uuid (None: no
    sample recent enough, nothing moves); `kernel_used`: its verified usage per kernel and uuid; `sampled_at`: when
    that sample was taken; `taken`: kernel id -> when its server took a park request for it (HostRoom.view);
    `viewer`: the user the words are for. Demands of kernels that hold a reservation are answered by it, not
    decided again."""
    uuid_of = {index: d.uuid for index, d in devices.items()}
    views = tuple(
        DeviceView(d.uuid, d.uuid, d.total, None if device_used is None else device_used.get(d.uuid))
        for _, d in sorted(devices.items())
    )
    kernels: List[KernelView] = []
    granted: Set[str] = set()
    for item in owned:
        grant = item.grant
        if not grant.devices:
            continue
        kernel_id = grant.kernel_id
        granted.add(kernel_id)
        caps = {uuid_of[i]: grant.caps[i] for i in grant.devices if i in uuid_of}
        used = {uuid: n for uuid, n in kernel_used.get(kernel_id, {}).items() if uuid in caps}
        report = heard.get(kernel_id)
        took = (taken or {}).get(kernel_id)
        if (
            report is not None
            and report.report.state == ParkState.IDLE
            and took is not None
            and sampled_at is not None
            and sampled_at > took
            and not any(n > 0 for n in used.values())
        ):
            report = replace(report, report=ParkReport(ParkState.PARKED))  # asked, and its memory has left the device
        kernels.append(_kernel_view(kernel_id, caps, used, report, grant.user == viewer, now, sampled_at))
    held = {r.kernel_id for r in reservations}
    # A resume is a parked kernel's, which holds nothing on a device: a demand of a kernel the sample shows there
    # (a server's word against the service's own reading, or a sample taken before its park ended) waits for one
    # that shows it gone, and neither goes nor makes anyone park meanwhile.
    # A kernel the fast path parked keeps its CUDA context there: what its server says stays (bounded by the
    # parser) is not counted as its park still under way.
    on_device = {
        k
        for k, per in kernel_used.items()
        if sum(n for n in per.values() if n > 0) > _stays(heard.get(k))
    }
    return Round(
        devices=views,
        kernels=tuple(kernels),
        demands=tuple(
            Demand(w.kernel_id, dict(w.need), w.since, may_wait=w.may_wait and _stays(heard.get(w.kernel_id)) > 0)
            for w in demands
            if w.kernel_id in granted and w.kernel_id not in held and w.kernel_id not in on_device
        ),
        reservations=tuple(Reservation(r.kernel_id, dict(r.held)) for r in reservations if r.held),
        host=host,
        settings=settings,
        now=now,
    )


def _stays(heard: Optional[Heard]) -> int:
    """What a kernel reported parked (or waiting to come back) said its park left on the device."""
    if heard is None or heard.report.state not in ON_HOST:
        return 0
    return heard.report.stays


def _kernel_view(
    kernel_id: str,
    caps: Mapping[str, int],
    used: Mapping[str, int],
    heard: Optional[Heard],
    own: bool,
    now: float,
    sampled_at: Optional[float] = None,
) -> KernelView:
    """One kernel as the broker sees it: its server's last report, shown as parking/shown.py rules (the same rule as
    a server's own parker). Its park's bytes are in the sample while the sample shows its memory and was taken no
    later than the first report of the park done (or the sample's time is unknown)."""
    label = kernel_id[:8] if own else OTHERS
    shows = any(n > 0 for n in used.values())
    said = Said(None, now)  # never reported: running, kept
    if heard is not None:
        report = heard.report
        moving = report.state in MOVING
        said = Said(
            state=report.state,
            at=heard.at,
            idle_for=report.idle_for,
            parkable=report.parkable,
            park_since=heard.since if moving else None,
            park_bytes=sum(used.values()),
            in_reading=shows and (sampled_at is None or heard.parked_at is None or sampled_at <= heard.parked_at),
        )
    view = shown_as(said, now)
    # Said of a park under way only, never of another state; the broker reads it only of a kernel shown parking (its
    # park-time bound).
    releases = heard is not None and heard.report.releases_as_copied and heard.report.state == ParkState.PARKING
    return KernelView(
        kernel_id, view.state, used, caps, view.idle_for, view.parkable, label, releases_as_copied=releases
    )


class HostRoom:
    """What the service keeps between two decisions; every method takes the lock (the sampler's thread notes each
    sample, the API runs on the event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._heard: Dict[str, Heard] = {}
        self._waiting: Dict[str, Waiting] = {}
        self._held: Dict[str, Held] = {}
        self._asked: Dict[str, Asked] = {}
        self._seen: Dict[str, Dict[str, int]] = {}  # kernel -> uuid -> the most a sample saw it hold there
        self._claimed: Dict[str, float] = {}  # kernel -> first report of a park not yet seen done (not reset by blips)
        self._declined: Dict[str, float] = {}  # kernel -> when its server was seen not to carry out a park it took
        self._host = HostAccount()  # host memory promised to parks under way, every user's
        self._host_until: Dict[str, float] = {}  # kernel -> when its promise ends at the latest
        self._latest: Dict[str, int] = {}  # kernel -> what the last sample saw it hold, every device together

    # --- what the servers say -----------------------------------------------------------------------

    def hear(self, user: str, server: str, reports: Mapping[str, ParkReport], now: float, lease: bool) -> None:
        """Reports of the server's own kernels (checked by the caller). A lease's report of a kernel that no longer
        waits ends its demand (a room call names every demand of its server: ask() ends the others)."""
        with self._lock:
            for kernel_id, report in reports.items():
                old = self._heard.get(kernel_id)
                same = old is not None and (
                    old.report.state == report.state or (old.report.state in MOVING and report.state in MOVING)
                )
                parked_at = None
                if report.state == ParkState.PARKED:
                    again = old is not None and old.report.state == ParkState.PARKED and old.parked_at is not None
                    parked_at = old.parked_at if again and old else now
                if same and old and old.report.releases_as_copied and report.state == ParkState.PARKING:
                    # The same park, reported again without the word: a lease report published before the park's
                    # check reached the service after the room call that said it. Still believed within its bound.
                    report = replace(report, releases_as_copied=True)
                self._heard[kernel_id] = Heard(
                    report, user, server, now, old.since if same and old else now, parked_at
                )
                if report.state in MOVING:
                    self._claimed.setdefault(kernel_id, now)
                if report.state != ParkState.IDLE:
                    self._declined.pop(kernel_id, None)  # a change: it may be asked again
                asked = self._asked.get(kernel_id)
                acted = not (report.state == ParkState.IDLE and report.parkable)  # parks, or cannot now
                if asked is not None and asked.delivered is not None and asked.delivered < now and acted:
                    del self._asked[kernel_id]  # its server has acted on it since: it may be asked again
                elif asked is not None and asked.delivered is not None and now - asked.delivered >= DECLINE_GRACE:
                    # Taken, and still idle and parkable since: not carried out. Not asked again before a change.
                    del self._asked[kernel_id]
                    self._declined[kernel_id] = now
                held = self._held.get(kernel_id)
                if held is not None and held.running_seen is None and report.state in ON_DEVICE:
                    self._held[kernel_id] = replace(held, running_seen=now)
                if lease and report.state != ParkState.WAITING:
                    self._waiting.pop(kernel_id, None)
                if report.state != ParkState.PARKING and kernel_id in self._host_until:
                    # Parked (its bytes are in the host's reading now), or running again: its promise has ended.
                    self._host = self._host.release(kernel_id)
                    del self._host_until[kernel_id]

    def ask(
        self,
        user: str,
        server: str,
        demands: Mapping[str, Mapping[str, int]],
        now: float,
        may_wait: AbstractSet[str] = frozenset(),
    ) -> None:
        """A room call's demands: every demand of that server (the others it had have ended); `may_wait`: those its
        server says are fast-path resumes (host_round believes it only of a kernel reported parked by the fast
        path)."""
        with self._lock:
            for kernel_id in [k for k, w in self._waiting.items() if (w.user, w.server) == (user, server)]:
                if kernel_id not in demands:
                    del self._waiting[kernel_id]
            for kernel_id, need in demands.items():
                old = self._waiting.get(kernel_id)
                since = old.since if old is not None else now
                self._waiting[kernel_id] = Waiting(
                    kernel_id, user, server, dict(need), since, now,
                    old.reason if old else None, old.told if old else None, kernel_id in may_wait,
                )

    # --- what outlives a restart (store.py keeps it) ---------------------------------------------------

    def reservations(self) -> List[Held]:
        with self._lock:
            return list(self._held.values())

    def restore(self, held: Sequence[Held]) -> None:
        """The reservations a previous run of the service gave (store.load_reservations), before any decision: each
        is held, as before the restart, until a sample shows its kernel's memory back or its time is up."""
        with self._lock:
            for h in held:
                self._held[h.kernel_id] = h

    # --- what the sampler sees ----------------------------------------------------------------------

    def note_sample(self, taken_at: float, kernel_used: Mapping[str, Mapping[str, int]]) -> None:
        """One host sample: a reservation ends where it shows the kernel's verified usage back, or once it was
        taken after a report of the kernel running again."""
        with self._lock:
            self._latest = {k: sum(per.values()) for k, per in kernel_used.items()}
            for kernel_id, per in kernel_used.items():
                most = self._seen.setdefault(kernel_id, {})
                for uuid, n in per.items():
                    if n > most.get(uuid, 0):
                        most[uuid] = n
            for kernel_id in [k for k in self._claimed if not any(n > 0 for n in kernel_used.get(k, {}).values())]:
                del self._claimed[kernel_id]  # off the device: that park is done (or there was nothing to park)
            for kernel_id, held in list(self._held.items()):
                if taken_at <= held.since:
                    continue
                if held.running_seen is not None and taken_at > held.running_seen:
                    del self._held[kernel_id]
                    continue
                used = kernel_used.get(kernel_id, {})
                left = {uuid: n for uuid, n in held.held.items() if used.get(uuid, 0) < n}
                if not left:
                    del self._held[kernel_id]
                elif left != dict(held.held):
                    self._held[kernel_id] = replace(held, held=left)

    def expire(self, now: float, granted: Set[str], stale_after: float) -> None:
        """Forget what concerns kernels without a grant now, reservations past their time, demands not named for
        `stale_after` seconds (their server went silent), park requests not taken within REQUEST_TTL."""
        with self._lock:
            self._heard = {k: h for k, h in self._heard.items() if k in granted}
            self._seen = {k: m for k, m in self._seen.items() if k in granted}
            self._claimed = {k: t for k, t in self._claimed.items() if k in granted}
            self._declined = {k: t for k, t in self._declined.items() if k in granted}
            for kernel_id in [k for k, until in self._host_until.items() if k not in granted or until <= now]:
                self._host = self._host.release(kernel_id)
                del self._host_until[kernel_id]
            self._held = {k: h for k, h in self._held.items() if k in granted and h.until > now}
            self._waiting = {k: w for k, w in self._waiting.items() if k in granted and now - w.asked < stale_after}
            self._asked = {
                k: a
                for k, a in self._asked.items()
                if k in granted and now - (a.delivered if a.delivered is not None else a.at) < REQUEST_TTL
            }

    def promise_host(
        self, kernel_id: str, nbytes: int, reading: HostReading, margin: int, now: float
    ) -> Optional[str]:
        """A park's host memory, asked by its server before its driver call (checked by the caller: the user's own
        kernel on that server): promised, or the words of why not. At least what the service's last sample saw the
        kernel hold is promised, whatever its server says."""
        with self._lock:
            self._host = self._host.release(kernel_id)  # asked again (its earlier park never began): anew
            self._host_until.pop(kernel_id, None)
            nbytes = max(int(nbytes), self._latest.get(kernel_id, 0))
            promised = self._host.kernels()
            others = sum(
                self._latest.get(k, 0)
                for k, heard in self._heard.items()
                if heard.report.state == ParkState.PARKING and k not in promised and k != kernel_id
            )
            less = lambda x: None if x is None else x - others  # noqa: E731
            refused = self._host.refusal(
                kernel_id, nbytes, HostReading(less(reading.available), less(reading.cgroup_room)), margin
            )
            if refused is None:
                self._host = self._host.promise(kernel_id, nbytes)
                self._host_until[kernel_id] = now + park_time(nbytes)
            return refused

    def host_promised(self) -> int:
        with self._lock:
            return self._host.outstanding()

    def seen(self) -> Dict[str, Dict[str, int]]:
        """Per kernel and device, the most the service's samples saw it hold (check_request's bound on a need)."""
        with self._lock:
            return {k: dict(m) for k, m in self._seen.items()}

    # --- the decisions ------------------------------------------------------------------------------

    def view(self) -> Tuple[Dict[str, Heard], List[Waiting], List[Held], Dict[str, float]]:
        """What a Round is built from (host_round): reports, demands, reservations, and when each park request its
        server took was taken. A park claimed is dated from its first report not yet seen done; a kernel that
        declined a park request is not parkable until its server reports a change."""
        with self._lock:
            taken = {k: a.delivered for k, a in self._asked.items() if a.delivered is not None}
            heard = dict(self._heard)
            for kernel_id, h in heard.items():
                if h.report.state in MOVING and kernel_id in self._claimed:
                    heard[kernel_id] = replace(h, since=min(h.since, self._claimed[kernel_id]))
                if kernel_id in self._declined:
                    heard[kernel_id] = replace(heard[kernel_id], report=replace(h.report, parkable=False))
            return heard, list(self._waiting.values()), list(self._held.values()), taken

    def answer(
        self,
        plan: Plan,
        user: str,
        server: str,
        owned: Sequence[Owned],
        now: float,
        bound: Optional[Callable[[Mapping[str, int]], Optional[str]]] = None,
    ) -> Answer:
        """Apply one round's Plan, decided for a room call of `user`'s server `server`. Only the caller's demands are
        answered ("go" reserves their room now; another server's demand is decided at its own call). Park requests
        for the caller's kernels are in its answer; those for other servers wait for their leases (`wake`).
        `bound`: given what the user would have reserved with a "go" (uuid -> bytes, its reservations and the new
        need), why that passes the user's budget (limits.reservation_over_budget), or None: such a "go" is not
        given, the kernel waits, told why."""
        by_id = {o.grant.kernel_id: o for o in owned}
        key = (user, server)
        over: Dict[str, str] = {}
        with self._lock:
            mine = {k for k, w in self._waiting.items() if (w.user, w.server) == key}
            go = [k for k in sorted(mine) if k in self._held]  # asked again while its room is held
            freeing = {k: dict(self._held[k].freeing) for k in go if self._held[k].freeing}  # the same go's word
            for kernel_id in plan.go:
                waiting = self._waiting.get(kernel_id)
                if kernel_id not in mine or waiting is None or kernel_id in go:
                    continue
                need = {uuid: n for uuid, n in waiting.need.items() if n > 0}
                if bound is not None:
                    claimed = dict(need)
                    for h in self._held.values():
                        if h.user == user:
                            for uuid, n in h.held.items():
                                claimed[uuid] = claimed.get(uuid, 0) + n
                    why = bound(claimed)
                    if why is not None:
                        over[kernel_id] = why
                        continue
                # A swap: its restore waits, bounded, for what the parks under way free.
                swap = {str(uuid): n for uuid, n in plan.freeing.get(kernel_id, {}).items()}
                # A swap's resume may wait SWAP_WAIT in its kernel for those bytes before it copies: its room is held
                # that much longer, or another user's restore could be given the bytes it is about to take.
                until = now + reservation_timeout(need) + (SWAP_WAIT if swap else 0.0)
                self._held[kernel_id] = Held(kernel_id, user, server, need, now, until, freeing=swap)
                go.append(kernel_id)
                if swap:
                    freeing[kernel_id] = swap
            for kernel_id in go:
                self._waiting.pop(kernel_id, None)
            park: List[str] = []
            wake: Set[Key] = set()
            made: List[Asked] = []
            for victim, for_kernel in plan.park:
                held = by_id.get(victim)
                asking = self._waiting.get(for_kernel)
                if held is None:
                    continue
                there = (held.grant.user, held.server)
                old = self._asked.get(victim)
                if old is not None and (old.delivered is not None or there != key):
                    continue  # asked already: taken and not reported on since, or waiting for its lease
                for_user = asking.user if asking is not None else user
                if there == key:
                    park.append(victim)
                    self._asked[victim] = Asked(victim, user, server, for_kernel, for_user, now, now)
                else:
                    self._asked[victim] = Asked(victim, there[0], there[1], for_kernel, for_user, now)
                    wake.add(there)
                made.append(self._asked[victim])
            waiting = {k: r for k, r in plan.waiting.items() if k in mine and k not in go}
            waiting.update(over)
            told = {k: m for k, m in plan.told.items() if k in mine and k not in go}
            for kernel_id, reason in waiting.items():
                self._waiting[kernel_id] = replace(
                    self._waiting[kernel_id], reason=reason, told=told.get(kernel_id, self._waiting[kernel_id].told)
                )
        return Answer(tuple(go), tuple(park), waiting, told, tuple(sorted(wake)), tuple(made), freeing)

    def take(self, user: str, server: str, owned: Sequence[Owned], now: float) -> List[str]:
        """The park requests for `user`'s server `server` not yet taken, of kernels it still holds (its lease's
        answer): taken now."""
        mine = {o.grant.kernel_id for o in owned if (o.grant.user, o.server) == (user, server)}
        with self._lock:
            key = (user, server)
            taken = [k for k, a in sorted(self._asked.items()) if a.delivered is None and (a.user, a.server) == key]
            for kernel_id in taken:
                self._asked[kernel_id] = replace(self._asked[kernel_id], delivered=now)
            return [k for k in taken if k in mine]

    def pending(self, user: str, server: str) -> bool:
        """Park requests wait for this server's lease."""
        with self._lock:
            return any((a.user, a.server) == (user, server) and a.delivered is None for a in self._asked.values())

    # --- what the status shows ------------------------------------------------------------------------

    def status(self, visible: Sequence[Owned], viewer: str, admin: bool, now: float) -> dict:
        """Each visible kernel's last park report, the kernels waiting (how long, why), the reservations and the
        park requests, for the status and the admin's page. A user sees their own kernels; of a park request for
        their kernel, not whose kernel it made room for."""
        ids = {o.grant.kernel_id for o in visible}
        with self._lock:
            heard = {k: h for k, h in self._heard.items() if k in ids}
            waiting = [w for w in self._waiting.values() if w.kernel_id in ids]
            held = [h for h in self._held.values() if h.kernel_id in ids]
            asked = [a for a in self._asked.values() if a.kernel_id in ids]
            declined = {k: t for k, t in self._declined.items() if k in ids}
        park = {}
        for kernel_id, h in heard.items():
            idle_for = h.report.idle_for
            if h.report.state == ParkState.IDLE and idle_for is not None:
                idle_for = round(idle_for + max(0.0, now - h.at), 1)  # idle since the report, as far as anyone knows
            park[kernel_id] = {
                "state": h.report.state,
                "idle_for": idle_for if h.report.state == ParkState.IDLE else None,
                "parkable": h.report.parkable,
                "reported": round(now - h.at, 1),  # seconds ago
                # seconds since its server was seen not to carry out a park request it took (None: not so)
                "declined_park": round(now - declined[kernel_id], 1) if kernel_id in declined else None,
            }
        return {
            "park": park,
            "waiting": [
                {
                    "kernel_id": w.kernel_id, "user": w.user, "server": w.server, "need": dict(w.need),
                    "waited": round(now - w.since, 1), "reason": w.reason, "told": w.told,
                }
                for w in sorted(waiting, key=lambda w: w.since)
            ],
            "reservations": [
                {
                    "kernel_id": h.kernel_id, "user": h.user, "server": h.server, "held": dict(h.held),
                    "held_for": round(now - h.since, 1), "ends_in": round(h.until - now, 1),
                }
                for h in sorted(held, key=lambda h: h.since)
            ],
            "park_requests": [
                {
                    "kernel_id": a.kernel_id, "user": a.user, "server": a.server,
                    "for_kernel": a.for_kernel if admin or a.for_user == viewer else None,
                    "asked": round(now - a.at, 1), "taken": a.delivered is not None,
                }
                for a in sorted(asked, key=lambda a: a.at)
            ],
        }
