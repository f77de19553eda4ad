"""Room before the cell needs it, seen from the kernel. Stdlib only.

Under overcommit the server's caps add up to more than a device, so a kernel under its cap can find the device
full because idle kernels hold it. The server knows when that is so (parking/headroom.py: this kernel's headroom,
cap minus what it uses, is not free on its device now, and parking idle kernels could free it) and tells the
kernel on its control channel, only when it changes: {"action": "room_flag", "short": bool, "device": index,
"holding": bool}. The kernel keeps the word in this module's globals.

At the start of a cell (IPython's pre_run_cell) a kernel that is short and uses the device (it holds memory
there, or torch or CuPy has started CUDA in it) asks the server for room (QuotaClient.ask_room, the same request
as after an out-of-memory error) and waits before any of the cell's code runs, while the broker parks idle
kernels. Like a parked kernel's wait, it says why once it has lasted a second, can be stopped with the stop
button (the cell then does not run), and ends at the park_wait_limit; when no room is made the cell runs anyway,
with one line saying so. A kernel that never touched the GPU asks once, at torch's first CUDA use
(torch_cap.install_lazy_hook). When the flag is off the hook is one test of a module-level bool: nothing
measurable (benchmarks/cell_room_check_bench.py).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Callable, Optional

from .park import duration_words

if TYPE_CHECKING:  # for the signatures only: a kernel imports nothing heavy at its start
    from IPython.core.interactiveshell import ExecutionInfo, InteractiveShell

    from .client import ParkAnswer

PREFIX = "gpu-quota:"
# The wait's pace and words are a parked kernel's (park_wait.py): asked every 0.1 s at first, every half second
# after a second; silent under a second; past the limit by this much with nobody's word, it ends.
FIRST_POLL_S, POLL_S, NOTICE_AFTER_S, TOLD_LATE_S = 0.1, 0.5, 1.0, 10.0

# The server's last word (parking/headroom.py), set in ipykernel's control thread, read at a cell's start.
SHORT = False
DEVICE: Optional[int] = None  # the server's index of the device it is short on
HOLDING = False  # the server sees this kernel's processes on that device

# Set by a wait the user stopped: the cell must not run (park_wait.WaitWhileParked rejects it, then clears it).
STOPPED: Optional[str] = None


def on_flag(content: dict) -> dict:
    """The server's room_flag request (control thread); the reply's content."""
    global SHORT, DEVICE, HOLDING
    short = content.get("short")
    device = content.get("device")
    bad_device = device is not None and (isinstance(device, bool) or not isinstance(device, int))
    if not isinstance(short, bool) or bad_device:
        return {"error": "room_flag needs short (bool) and device (int or null)"}
    DEVICE = device if short else None
    HOLDING = bool(content.get("holding")) and short
    SHORT = short
    return {"short": SHORT}


def clear() -> None:
    """The kernel is about to park: its room comes back with its resume, not from this flag."""
    global SHORT, DEVICE, HOLDING
    SHORT, DEVICE, HOLDING = False, None, False


def uses_cuda() -> bool:
    """torch has started CUDA in this process, or CuPy is loaded; without importing either."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return True
    except Exception:  # broad: a half-imported or unusual torch: taken as not in use
        pass
    return "cupy" in sys.modules


def only_magic(raw_cell: str) -> bool:
    """A cell of nothing but `%gpucap ...` lines (and blank ones) never waits: the user can always look."""
    lines = [line.strip() for line in (raw_cell or "").splitlines() if line.strip()]
    return bool(lines) and all(line.startswith("%gpucap") for line in lines)


