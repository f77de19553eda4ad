"""One user's share of the host: the per-user limits (`max_kernels`, `user_budget`, user_policy.UserLimits)
decided. Pure: the book (book.py) hands in the user's grants and asks before the ledger places a kernel or
raises a cap, inside its lock, so a burst of concurrent starts from one user cannot pass a limit.

The limits hold whatever a request says: the user is the token's owner, the counts are the book's own.
"""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional

from ...devices import Device
from ...ledger import Grant
from ...shared.sizes import format_bytes
from .user_policy import UserLimits


def kernels_refusal(held: int, limits: UserLimits) -> Optional[str]:
    """Why one more kernel of a user who holds `held` grants is refused, or None."""
    if held < limits.max_kernels:
        return None
    return (
        f"you hold grants for {held} kernels, the most this host gives one user (max_kernels "
        f"{limits.max_kernels}): shut down a kernel first"
    )


def user_totals(grants: Iterable[Grant]) -> Dict[int, int]:
    """Device index -> the bytes one user's grants hold there."""
    totals: Dict[int, int] = {}
    for grant in grants:
        for index, cap in grant.caps.items():
            totals[index] = totals.get(index, 0) + cap
    return totals


def over_budget(
    totals: Mapping[int, int], wanted: Mapping[int, int], devices: Mapping[int, Device], limits: UserLimits
) -> Dict[int, str]:
    """The devices where `wanted` bytes more would pass the user's budget: index -> why."""
    over = {}
    for index, nbytes in wanted.items():
        limit = limits.budget_on(devices[index])
        held = totals.get(index, 0)
        if limit is not None and held + nbytes > limit:
            over[index] = (
                f"your kernels hold {format_bytes(held)} of GPU {devices[index].uuid}, and "
                f"{format_bytes(nbytes)} more would pass your {format_bytes(limit)} (user_budget {limits.user_budget})"
            )
    return over


def reservation_over_budget(
    used: Mapping[str, int], claimed: Mapping[str, int], devices: Mapping[str, Device], limits: UserLimits
) -> Optional[str]:
    """Why a resume of one user may not be given room now, or None: on each device (by uuid) what the user's kernels
    use there (the service's sample) plus what the user would have reserved there with it (`claimed`: their
    reservations and this resume's need, its padding included) must stay within the user's budget. Without it,
    padded needs let one user reserve most of a device with nothing restored (12 kernels of 512 MiB each, 10 GiB
    of a 12 GiB device reserved)."""
    for uuid, nbytes in sorted(claimed.items()):
        device = devices.get(uuid)
        limit = None if device is None else limits.budget_on(device)
        if limit is None:
            continue
        total = used.get(uuid, 0) + nbytes
        if total > limit:
            return (
                f"your kernels use {format_bytes(used.get(uuid, 0))} of GPU {uuid} and would have "
                f"{format_bytes(nbytes)} reserved there with this resume: more than your {format_bytes(limit)} "
                f"(user_budget {limits.user_budget}); it waits until your kernels there hold less"
            )
    return None


def room_for(others: Mapping[int, int], device: Device, limits: UserLimits) -> Optional[int]:
    """The most one kernel may hold on `device` while the user's other kernels hold `others` (None: no limit)."""
    limit = limits.budget_on(device)
    return None if limit is None else max(limit - others.get(device.index, 0), 0)


def kept_idle(
    park: Mapping[str, Mapping], used: Mapping[str, Mapping[str, int]], min_idle: float
) -> Dict[str, Dict[str, int]]:
    """Kernel id -> device uuid -> bytes: the GPU memory of kernels kept idle that could not be parked. A kernel
    counts when its server's last report (HostRoom.status()'s "park") says it has been idle at least `min_idle`
    and it cannot park (its server says it is not parkable, or it declined a park request the broker made);
    its bytes are what the service's sample saw it use (`used`). Such memory is out of the broker's reach for
    every other user: with `unparkable_idle = "count"` it counts, for its user, against the user's budget once
    more, on top of the grant that holds it."""
    kept: Dict[str, Dict[str, int]] = {}
    for kernel_id, report in park.items():
        idle_for = report.get("idle_for")
        if report.get("state") != "idle" or idle_for is None or idle_for < min_idle:
            continue
        if report.get("parkable") and report.get("declined_park") is None:
            continue
        held = {uuid: n for uuid, n in used.get(kernel_id, {}).items() if n > 0}
        if held:
            kept[kernel_id] = held
    return kept


def per_user(kept: Mapping[str, Mapping[str, int]], owners: Mapping[str, str]) -> Dict[str, Dict[str, int]]:
    """User -> device uuid -> bytes of `kept` (kernel id -> uuid -> bytes), `owners` saying whose each kernel is."""
    totals: Dict[str, Dict[str, int]] = {}
    for kernel_id, held in kept.items():
        user = owners.get(kernel_id)
        if user is None:
            continue
        mine = totals.setdefault(user, {})
        for uuid, n in held.items():
            mine[uuid] = mine.get(uuid, 0) + n
    return totals
