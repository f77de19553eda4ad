"""One account of the host's memory for parks: what is parked is in the host's available memory already, what is
being parked is promised here before its driver call, and the margin is kept free. Pure: no I/O, no clock.

Why an account and not a reading: a park's bytes reach host memory over its driver call's seconds (2.5 GB/s
through the checkpoint path: 23 s for 56 GiB), so a second park checked against the host's available memory
during the first one's copy sees room that is already promised. Two idle timers firing in the same second on an
H200 each saw 128 GiB available and parked 56.5 GiB; with the first parked kernel that was 3 x 56.5 GiB and the
kernel OOM killer ended a user's kernel (FACTS.md, 2026-12-02). Every park, whoever asks for it (idle timer,
user, broker, host service), is checked and promised in one step on the event loop, so parks that race never
promise more than the host can give.

A promise counts what has not landed yet: the kernel's processes' resident memory grows by the bytes the driver
has copied, which the host's available memory already shows (counting them in both would refuse parks the host
can take). A promise ends when its driver call returns, whatever it returned: then the host's reading is the
whole truth again.

Host memory short anyway (another program took it while kernels are parked): `host_short` says so, and the
parker stops parking and brings parked kernels back, largest first, where the device has room.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional, Tuple

from ..shared.sizes import format_bytes


@dataclass(frozen=True)
class HostPromise:
    """Host memory promised to one park whose driver call is under way."""

    kernel_id: str
    nbytes: int  # the GPU bytes the park moves to host memory
    landed: int = 0  # of those, already in its processes' resident memory (and so in the host's reading)

    @property
    def outstanding(self) -> int:
        return max(0, self.nbytes - max(0, self.landed))


@dataclass(frozen=True)
class HostReading:
    """The host's available memory and the memory cgroup's room (None: no limit, or unreadable)."""

    available: Optional[int] = None
    cgroup_room: Optional[int] = None

    def least(self) -> Optional[int]:
        known = [x for x in (self.available, self.cgroup_room) if x is not None]
        return min(known) if known else None


@dataclass(frozen=True)
class HostAccount:
    promises: Tuple[HostPromise, ...] = ()

    def outstanding(self) -> int:
        """Bytes promised to parks under way that the host's reading does not show yet."""
        return sum(p.outstanding for p in self.promises)

    def kernels(self) -> frozenset:
        return frozenset(p.kernel_id for p in self.promises)

    def left(self, reading: HostReading) -> Optional[int]:
        """Host memory a new park may still take (before the margin); None: the host's memory is unknown."""
        least = reading.least()
        return None if least is None else least - self.outstanding()

    def refusal(self, kernel_id: str, nbytes: int, reading: HostReading, margin: int) -> Optional[str]:
        """Why the host cannot take this park's `nbytes` now (None: it can). Both the host and the server's
        memory cgroup must hold it, with the margin, beside what parks under way will still bring."""
        if any(p.kernel_id == kernel_id for p in self.promises):
            return "did not park: a park of this kernel is already under way"
        coming = self.outstanding()
        needs = f"parking needs {format_bytes(nbytes)} plus a margin of {format_bytes(margin)}"
        if coming:
            needs += f", and parks under way will still bring {format_bytes(coming)}"
        if reading.available is not None and reading.available - coming < nbytes + margin:
            available = format_bytes(max(0, reading.available))
            return f"did not park: the host has {available} of memory available and {needs}"
        if reading.cgroup_room is not None and reading.cgroup_room - coming < nbytes + margin:
            return (
                f"did not park: the server's memory cgroup has room for {format_bytes(max(0, reading.cgroup_room))} "
                f"more and {needs}"
            )
        return None

    def short_by(self, nbytes: int, reading: HostReading, margin: int) -> int:
        """How much more host memory this park's `nbytes` needs than `refusal` lets it have (0: none more)."""
        coming = self.outstanding()
        limits = [x for x in (reading.available, reading.cgroup_room) if x is not None]
        return max([0] + [nbytes + margin - (limit - coming) for limit in limits])

    def promise(self, kernel_id: str, nbytes: int) -> "HostAccount":
        """Promise a checked park its bytes (after `refusal` said None, in the same step)."""
        kept = tuple(p for p in self.promises if p.kernel_id != kernel_id)
        return HostAccount(kept + (HostPromise(kernel_id, max(0, int(nbytes))),))

    def landing(self, landed: Mapping[str, int]) -> "HostAccount":
        """What each promised park has brought so far (its processes' resident memory grown since its promise)."""
        return HostAccount(
            tuple(replace(p, landed=min(p.nbytes, max(0, landed[p.kernel_id]))) if p.kernel_id in landed else p
                  for p in self.promises)
        )

    def release(self, kernel_id: str) -> "HostAccount":
        """The park's driver call returned (its bytes are in the reading now), or the park never began."""
        return HostAccount(tuple(p for p in self.promises if p.kernel_id != kernel_id))


def host_short(reading: HostReading, parked_bytes: int, margin: int, was_short: bool = False) -> bool:
    """Host memory ran short with kernels parked on it. Every park leaves the margin free, so only memory taken
    outside the account gets here: an episode begins below half the margin while kernels are parked, and ends
    once the whole margin is free again, whether or not kernels are still parked (one threshold would start and
    end episodes on every small wobble). During one, nothing more parks and parked kernels come back where the
    device has room, before the OOM killer chooses a process to end."""
    least = reading.least()
    if least is None:
        return False
    if was_short:
        return least < margin
    return parked_bytes > 0 and least < margin // 2


def host_short_words(reading: HostReading, parked_bytes: int) -> str:
    least = reading.least()
    return (
        f"host memory is short: {format_bytes(max(0, least or 0))} available with {format_bytes(parked_bytes)} of "
        "parked GPU memory on the host; nothing parks, and parked kernels come back where the device has room"
    )
