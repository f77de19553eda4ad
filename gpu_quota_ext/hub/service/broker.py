"""The host's broker as the service runs it: the room (room.py, pure) with what it reads and does around each
decision: the service's last host sample, the host's memory, the reservations kept on disk (store.py), the
servers' long polls woken (polls.py), the log. One room call, one lease's reports and park requests, each sample's
news, and the room's part of the status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AbstractSet, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

from ... import parking
from ...parking import BrokerSettings, HostReading, HostView, decide
from ...shared.service_contract import LEASE_RENEW
from .book import HostBook, Owned
from .limits import kept_idle, per_user, reservation_over_budget
from .polls import LongPolls
from .room import HostRoom, ParkReport, check_request, host_round, own_reports
from .sampler import HostSampler, Sample
from .store import Store

log = logging.getLogger("gpu_quota_ext")


def read_at(sample: Sample) -> float:
    """When a host sample's reading began (the broker's "a sample taken after"), for a sample that says so."""
    return sample.read_at if sample.read_at is not None else sample.taken_at


class HostBroker:
    """The room, its long polls and its kept-idle account, for every user's kernels on the host."""

    def __init__(
        self,
        book: HostBook,
        store: Store,
        sampler: HostSampler,
        settings: BrokerSettings,
        lease_seconds: float,
        sample_gap: float,
        count_kept_idle: bool,
    ) -> None:
        self.book, self.store, self.sampler, self.settings = book, store, sampler, settings
        self.lease_seconds = lease_seconds
        self.sample_gap = sample_gap  # a sample older than this is too old to decide on
        self.count_kept_idle = count_kept_idle  # unparkable_idle = "count"
        self.room = HostRoom()
        self.polls = LongPolls()
        self.kept_idle: Dict[str, Dict[str, int]] = {}  # kernel -> uuid -> idle bytes that could not be parked

    def restore(self) -> int:
        """The reservations of resumes under way the store kept (a restart keeps the restore's room): how many."""
        held = self.store.load_reservations()
        self.room.restore(held)
        return len(held)

    # --- what servers tell and ask ---------------------------------------------------------------

    def hear_lease(self, user: str, server: str, reports: Mapping[str, ParkReport], now: float) -> None:
        """A lease's park reports: only of the user's own kernels on that server."""
        self.room.hear(user, server, own_reports(self.book.owned(), user, server, reports), now, lease=True)

    def longest_wait(self) -> float:
        """The longest a lease's long poll waits: a quarter lease, so an answer always comes well before it ends."""
        return max(0.0, min(float(LEASE_RENEW), self.lease_seconds / 4))

    async def renew(
        self,
        user: str,
        server: str,
        kernels: Mapping[str, Tuple[int, ...]],
        reports: Optional[Mapping[str, ParkReport]],
        wait: Optional[float],
        woken: asyncio.Event,
        gone: Callable[[], bool],
        clock: Callable[[], float] = time.time,
    ) -> Optional[dict]:
        """A lease renewal's answer: the kernels the book released; with park reports or a wait, the kernels the
        broker asks this server to park. With `wait`, the long poll: recorded at once, answered when the broker
        wants some of this server's kernels parked (or `woken` is set), or after the wait. None when the caller
        went away meanwhile (`gone`): what is asked of its server stays for its next renewal."""
        now = clock()
        released = self.book.lease(user, server, kernels, now)
        data: Dict[str, object] = {"lease_seconds": int(self.book.lease_seconds), "released": released}
        if reports is None and wait is None:
            return data
        self.hear_lease(user, server, reports or {}, now)
        if wait and not self.room.pending(user, server):
            await self.polls.wait((user, server), min(wait, self.longest_wait()), woken)
            if gone():
                return None
        data["park"] = self.room.take(user, server, self.book.owned(), clock())
        return data

    def room_call(
        self,
        user: str,
        server: str,
        reports: Mapping[str, ParkReport],
        demands: Mapping[str, Mapping[str, int]],
        host_park: Optional[Tuple[str, int]],
        now: float,
        may_wait: AbstractSet[str] = frozenset(),
    ) -> dict:
        """A room call of `user`'s server: checked (room.RoomRefused: nothing kept), then one decision of the host's
        broker over every user's kernels; answers for this server's kernels, wakes the servers asked to park.
        `host_park`: (kernel, bytes) of a park about to begin, promised its host memory or refused (HostRoom);
        `may_wait`: the demands its server says are fast-path resumes (room.py's docstring: what is believed)."""
        owned = self.book.owned()
        named = dict(reports)
        if host_park is not None and host_park[0] not in named:
            named[host_park[0]] = ParkReport("idle", None, False)  # checked as its own kernel, never heard
        check_request(owned, self.book.devices, user, server, named, {}, None)
        checked = check_request(owned, self.book.devices, user, server, reports, demands, self.room.seen())
        host_answer = None if host_park is None else self._host_park(owned, host_park, now)
        self.room.hear(user, server, checked.reports, now, lease=False)
        self.room.ask(user, server, checked.demands, now, may_wait)
        self.room.expire(now, {o.grant.kernel_id for o in owned}, self.lease_seconds)
        heard, waiting, held, taken = self.room.view()
        sample = self.recent_sample(now)
        available, cgroup = parking.host_room()  # the host's memory (the function, parking's surface)
        round_ = host_round(
            self.book.devices,
            owned,
            sample.device_used if sample is not None else None,
            sample.attributed.kernel_used if sample is not None else {},
            heard,
            waiting,
            held,
            HostView(available, cgroup),
            self.settings,
            user,
            now,
            read_at(sample) if sample is not None else None,
            taken,
        )
        used = self._used_by(user, owned, sample)
        limits, by_uuid = self.book.limits_of(user), {d.uuid: d for d in self.book.devices.values()}
        answer = self.room.answer(
            decide(round_),
            user,
            server,
            owned,
            now,
            lambda claimed: reservation_over_budget(used, claimed, by_uuid, limits),
        )
        if answer.go:  # on disk before "go" is answered: a restart of the service keeps the restore's room
            self.store.save_reservations(self.room.reservations())
        for asked in answer.asked:
            log.info(
                "gpu-quota service: the host's broker asks %s's server %r to park idle kernel %s, to make room for "
                "%s's kernel %s",
                asked.user,
                asked.server,
                asked.kernel_id,
                asked.for_user,
                asked.for_kernel,
            )
        for key in answer.wake:
            self.polls.wake(key)
        data = answer.json()
        if host_answer is not None:
            data["host_park"] = host_answer
        for kernel_id in checked.unknown:
            data["waiting"][kernel_id] = "the host's GPU quota service holds no grant for this kernel (released)"
        for kernel_id in checked.demands:
            if kernel_id not in data["go"] and kernel_id not in data["waiting"] and kernel_id not in data["told"]:
                # Not decided (room.host_round): the service's sample still shows the kernel's memory on the GPU.
                data["waiting"][kernel_id] = (
                    "the host's last GPU sample still shows this kernel's memory on the device; waiting for one that "
                    "shows it parked"
                )
        return data

    def _host_park(self, owned: Sequence[Owned], host_park: Tuple[str, int], now: float) -> dict:
        """A park about to begin asks for its host memory: promised, or refused with the reason."""
        kernel_id, nbytes = host_park
        if kernel_id not in {o.grant.kernel_id for o in owned}:
            return {"kernel_id": kernel_id, "refused": "the host's GPU quota service holds no grant for it"}
        refused = self.room.promise_host(
            kernel_id, nbytes, HostReading(*parking.host_room()), self.settings.host_margin, now
        )
        return {"kernel_id": kernel_id, "refused": refused}

    def _used_by(self, user: str, owned: Sequence[Owned], sample: Optional[Sample]) -> Dict[str, int]:
        """What the user's kernels use on each device, in the service's sample; with unparkable_idle = "count",
        the idle memory the user keeps that could not be parked, counted once more."""
        used: Dict[str, int] = {}
        for item in owned:
            if item.grant.user == user and sample is not None:
                for uuid, n in sample.attributed.kernel_used.get(item.grant.kernel_id, {}).items():
                    used[uuid] = used.get(uuid, 0) + n
        if self.count_kept_idle:
            uuid_of = {d.index: d.uuid for d in self.book.devices.values()}
            for index, n in self.book.kept_idle_of(user).items():
                used[uuid_of[index]] = used.get(uuid_of[index], 0) + n
        return used

    def recent_sample(self, now: float) -> Optional[Sample]:
        """The last host sample, if recent enough to decide on (a stalled or missing one: nothing moves)."""
        sample = self.sampler.last
        if sample is None or self.sampler.state() in ("stalled", "no GPU"):
            return None
        if now - sample.taken_at > self.sample_gap:
            return None
        return sample

    # --- each sample, each expiry -----------------------------------------------------------------

    def note_sample(self, sample: Sample, now: float) -> None:
        """A host sample (the sampler's thread): which resumes it shows done, which kernels keep idle memory."""
        self.room.note_sample(read_at(sample), sample.attributed.kernel_used)
        self.note_kept_idle(sample, now)

    def note_kept_idle(self, sample: Sample, now: float) -> None:
        """Which kernels keep idle memory that could not be parked (limits.kept_idle), as of this sample; with
        unparkable_idle = "count", the book counts it against their users' budgets."""
        owned = self.book.owned()
        park = self.room.status(owned, "", True, now)["park"]
        kept = kept_idle(park, sample.attributed.kernel_used, self.settings.min_idle)
        self.kept_idle = kept
        if self.count_kept_idle:
            index_of = {d.uuid: d.index for d in self.book.devices.values()}
            by_user = per_user(kept, {o.grant.kernel_id: o.grant.user for o in owned})
            self.book.set_kept_idle(
                {u: {index_of[uuid]: n for uuid, n in held.items() if uuid in index_of} for u, held in by_user.items()}
            )

    def expire(self, now: float, granted: Iterable[str]) -> None:
        """Forget what the room holds of kernels no longer granted, and requests and reports gone stale."""
        self.room.expire(now, set(granted), self.lease_seconds)

    # --- what the status shows ----------------------------------------------------------------------

    def status(self, visible: Sequence[Owned], viewer: str, admin: bool, now: float) -> dict:
        """The room's part of `viewer`'s status (room.HostRoom.status), with the kept-idle memory; an admin also
        sees the long polls waiting and the host memory promised to parks under way (every user's)."""
        room = self.room.status(visible, viewer, admin, now)
        kept = self.kept_idle
        room["kept_idle"] = [
            {
                "user": o.grant.user,
                "kernel_id": o.grant.kernel_id,
                "server": o.server,
                "held": dict(kept[o.grant.kernel_id]),
                "idle_for": room["park"].get(o.grant.kernel_id, {}).get("idle_for"),
                "declined_park": room["park"].get(o.grant.kernel_id, {}).get("declined_park"),
                "counted": self.count_kept_idle,
            }
            for o in visible
            if o.grant.kernel_id in kept
        ]
        if admin:
            room["long_polls"] = self.polls.count()
            room["host_memory"] = {"promised": self.room.host_promised()}
        return room

