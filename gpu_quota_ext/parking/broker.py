"""The broker's decisions, per device: which resume may run now, which idle kernels park to make room for it,
and what a kernel that waits is told. Pure: no I/O, no clock (callers pass `now`), no driver.

One decision-maker per device: a server's parker asks it on every sample for its own kernels; on a hub host the
host service asks it for every user's kernels at once (hub/service/room.py), so park, resume and admission
decisions never race each other.

A restore into a full device loses the process for good (NVIDIA's driver: a failed restore leaves it
checkpointed, every later call answers 304; measured on the H200 too). So a restore runs only into *room*:

    room(device) = total - NVML used - headroom of the running kernels - reservations - margin

where a running kernel's headroom is what its cap still lets it take (cap - used, at least 0) on a device where
it holds memory: bytes it may claim at any moment, so no restore may count on them. A busy kernel claims it; an
idle one does not: it asks for its headroom when its next cell starts (the room check before a cell, and after
an out-of-memory error where that check was too late), and the broker makes that room like a resume's. Claiming
idle kernels' headroom too would, under overcommit, fill a device with promises (three idle kernels of cap 0.35
claim more than the device while holding 40 % of it) while the host has no room left to park them: every
resume then waits its whole limit with most of the device free (benchmarks/broker_day.py --schedule, on the
device day's schedule). (A kernel that holds nothing on a device claims nothing there: it could never be parked
to give a claim back.) A resume granted
room reserves its parked bytes until a sample taken after its restore has ended shows them as used. Nothing the
broker grants is held by anyone else: that is the invariant its property tests check ("never two holders of the
same bytes").

Demands are served in the order they began to wait. One that does not fit now gets room made for it: idle
kernels park, least recently active first, only parkable ones idle at least `min_idle`, only while the host's
memory can take them (the host guard). A parking kernel frees its bytes once its park is done; a demand that
those bytes will cover waits for them instead of parking more. A demand that waited `wait_limit` seconds is
told why (once), and from then on comes after every demand still within its limit: it is still served when
room appears, but it no longer holds up the others.

A swap, both copies at once: a fast-path resume (`Demand.may_wait`) may go while the parks that make its room are
still copying, where those parks release as they copy (`KernelView.releases_as_copied`: a fast-path park gives
each piece of device memory back as soon as its bytes are on the host). It goes when what is free now and what
those parks on its devices still hold cover it; its restore backs its memory piece by piece as pieces come free.
That restore is not a restore into room that is there, and it need not be: the fast path's resume waits for the
memory, bounded (the parker's SWAP_WAIT), and where the room never comes (the park failed, another process took
the bytes first) it gives back what it took and stays parked with every byte on the host: recoverable, the kernel
waits for room again. The checkpoint path's restore has no such wait and loses the process when it finds the
device full, so a demand that is not `may_wait`, and room that comes only from parks that do not release as they
copy (the checkpoint path's, which frees nothing until its last process is checkpointed), waits for the park to
end as before. Nothing is promised twice all the same: the bytes of a releasing park count once, for the first
`may_wait` demand that needs them (earmarked like any go), and never for a demand that is not `may_wait`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from ..shared.park_state import CLAIMING, ParkState
from ..shared.sizes import format_bytes


@dataclass(frozen=True)
class DeviceView:
    key: Hashable  # a server's device index, or the host service's device uuid
    name: str  # for the words: "GPU 0"
    total: int
    used: Optional[int]  # NVML, the whole device; None: unreadable this round (nothing is decided on it)


@dataclass(frozen=True)
class KernelView:
    """One kernel as the broker sees it."""

    kernel_id: str
    state: str  # a ParkState, as shown.shown_as gives it
    used: Mapping[Hashable, int] = field(default_factory=dict)  # NVML, by device
    caps: Mapping[Hashable, int] = field(default_factory=dict)  # its grant, by device
    idle_for: Optional[float] = None  # seconds since its last activity (idle kernels)
    parkable: bool = False  # parking can work for it now (driver, not an MPS client, its own user, holds memory)
    label: str = ""  # how the words name it ("kernel 1a2b…", "alice's kernel 1a2b…")
    stays: int = 0  # parked by the fast path: what its park left on the device (its CUDA context), else 0
    # Host memory its park would take beyond what it holds on the host already; None: all of its device bytes.
    # A kernel resumed by the fast path may keep its pinned arena for its next park (path.keep_arena): that
    # memory is already out of the host's available memory, and parking it again takes no more.
    host_cost: Optional[int] = None
    # A park under way (PARKING) through the fast path that gives each piece of device memory back as soon as it
    # is copied: its bytes come free piece by piece, and a `may_wait` resume may start while it copies.
    releases_as_copied: bool = False

    def headroom(self, key: Hashable) -> int:
        """What its cap still lets it take on `key` while it runs a cell and holds memory there. An idle kernel
        claims nothing beyond what it holds: its next cell asks for its headroom first (see the module's
        docstring). A kernel that holds none there (it never used that GPU) claims nothing: it could not be
        parked to give a claim back, and most kernels never touch the GPU at all. When it does start, it
        allocates like any newcomer (a device found full makes room for it where park_on_device_full is on)."""
        if self.state not in CLAIMING or self.used.get(key, 0) <= 0:
            return 0
        return max(0, self.caps.get(key, 0) - self.used.get(key, 0))

    def frees(self, key: Hashable) -> int:
        """What parking it would give back on `key`: its bytes and its headroom."""
        return self.used.get(key, 0) + self.headroom(key)

    @property
    def host_bytes(self) -> int:
        return sum(self.used.values())

    @property
    def host_need(self) -> int:
        """Host memory its park would take now: what the host guard counts when it picks it."""
        return self.host_bytes if self.host_cost is None else max(0, min(self.host_cost, self.host_bytes))


@dataclass(frozen=True)
class Demand:
    """A kernel that needs room: a parked kernel's resume (`need` = its parked bytes), or a running kernel that
    found the device full (`running`; `need` within its own headroom)."""

    kernel_id: str
    need: Mapping[Hashable, int]
    since: float  # when it began to wait
    running: bool = False
    # A resume nobody waits for: host memory ran short with kernels parked (host_account.host_short), so parked
    # kernels come back where the device has room now, largest first, after every demand someone waits for. It
    # parks nobody and is told nothing.
    background: bool = False
    # A fast-path resume: its restore waits, bounded, for memory that parks under way are freeing, and fails
    # recoverably (the kernel stays parked and whole) when the wait runs out. It may go while the parks that make
    # its room are still copying, where they release as they copy (the module's docstring: a swap).
    may_wait: bool = False


@dataclass(frozen=True)
class Reservation:
    kernel_id: str
    held: Mapping[Hashable, int]


@dataclass(frozen=True)
class HostView:
    """Host memory a park can use: the host's available memory and the memory cgroup's room (None: no limit or
    unknown). A parked kernel's GPU state goes to its own process's host memory."""

    available: Optional[int] = None
    cgroup_room: Optional[int] = None
    promised: int = 0  # host memory the server's account promised to parks under way and not yet in `available`
    promised_for: frozenset = frozenset()  # the kernels those parks are of (their bytes are not counted again)


@dataclass(frozen=True)
class BrokerSettings:
    device_margin: int = 1 << 30  # room kept free beyond a restore's bytes
    host_margin: int = 2 << 30  # host memory kept free beyond a park's bytes
    min_idle: float = 60.0  # seconds idle before the broker may park a kernel to make room
    wait_limit: Optional[float] = 300.0  # seconds a demand waits before its kernel is told; None: no limit


@dataclass(frozen=True)
class Round:
    """Everything one decision looks at."""

    devices: Tuple[DeviceView, ...]
    kernels: Tuple[KernelView, ...]
    demands: Tuple[Demand, ...]
    reservations: Tuple[Reservation, ...]
    host: HostView
    settings: BrokerSettings
    now: float


@dataclass(frozen=True)
class Plan:
    go: Tuple[str, ...] = ()  # demands that fit now: a resume reserves its bytes and restores; a running one runs
    park: Tuple[Tuple[str, str], ...] = ()  # (idle kernel, the demand it parks for)
    waiting: Mapping[str, str] = field(default_factory=dict)  # kernel -> what it waits for
    told: Mapping[str, str] = field(default_factory=dict)  # kernel -> why its wait passed the limit
    # A swap's go (a `may_wait` demand that went while the parks making its room still copy): kernel -> device ->
    # the bytes of its need that are not free yet, which those parks are freeing. Its restore waits for them,
    # bounded: on a hub host its server cannot see other users' parks, so the host service's answer says it.
    freeing: Mapping[str, Mapping[Hashable, int]] = field(default_factory=dict)


def room(
    device: DeviceView, kernels: Sequence[KernelView], reservations: Sequence[Reservation], margin: int
) -> Optional[int]:
    """What a restore may use on `device` now (may be negative); None when its usage is unknown."""
    if device.used is None:
        return None
    claimed = sum(k.headroom(device.key) for k in kernels)
    reserved = sum(r.held.get(device.key, 0) for r in reservations)
    return device.total - device.used - claimed - reserved - margin


def host_left(host: HostView, kernels: Sequence[KernelView]) -> Optional[int]:
    """Host memory left for new parks: the least of available and cgroup room, less what parks under way will
    still bring: what the account promised them (host_account.py), and the whole of any other park under way
    (another server's, seen by the host service: how much of it has landed is not known here)."""
    limits = [x for x in (host.available, host.cgroup_room) if x is not None]
    if not limits:
        return None
    others = sum(k.host_bytes for k in kernels if k.state == ParkState.PARKING and k.kernel_id not in host.promised_for)
    return min(limits) - host.promised - others


def candidates(kernels: Sequence[KernelView], min_idle: float) -> List[KernelView]:
    """Idle kernels the broker may park, least recently active first."""
    idle = [
        k
        for k in kernels
        if k.state == ParkState.IDLE
        and k.parkable
        and k.host_bytes > 0
        and k.idle_for is not None
        and k.idle_for >= min_idle
    ]
    return sorted(idle, key=lambda k: (-(k.idle_for or 0.0), k.kernel_id))


def decide(round_: Round) -> Plan:
    """Every decision of one round."""
    deciding = _Deciding(round_)
    for demand in sorted(round_.demands, key=deciding.order):
        deciding.serve(demand)
    return Plan(
        go=tuple(deciding.go),
        park=tuple(deciding.park),
        waiting=deciding.waiting,
        told=deciding.told,
        freeing=deciding.freeing,
    )


def plan(
    devices: Sequence[DeviceView],
    kernels: Sequence[KernelView],
    demands: Sequence[Demand],
    reservations: Sequence[Reservation],
    host: HostView,
    settings: BrokerSettings,
    now: float,
) -> Plan:
    """decide() of the Round these make, for callers that hold the parts (the tests, benchmarks/broker_day.py).
    `reservations`: rooms granted earlier and still held."""
    return decide(
        Round(tuple(devices), tuple(kernels), tuple(demands), tuple(reservations), host, settings, now)
    )


class _Deciding:
    """One round of decide() while it is decided, demand after demand: the room each decision leaves to the next
    ones, and the decisions so far. Pure like decide(): it lives for one call and sees only the Round."""

    def __init__(self, round_: Round):
        devices, kernels, demands = round_.devices, round_.kernels, round_.demands
        reservations, host, settings = round_.reservations, round_.host, round_.settings
        self.now = round_.now
        self.kernels = kernels
        self.reservations = reservations
        self.settings = settings
        self.by_key = {d.key: d for d in devices}
        self.by_id = {k.kernel_id: k for k in kernels}
        margin = settings.device_margin
        # Two views of each device's room: what exists now (a restore may use only this), and what will exist once
        # the parks under way and those chosen this round are done (whether more kernels must park).
        self.now_room: Dict[Hashable, Optional[int]] = {d.key: room(d, kernels, reservations, margin) for d in devices}
        coming: Dict[Hashable, int] = {
            d.key: sum(k.used.get(d.key, 0) for k in kernels if k.state == ParkState.PARKING) for d in devices
        }
        self.later_room: Dict[Hashable, Optional[int]] = {
            key: None if value is None else value + coming[key] for key, value in self.now_room.items()
        }
        # Of those, what parks under way free piece by piece as they copy: what a `may_wait` resume may count on
        # now (the module's docstring: a swap). Taken by the `may_wait` demands that go on it, through now_room,
        # which they leave below zero by what they borrowed.
        # (All of a releasing park's bytes, though its CUDA context, a few hundred MiB, stays on the device: a resume
        # that counted on those waits its bounded wait in vain and stays parked, whole; on a hub host the service
        # holds its room until then, SWAP_WAIT longer than another go's.)
        self.releasing: Dict[Hashable, int] = {
            d.key: sum(k.used.get(d.key, 0) for k in kernels if k.state == ParkState.PARKING and k.releases_as_copied)
            for d in devices
        }
        # A kernel that waits for room itself (a running one that found the device full) is never parked to make it.
        asking = {d.kernel_id for d in demands}
        self.pool = [k for k in candidates(kernels, settings.min_idle) if k.kernel_id not in asking]
        self.chosen: List[str] = []
        self.host_room = host_left(host, kernels)
        self.go: List[str] = []
        self.park: List[Tuple[str, str]] = []
        self.waiting: Dict[str, str] = {}
        self.told: Dict[str, str] = {}
        self.freeing: Dict[str, Dict[Hashable, int]] = {}

    def overdue(self, demand: Demand) -> bool:
        return self.settings.wait_limit is not None and self.now - demand.since >= self.settings.wait_limit

    def order(self, demand: Demand) -> tuple:
        if demand.background:  # after every demand someone waits for; the largest first
            return (True, False, -sum(demand.need.values()), demand.kernel_id)
        return (False, self.overdue(demand), demand.since, demand.kernel_id)

    def serve(self, demand: Demand) -> None:
        """Decide `demand`: it goes, idle kernels park for it, or it waits (told why once it is overdue)."""
        me = self.by_id.get(demand.kernel_id)
        need = {key: n for key, n in demand.need.items() if n > 0}
        own = {key: (me.headroom(key) if (me is not None and demand.running) else 0) for key in need}
        unknown = [key for key in need if key not in self.by_key or self.now_room.get(key) is None]
        if unknown:
            if not demand.background:
                self._wait(demand, "its GPU's usage is unknown this round; nothing moves until it is read again")
            return
        short_now = {key: need[key] - own[key] - (self.now_room[key] or 0) for key in need}
        if all(s <= 0 for s in short_now.values()):
            self.go.append(demand.kernel_id)
            _earmark(need, own, self.now_room, self.later_room)  # it takes its room now: the same sums
            return
        if demand.background:
            return  # only where the device has room now: it parks nobody
        short_later = {key: need[key] - own[key] - (self.later_room[key] or 0) for key in need}
        if demand.may_wait and not demand.running and all(s <= self.releasing[key] for key, s in short_now.items()):
            # A swap: the parks that free its room release as they copy, and its restore waits for them, bounded
            # and recoverably. It goes now, both copies at once, and takes its room as any go does.
            self.go.append(demand.kernel_id)
            # What it counts on beyond the room there is now, never more than its own need (an earlier swap of this
            # round left the room below zero by what it borrowed: that is not this one's to wait for).
            counted = {key: min(s, need[key] - own[key]) for key, s in short_now.items()}
            self.freeing[demand.kernel_id] = {key: n for key, n in counted.items() if n > 0}
            _earmark(need, own, self.now_room, self.later_room)
            return
        if all(s <= 0 for s in short_later.values()):
            parking = [k.label or k.kernel_id for k in self.kernels if k.state == ParkState.PARKING and _on(k, need)]
            reason = _making_room(need, self.by_key, parking, "parking")
            _earmark(need, own, self.now_room, self.later_room)
            self._wait(demand, reason)
            return
        picks, host_refused = _pick(self.pool, self.chosen, short_later, self.host_room, self.settings.host_margin)
        if picks is not None:
            self._park_for(demand, picks)
            _earmark(need, own, self.now_room, self.later_room)
            self._wait(demand, _making_room(need, self.by_key, [v.label or v.kernel_id for v in picks], "parks now"))
            return
        if demand.running and not _room_may_come(
            need, demand.kernel_id, self.kernels, self.reservations, self.chosen, short_later
        ):
            # Nothing under way or idle could give a running kernel's cell its room: waiting gains nothing, so it
            # runs as it is (headroom.short_on lets such a cell run in the first place). It took nothing: no earmark.
            self.go.append(demand.kernel_id)
            return
        # Room cannot be made now. This demand holds nothing back for itself: the others go on, and it is
        # looked at again next round (kernels turn idle, parks finish, others end).
        reason = _why_not(
            need, own, self.now_room, self.later_room, self.by_key, self.pool, self.chosen, host_refused, self.settings
        )
        reason += holders_words(need, self.kernels, self.reservations, demand.kernel_id, self.settings.min_idle)
        self._wait(demand, reason)

    def _park_for(self, demand: Demand, picks: Sequence[KernelView]) -> None:
        """`picks` park for `demand`: their host memory is taken, and their bytes will be room once they are parked."""
        for victim in picks:
            self.chosen.append(victim.kernel_id)
            self.park.append((victim.kernel_id, demand.kernel_id))
            if self.host_room is not None:
                self.host_room -= victim.host_need
            for key in self.later_room:
                if self.later_room[key] is not None:
                    self.later_room[key] = (self.later_room[key] or 0) + victim.frees(key)

    def _wait(self, demand: Demand, reason: str) -> None:
        _wait_or_tell(demand, reason, self.overdue(demand), self.settings, self.waiting, self.told)


def _room_may_come(
    need: Mapping[Hashable, int],
    asking: str,
    kernels: Sequence[KernelView],
    reservations: Sequence[Reservation],
    chosen: Sequence[str],
    short_later: Mapping[Hashable, int],
) -> bool:
    """Whether anything may yet give a running kernel's demand its room on its devices: a restore under way there
    (its reservation: once it lands its bytes are known), a park under way there, or idle kernels whose parks would
    cover the shortfall once they have been idle long enough."""
    for key in need:
        if any(r.kernel_id != asking and r.held.get(key, 0) > 0 for r in reservations):
            return True
        if any(k.state == ParkState.PARKING and k.used.get(key, 0) > 0 for k in kernels):
            return True
    idle = [k for k in candidates(kernels, 0.0) if k.kernel_id != asking and k.kernel_id not in chosen]
    return all(short_later[key] <= sum(k.frees(key) for k in idle) for key in need)


def _on(kernel: KernelView, need: Mapping[Hashable, int]) -> bool:
    return any(kernel.used.get(key, 0) > 0 for key in need)


def _earmark(
    need: Mapping[Hashable, int],
    own: Mapping[Hashable, int],
    now_room: Dict[Hashable, Optional[int]],
    later_room: Dict[Hashable, Optional[int]],
) -> None:
    """A demand that will be served once room is made keeps later demands from taking that room meanwhile."""
    for key in need:
        now_room[key] = (now_room[key] or 0) - need[key] + own[key]
        later_room[key] = (later_room[key] or 0) - need[key] + own[key]


def _pick(
    pool: Sequence[KernelView],
    chosen: Sequence[str],
    short: Mapping[Hashable, int],
    host_room: Optional[int],
    host_margin: int,
) -> Tuple[Optional[List[KernelView]], List[KernelView]]:
    """Idle kernels whose parks together cover `short` on every device, least recently active first; None when
    they cannot. Second: the kernels the host guard kept from parking."""
    left = dict(short)
    picks: List[KernelView] = []
    refused: List[KernelView] = []
    host = host_room
    for kernel in pool:
        if all(v <= 0 for v in left.values()):
            break
        if kernel.kernel_id in chosen or not any(left[key] > 0 and kernel.frees(key) > 0 for key in left):
            continue
        if host is not None and host < kernel.host_need + host_margin:
            refused.append(kernel)
            continue
        picks.append(kernel)
        if host is not None:
            host -= kernel.host_need
        for key in left:
            left[key] -= kernel.frees(key)
    return (picks if all(v <= 0 for v in left.values()) else None), refused


def _wait_or_tell(
    demand: Demand,
    reason: str,
    overdue: bool,
    settings: BrokerSettings,
    waiting: Dict[str, str],
    told: Dict[str, str],
) -> None:
    waiting[demand.kernel_id] = reason
    if overdue and settings.wait_limit is not None:
        told[demand.kernel_id] = told_words(settings.wait_limit, reason)


def told_words(limit: float, reason: str) -> str:
    """What a kernel whose wait passed the limit is told."""
    return f"waited {limit:g} s (the park_wait_limit) for device memory: {reason}"


def _where(need: Mapping[Hashable, int], devices: Mapping[Hashable, DeviceView]) -> str:
    return ", ".join(f"{format_bytes(n)} on {devices[key].name}" for key, n in need.items())


def _making_room(
    need: Mapping[Hashable, int], devices: Mapping[Hashable, DeviceView], kernels: Sequence[str], verb: str
) -> str:
    names = ", ".join(kernels[:3]) + (f" and {len(kernels) - 3} more" if len(kernels) > 3 else "")
    subject = "idle kernel" if len(kernels) == 1 else "idle kernels"
    return f"needs {_where(need, devices)}; making room: {subject} {names} {verb}" if names else (
        f"needs {_where(need, devices)}; making room"
    )


def _why_not(
    need: Mapping[Hashable, int],
    own: Mapping[Hashable, int],
    now_room: Mapping[Hashable, Optional[int]],
    later_room: Mapping[Hashable, Optional[int]],
    devices: Mapping[Hashable, DeviceView],
    pool: Sequence[KernelView],
    chosen: Sequence[str],
    host_refused: Sequence[KernelView],
    settings: BrokerSettings,
) -> str:
    """Why a demand cannot be served, even by parking every idle kernel the rules allow."""
    parts = []
    for key, n in need.items():
        free = max(0, (now_room[key] or 0) + own[key])
        could = sum(k.frees(key) for k in pool if k.kernel_id not in chosen) + max(
            0, (later_room[key] or 0) - (now_room[key] or 0)
        )
        if n - own[key] - (later_room[key] or 0) - could <= 0 and not host_refused:
            continue
        parts.append(
            f"{devices[key].name} has {format_bytes(free)} free for it, and parking the kernels idle for "
            f"{settings.min_idle:g} s or more would give {format_bytes(could)} more"
        )
    text = f"needs {_where(need, devices)}; " + ("; ".join(parts) if parts else "not enough room")
    if host_refused:
        text += (
            f"; the host's memory cannot take {len(host_refused)} idle "
            f"kernel{'s' if len(host_refused) > 1 else ''} that could park"
        )
    return text


def holders_words(
    need: Mapping[Hashable, int],
    kernels: Sequence[KernelView],
    reservations: Sequence[Reservation],
    asking: str,
    min_idle: float,
    most: int = 3,
) -> str:
    """What holds the room a demand waits for, on its devices: the largest holders (their words name whose, on a
    hub host), how much each holds and claims, and when the broker may park them; then the rooms reserved for
    resumes. A wait says this so that its user sees why the memory nvidia-smi shows free is not theirs yet."""
    held: List[Tuple[int, str]] = []
    for kernel in kernels:
        if kernel.kernel_id == asking:
            continue
        holds = sum(kernel.used.get(key, 0) for key in need)
        claims = sum(kernel.headroom(key) for key in need)
        if holds + claims <= 0:
            continue
        amount = format_bytes(holds) + (f" and claims {format_bytes(claims)} more of its cap" if claims else "")
        held.append((holds + claims, f"{kernel.label or kernel.kernel_id} holds {amount} ({_when(kernel, min_idle)})"))
    held.sort(key=lambda item: -item[0])
    words = [text for _, text in held[:most]]
    if len(held) > most:
        words.append(f"{len(held) - most} more hold {format_bytes(sum(n for n, _ in held[most:]))}")
    reserved = sum(r.held.get(key, 0) for r in reservations if r.kernel_id != asking for key in need)
    if reserved:
        words.append(f"{format_bytes(reserved)} reserved for resumes under way")
    return "; held: " + ", ".join(words) if words else ""


def _when(kernel: KernelView, min_idle: float) -> str:
    """When the broker may park this kernel, in a few words."""
    if kernel.state in CLAIMING:
        return "running a cell: not parked while it runs"
    if kernel.state == ParkState.PARKING:
        return "parking now"
    if kernel.state == ParkState.RESUMING:
        return "coming back from the host"
    if kernel.state != ParkState.IDLE:
        return kernel.state
    if not kernel.parkable:
        return "idle, cannot be parked"
    idle_for = kernel.idle_for or 0.0
    if idle_for < min_idle:
        return f"idle {idle_for:.0f} s: parkable after {min_idle:g} s idle"
    return "idle: parks when room is made"