class RoomCheck:
    """The pre_run_cell hook and the check at torch's first CUDA use."""

    def __init__(
        self,
        ask_room: Callable[[Optional[int]], Optional[ParkAnswer]],
        park_state: Callable[[], Optional[dict]],
        out: Callable[[str], None],
        may_be_parked: Callable[[], bool] = lambda: False,
    ):
        self.ask_room = ask_room  # QuotaClient.ask_room
        self.park_state = park_state  # QuotaClient.park_state
        self.out = out
        self.may_be_parked = may_be_parked  # a parked kernel's cell waits for its resume instead (park_wait.py)
        self.sleep, self.clock = time.sleep, time.monotonic

    def pre_run_cell(self, info: Optional[ExecutionInfo] = None) -> None:
        if not SHORT:  # the whole cost when the device has room: keep this first
            return
        if only_magic(getattr(info, "raw_cell", "")) or not (HOLDING or uses_cuda()):
            return
        self.wait_for_room(interruptible=True)

    def at_first_cuda(self) -> None:
        """torch starts CUDA in a kernel that held nothing yet (torch's lazy init calls this once)."""
        if SHORT:
            self.wait_for_room(interruptible=False)

    def wait_for_room(self, interruptible: bool) -> Optional[str]:
        global STOPPED
        if self.may_be_parked():
            return None
        device = DEVICE
        try:
            return room_before_cell(lambda: self.ask_room(device), self.park_state, self.out, self.sleep, self.clock)
        except KeyboardInterrupt:
            if not interruptible:  # inside torch's CUDA start: never break it; the user's next stop interrupts
                self.out(f"{PREFIX} stopped waiting for room; the code goes on")
                return "stopped"
            STOPPED = f"{PREFIX} interrupted while waiting for room on the GPU; the cell did not run"
            return "stopped"
        finally:
            # Asked once. The server pushes the flag only when its decision changes: after room was made it says
            # "not short", and "short" again only when that is so again; after a wait that made no room the
            # next cells do not wait again for nothing (their out-of-memory error still asks, park_on_device_full).
            clear()


CHECK: Optional[RoomCheck] = None  # the kernel's one RoomCheck, once installed


def install(shell: InteractiveShell, check: RoomCheck) -> None:
    global CHECK
    CHECK = check
    shell.events.register("pre_run_cell", check.pre_run_cell)


def at_first_cuda() -> None:
    """torch_cap's lazy hook: the check, once, where the kernel installed one."""
    if SHORT and CHECK is not None:
        CHECK.at_first_cuda()


# --- the wait -------------------------------------------------------------------------------------------------


def room_before_cell(
    ask: Callable[[], Optional[ParkAnswer]],
    park_state: Callable[[], Optional[dict]],
    out: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Optional[str]:
    """Ask for room up to this kernel's cap before the cell's code runs, and wait while the broker makes it, as a
    parked kernel's cell waits: silent under a second, then why (once per new reason), at most the
    park_wait_limit. The cell runs afterwards in every case but an interrupt (KeyboardInterrupt is raised to the
    caller); where no room was made it says so in one line. The outcome: "made", "told", "waiting" or None (the
    server makes no room: off, nothing to give, no answer)."""
    answer = ask()
    if getattr(answer, "outcome", None) != "accepted":
        return None
    began = clock()
    said: Optional[str] = None
    limit: float = 300.0
    poll = FIRST_POLL_S
    while True:
        park = park_state() or {}
        room = park.get("room")
        if isinstance(park.get("wait_limit"), (int, float)):
            limit = float(park["wait_limit"])
        waited = clock() - began
        if room == "made":
            if said is not None:
                out(f"{PREFIX} room made after {waited:.1f} s; the cell runs now")
            return "made"
        if room != "asking":
            out(
                f"{PREFIX} no room made before the cell: {park.get('reason') or 'the broker gave up'}; the cell runs "
                "anyway (it may find the GPU full)"
            )
            return "told"
        if waited > limit + TOLD_LATE_S:
            out(f"{PREFIX} room is still being made after {waited:.0f} s; the cell runs now (it may find the GPU full)")
            return "waiting"
        line = room_line(park)
        if line != said and waited >= NOTICE_AFTER_S:
            out(line)
            said = line
        sleep(poll)
        poll = min(POLL_S, poll * 1.5)


def room_line(park: dict) -> str:
    """One line while a cell waits for room at its start: why, and what the broker does about it."""
    reason = park.get("reason") or "the broker parks idle kernels to make room"
    limit = duration_words(park.get("wait_limit"), exact=True)
    most = f" (at most {limit})" if limit else ""
    return (
        f"{PREFIX} waiting for room before the cell runs{most}: idle kernels hold the GPU memory this kernel's cap "
        f"promises; {reason}"
    )
