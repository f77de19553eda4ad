"""The state a kernel is shown in to the broker, with its idle time and whether it may be parked: one rule for a
server's parker (parker.py, Parker.round) and for the host service (hub/service/room.py, over every user's
kernels). Pure: no I/O, no clock (`now` is passed in).

Both start from what the kernel's own side says (the parker's record with jupyter_server's busy/idle, or its
server's last report) and correct it with what the broker must not be told wrong:

- a kernel never heard of is BUSY (its memory and the headroom its cap allows are claimed) and never parked;
- PARKED while the device's last reading still counts the park's bytes (the reading was taken before the park
  ended) is PARKING: its bytes are leaving, the broker waits for them and parks nobody else for them;
- PARKING is believed while its driver call is out and has not been found stuck (park_call_timeout), where that
  call can be seen (the parker's own); where it cannot (the host service, of other servers' kernels), no longer
  than a park can take (`park_time`: its bytes at PARK_RATE, plus PARK_MARGIN, from when the park was first said
  to be under way). Beyond that it is BUSY: its bytes are not waited for (they may never leave) and its headroom
  is claimed, so that one park that does not end never holds up everyone else's resume;
- idle time is the idle time said, plus how long ago it was said, and only of an IDLE kernel;
- parkable only when IDLE and its own side says parking can work for it.

"The reading still counts the park's bytes" is a fact each caller knows in its own way: the parker from the
sample's time against the park's end (it knows both); the host service from its sample showing the kernel's
memory, taken no later than its server's first report of "parked" (the park ended before that report: memory a
later sample shows is what the driver leaves on the device, not the park's bytes).

What changed when the two derivations became this one (issue 28, issue 32 item 1):
- the parker: idle time is given for IDLE kernels only (a parked or pending kernel's jupyter_server idle time was
  given too, and read by nobody: the broker looks at idle kernels' only, the host service dropped the others');
- the host service: a kernel reported parked whose memory a sample taken after that report still shows is shown
  PARKED (it was PARKING, then BUSY once `park_time` had passed, claiming its whole cap's headroom: the fast park
  path leaves its CUDA context, ~0.6 GiB, on the device while parked).
Not changed, on purpose: the parker does not time its own park under way against `park_time` (it sees the call;
the property test of the model, tests/unit/test_room_model.py, found that timing it there makes its server report
"busy" while the call is still out, and the host service end that park's host promise while its bytes still come).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..shared.park_state import ParkState

PARK_RATE = 0.5e9  # bytes per second a park is counted to take at the slowest (an H200 measured 1.1 to 2.2 GB/s) ...
PARK_MARGIN = 60.0  # ... plus this: a park said to be under way for longer is not believed (its bytes not waited for)


def park_time(nbytes: int) -> float:
    """Seconds a park of `nbytes` is believed to be under way at most."""
    return PARK_MARGIN + max(0, nbytes) / PARK_RATE


@dataclass(frozen=True)
class Said:
    """What a kernel's own side says of it, and what is known beside."""

    state: Optional[str]  # a ParkState word; None: never said (a kernel its server has not reported yet)
    at: float  # when it was said (wall clock)
    idle_for: Optional[float] = None  # seconds idle when it was said
    parkable: bool = False  # its own side: parking can work for it now
    park_since: Optional[float] = None  # when its park was first said to be under way (PARKING or PARKED); None:
    # not timed (the parker's own park: it sees its driver call, and `stuck` says when it has not returned)
    park_bytes: int = 0  # the bytes that park moves
    in_reading: bool = False  # the device's last reading still counts those bytes (taken before the park ended)
    stuck: bool = False  # its driver call has not returned within park_call_timeout


@dataclass(frozen=True)
class Shown:
    state: ParkState
    idle_for: Optional[float]
    parkable: bool


def shown_as(said: Said, now: float) -> Shown:
    """The state the broker sees the kernel in (the module's docstring says the rule)."""
    if said.state is None:
        return Shown(ParkState.BUSY, None, False)
    state = ParkState(said.state)
    if state == ParkState.PARKED and said.in_reading:
        state = ParkState.PARKING
    if state == ParkState.PARKING and (said.stuck or overdue(said, now)):
        state = ParkState.BUSY
    if state != ParkState.IDLE:
        return Shown(state, None, False)
    idle_for = None if said.idle_for is None else said.idle_for + max(0.0, now - said.at)
    return Shown(state, idle_for, said.parkable)


def overdue(said: Said, now: float) -> bool:
    """Said to be parking for longer than a park of its bytes can take."""
    return said.park_since is not None and now - said.park_since > park_time(said.park_bytes)
