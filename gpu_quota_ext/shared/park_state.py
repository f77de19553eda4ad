"""A kernel's park state: one enum for the wire (the status answer's "park", the host service's reports), the code
that decides it (parking/states.py, parking/shown.py, parking/broker.py, hub/service/room.py) and the sidebar
(labextension/src/contract.ts declares `ParkState` with the same names and values; a test checks both lists).
Standard library only: the kernel side reads these words too.

A member is a `str`: it compares equal to the wire's word ("parked" == ParkState.PARKED), goes into JSON as that
word, and prints as it (str() and f-strings give the value, not "ParkState.PARKED", on every Python).

The parker's own record has one more state, states.RUNNING ("the parker holds nothing of it"), which is never on
the wire: such a kernel is shown as jupyter_server's BUSY or IDLE. The CUDA driver's process states
(checkpoint.py: DRIVER_RUNNING, LOCKED, ...) are a third vocabulary, of one process, not of a kernel.
"""

from __future__ import annotations

from enum import Enum


class ParkState(str, Enum):
    BUSY = "busy"  # running a cell (or a widget message): holds its GPU memory, as it should
    IDLE = "idle"  # holds GPU memory, runs nothing (for `idle_seconds`)
    PENDING = "pending"  # asked to park: parks as soon as its current cell has finished
    PARKING = "parking"  # the driver is moving its GPU memory to host memory
    PARKED = "parked"  # its GPU memory is on the host (`host_bytes`), its grant kept
    RESUMING = "resuming"  # the driver is moving it back
    WAITING = "waiting"  # waits for the broker to make room to come back to (`reason` what for, `waited` how long)
    LOST = "lost"  # its restore failed: what was on the GPU cannot come back (`reason`: what the user can do)

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)  # f"{state}" is the word on 3.9 and 3.12 alike


# Groups the decisions use, by what they mean for the device's memory.
ON_DEVICE = (ParkState.BUSY, ParkState.IDLE, ParkState.PENDING)  # free to allocate up to their caps
CLAIMING = (ParkState.BUSY, ParkState.PENDING)  # running a cell: the headroom its cap allows is claimed
ON_HOST = (ParkState.PARKED, ParkState.WAITING)  # their bytes are on the host
MOVING = (ParkState.PARKING, ParkState.PARKED)  # reports of one park, under way or done
