"""Which running kernels are short of room: the pure decision behind "room before the cell needs it". No I/O,
no clock.

Under overcommit the ledger grants caps that add up to more than a device. A kernel's headroom on a device is
what its cap still lets it take there (cap - what it uses now). An idle kernel's headroom is claimed by nobody
(broker.KernelView.headroom): so another kernel may take it, and the kernel's next allocation, under its own
cap, meets torch's out-of-memory error because idle kernels hold the device. A kernel is *short* on a device
when its headroom there is more than the device's room for it right now, in the broker's own model of room
(broker.room: total - NVML used - what running cells claim - reservations - margin), and parking idle kernels
could make up the difference. The parker tells each kernel when this changes (a flag on its control channel);
the kernel asks for room at the start of its next cell instead of after an out-of-memory error.

Only where room can be made: a kernel whose headroom no parking could free (a process outside the quota holds
the device, a cap larger than the device, nothing idle and parkable there) is not short, or every cell of it
would wait its whole park_wait_limit for room that cannot come. A reading that is unknown (NVML could not read
the device this round) decides nothing: the caller keeps what it said before.
"""

from __future__ import annotations

from typing import Dict, Hashable, Optional, Sequence

from ..shared.park_state import ON_DEVICE
from .broker import KernelView, Round, candidates, room

UNKNOWN = object()  # short_of_room's value for a kernel whose device could not be read this round


def _bytes(value: object) -> int:
    """A byte count as the model takes it: an int of at least 0 (missing, negative or not a number: 0)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return max(0, value)


def headroom(kernel: KernelView, key: Hashable) -> int:
    """What the kernel's cap still lets it take on `key`, whatever its state (broker.KernelView.headroom counts it
    only while a cell runs: here it is the room the kernel's next cell may need)."""
    return max(0, _bytes(kernel.caps.get(key)) - _bytes(kernel.used.get(key)))


def short_on(kernel: KernelView, round_: Round) -> object:
    """The device `kernel` is short of room on (the first, in the round's order), None when it is short nowhere,
    UNKNOWN when a device of its grant could not be read."""
    others = [k for k in round_.kernels if k.kernel_id != kernel.kernel_id]
    reservations = [r for r in round_.reservations if r.kernel_id != kernel.kernel_id]
    margin = _bytes(round_.settings.device_margin)
    # Idle kernels the broker could park (min_idle aside: an idle kernel may become old enough while the cell
    # waits) and parks under way: what making room could give back.
    parkable = candidates(others, 0.0)
    unknown = False
    for device in round_.devices:
        key = device.key
        need = headroom(kernel, key)
        if key not in kernel.caps or need <= 0:
            continue
        if device.used is None or not isinstance(device.total, int) or device.total <= 0:
            unknown = True
            continue
        free = room(device, others, reservations, margin)
        if free is None:
            unknown = True
            continue
        if need <= free:
            continue
        if any(_bytes(r.held.get(key)) > 0 for r in reservations):
            # A restore under way was given room its cap would reach into: the allocator shows those bytes free
            # until the restore has taken them. The cell waits until it has landed (then the broker lets it run,
            # making room if it can), or the restore finds its room gone and the kernel being restored is lost.
            return key
        could = sum(k.frees(key) for k in parkable) + sum(
            _bytes(k.used.get(key)) for k in others if k.state == "parking"
        )
        if need <= free + could:
            return key
    return UNKNOWN if unknown else None


def short_kernels(round_: Round, kernel_ids: Optional[Sequence[str]] = None) -> Dict[str, object]:
    """short_on for each running kernel of the round that holds a grant (of `kernel_ids` only, when given)."""
    wanted = None if kernel_ids is None else set(kernel_ids)
    return {
        k.kernel_id: short_on(k, round_)
        for k in round_.kernels
        if k.state in ON_DEVICE and k.caps and (wanted is None or k.kernel_id in wanted)
    }
