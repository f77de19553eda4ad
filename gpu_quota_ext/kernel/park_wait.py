"""A parked kernel's next cell, seen from the kernel: it waits for its GPU memory to come back in Python, where it
can say why in the cell's output, be interrupted, and end cleanly at the admin's limit, instead of inside a CUDA
call the driver holds (where nothing can be said or interrupted). Stdlib only; IPython and ipykernel are used
when they are there.

How the kernel knows it may be parked: right before it parks the kernel, the server asks it on its control
channel to empty its allocators' caches (shared.contract.KERNEL_REQUEST, answered here, in ipykernel's control
thread, while the kernel is idle): only what the kernel really holds then moves to the host. From then on,
until a cell finds it running again, the kernel may be parked. At the next cell an AST transformer (IPython's
hook that runs before any of the cell's code) asks the server for the kernel's park state and, while it is
parked or waiting for room, asks again (every 0.1 s at first, every half second after a second) and, once the
wait has lasted a second, prints what it waits for (on the cell's stderr: its stdout stays the user's own output),
once per new reason. When the kernel runs again the cell
runs. At the wait limit (the server says `told`; or its count of the wait is past the limit and nothing told
it: no broker round ran), on an interrupt, or when
the restore failed (`lost`), the cell ends with one clear error instead (IPython's InputRejected: none of its
code runs) and the kernel keeps its grant. A cell that is only `%gpucap ...` lines never waits: the user can
always look, and ask for a park or resume.

A kernel that the server cannot ask (no bootstrap, an old server) waits in the driver as before.
"""

from __future__ import annotations

import ast
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..shared.contract import KERNEL_REPLY, KERNEL_REQUEST
from ..shared.sizes import format_bytes
from . import fast_park, lost_notice, room_check
from .park import clock, duration_words

if TYPE_CHECKING:  # for the signatures only: a kernel imports nothing heavy at its start
    from IPython.core.interactiveshell import InteractiveShell

    from .client import ParkAnswer

POLL_S = 0.5  # seconds between two questions to the server while the cell waits ...
FIRST_POLL_S = 0.1  # ... starting at this, 1.5 times longer each time: a 2 GiB kernel is back in ~0.7 s
NOTICE_AFTER_S = 1.0  # a wait shorter than this says nothing (a 2 GiB kernel comes back in ~0.7 s)
PREFIX = "gpu-quota:"
WAITING_STATES = ("parking", "parked", "waiting", "resuming")  # "pending" runs: it parks after the cell
TOLD_LATE_S = 10.0  # a wait this far past the server's limit that nobody told (no broker round ran) ends here
INTERRUPTED = f"{PREFIX} interrupted while waiting for the GPU; the kernel stays parked, the next cell asks again"


# --- the trim: the server's request before it parks this kernel (control thread) ---------------------------


def trim() -> dict:
    """Empty torch's and CuPy's caches of free device memory; what was freed. Never raises, never imports a
    framework the user has not imported (nor creates a CUDA context)."""
    before = after = 0
    frameworks = []
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            count = torch.cuda.device_count()
            before += sum(torch.cuda.memory_reserved(d) for d in range(count))
            torch.cuda.empty_cache()
            after += sum(torch.cuda.memory_reserved(d) for d in range(count))
            frameworks.append("torch")
    except Exception:  # broad: torch's own code; the reply says what was freed (nothing then)
        pass
    cupy = sys.modules.get("cupy")
    try:
        if cupy is not None:
            pool = cupy.get_default_memory_pool()
            held = pool.total_bytes()
            pool.free_all_blocks()
            before += held
            after += pool.total_bytes()
            frameworks.append("cupy")
    except Exception:  # broad: CuPy's own code; the reply says what was freed (nothing then)
        pass
    freed = max(0, before - after)
    return {"freed": freed, "reserved_before": before, "reserved_after": after, "frameworks": frameworks}


class ParkWatch:
    """Whether this kernel may be parked, and the wait of a cell that finds it so."""

    def __init__(self, park_state: Callable[[], Optional[dict]], out: Optional[Callable[[str], None]] = None):
        self.park_state = park_state  # the server's answer for this kernel (QuotaClient.park_state)
        self.out = out or _to_stderr  # the cell's stderr: the project's words never mix with the user's stdout
        self.maybe_parked = threading.Event()  # set by the trim request (control thread), cleared by a cell

    def on_request(self, content: Any) -> dict:
        """The server's control request; the reply's content."""
        action = content.get("action") if isinstance(content, dict) else None
        if action == "trim":
            self.maybe_parked.set()
            room_check.clear()  # parked, its room comes back with its resume
            return trim()
        if action == "facts":
            return fast_park.facts()
        if action == "park":  # the fast path (fast_park.py): the library copies its pages to the host
            self.maybe_parked.set()
            room_check.clear()
            return fast_park.park(content)
        if action == "resume":
            return fast_park.resume(content)
        if action == "release":
            return fast_park.release(content)
        if action == "room_flag":
            return room_check.on_flag(content)
        if action == lost_notice.ACTION:
            return lost_notice.on_request(content)
        return {"error": f"unknown action {action!r}"}

    def before_cell(self) -> None:
        """Return when the cell may run; raise CellNotRun when it must not."""
        if not self.maybe_parked.is_set():
            return
        began = time.monotonic()
        said: Optional[str] = None
        poll = FIRST_POLL_S
        while True:
            park = self.park_state()
            if park is None:  # no answer: the cell runs (if the kernel is parked, the driver holds its CUDA calls)
                if fast_park.parked_here():  # ... but the fast path holds none: GPU work would find no memory
                    raise CellNotRun(
                        f"{PREFIX} the cell did not run: this kernel's GPU memory is parked on the host and its "
                        "server does not answer; run the cell again once the server is back"
                    )
                return
            state = park.get("state")
            if state == "lost":
                raise CellNotRun(f"{PREFIX} the cell did not run: {park.get('reason') or 'the restore failed'}")
            if state not in WAITING_STATES:
                if fast_park.parked_here():  # the server does not know it parked (an answer that never came)
                    raise CellNotRun(
                        f"{PREFIX} the cell did not run: this kernel's GPU memory is still parked on the host, "
                        "and the server does not know it (the kernel's answer to its park was lost): save what you "
                        "need from host memory and restart the kernel"
                    )
                self.maybe_parked.clear()
                if said is not None:
                    self.out(f"{PREFIX} back on the GPU after {time.monotonic() - began:.1f} s; the cell runs now")
                return
            if park.get("told") and state == "waiting":  # a parked kernel's told is its last wait's, said until
                # this cell's wait begins (the server may answer before it has seen the cell's busy)
                raise CellNotRun(
                    f"{PREFIX} the cell did not run: {park.get('reason')}. Nothing is lost: the kernel stays "
                    "parked with its grant; run the cell again to ask again"
                )
            if state == "waiting" and _past_limit(park):  # the broker's rounds follow the samples: none came
                raise CellNotRun(
                    f"{PREFIX} the cell did not run: waited {park['wait_limit']:g} s (the park_wait_limit) for device "
                    f"memory: {park.get('reason') or 'no room'}. Nothing is lost: the kernel stays parked with its "
                    "grant; run the cell again to ask again"
                )
            line = waiting_line(park)
            if line != said and (said is not None or time.monotonic() - began >= NOTICE_AFTER_S):
                self.out(line)
                said = line
            try:
                time.sleep(poll)
                poll = min(POLL_S, poll * 1.5)
            except KeyboardInterrupt:
                raise CellNotRun(INTERRUPTED) from None


def _past_limit(park: dict) -> bool:
    waited, limit = park.get("waited"), park.get("wait_limit")
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (waited, limit))
    return numbers and waited >= limit + TOLD_LATE_S  # type: ignore[operator]


def waiting_line(park: dict) -> str:
    """One line of the cell's output while it waits: what for, and how long so far."""
    state, reason = park.get("state"), park.get("reason")
    if state in ("parked", "parking"):
        held = park.get("host_bytes")
        since = clock(park.get("since"))
        where = f" ({format_bytes(held)} on the host" + (f" since {since})" if since else ")") if held else ""
        return f"{PREFIX} this kernel is parked{where}; bringing its GPU memory back before the cell runs"
    if state == "resuming":
        return f"{PREFIX} its GPU memory is coming back from the host"
    waited = duration_words(park.get("waited"), exact=True)
    limit = duration_words(park.get("wait_limit"), exact=True)
    timing = f" (waited {waited}" + (f" of at most {limit})" if limit else ")") if waited else ""
    return f"{PREFIX} waiting for device memory{timing}: {reason or 'asking for room'}"


# --- IPython's side ------------------------------------------------------------------------------------------


class CellNotRun(Exception):
    """The cell must not run now; IPython shows only this message (`_render_traceback_`)."""

    def _render_traceback_(self):
        return [str(self)]


def _rejected(message: str) -> Exception:
    """CellNotRun as IPython's InputRejected, so that the cell ends before any of its code runs."""
    try:
        from IPython.core.error import InputRejected
    except ImportError:
        return CellNotRun(message)

    class NotRun(CellNotRun, InputRejected):
        pass

    return NotRun(message)


def only_gpucap(tree: ast.AST) -> bool:
    """The cell is nothing but `%gpucap ...` lines (IPython makes each a run_line_magic('gpucap', ...) call)."""
    body = getattr(tree, "body", None)
    if not body:
        return False
    for node in body:
        call = node.value if isinstance(node, ast.Expr) else None
        func = getattr(call, "func", None)
        if not (isinstance(call, ast.Call) and isinstance(func, ast.Attribute) and func.attr == "run_line_magic"):
            return False
        first = call.args[0] if call.args else None
        if not (isinstance(first, ast.Constant) and first.value == "gpucap"):
            return False
    return True


class WaitWhileParked(ast.NodeTransformer):
    """Runs before every cell's code (IPython's ast_transformers); changes nothing in the code."""

    def __init__(self, watch: ParkWatch):
        self.watch = watch

    def visit(self, node: ast.AST) -> ast.AST:
        if room_check.STOPPED is not None:  # the user stopped the wait for room at the cell's start
            message, room_check.STOPPED = room_check.STOPPED, None
            raise _rejected(message)
        if self.watch.maybe_parked.is_set() and not only_gpucap(node):
            try:
                self.watch.before_cell()
            except CellNotRun as error:
                raise _rejected(str(error)) from None
            except KeyboardInterrupt:  # while asking the server, not while sleeping
                raise _rejected(INTERRUPTED) from None
            except Exception:
                # The question failed in a way of its own (an answer cut short): the cell runs, as with no answer.
                # Raising would make IPython unregister this transformer for good.
                pass
        return node


def install(shell: InteractiveShell, watch: ParkWatch) -> bool:
    """Answer the server's control requests and wait before cells; False where this kernel cannot (not
    ipykernel: no control channel)."""
    kernel = getattr(shell, "kernel", None)
    handlers = getattr(kernel, "control_handlers", None)
    if kernel is None or not isinstance(handlers, dict):
        return False

    def on_request(stream, ident, parent) -> None:
        try:
            content = watch.on_request(parent.get("content"))
        except Exception as error:  # never break the control thread
            content = {"error": repr(error)}
        kernel.session.send(stream, KERNEL_REPLY, content, parent, ident)

    handlers[KERNEL_REQUEST] = on_request
    lost_notice.install(shell)  # first: a restarted kernel's first cell says why before anything else
    shell.ast_transformers.append(WaitWhileParked(watch))
    room_check.install(shell, room_check.RoomCheck(_ask_room, watch.park_state, _to_stderr, watch.maybe_parked.is_set))
    return True


def _ask_room(device: Optional[int]) -> Optional[ParkAnswer]:
    from .client import QuotaClient

    client = QuotaClient.from_environment()
    return client.ask_room(device) if client is not None else None


def _to_stderr(line: str) -> None:
    """Where the project's notices to the user go (resume, wait, room made or not): the cell's stderr, so that its
    stdout is the user's own output only (saved notebooks, anything that parses it)."""
    print(line, file=sys.stderr, flush=True)


# --- room after an allocation found the GPU full (park_on_device_full) -------------------------------------


def follow_room(
    ask: Callable[[], Optional[ParkAnswer]],
    park_state: Callable[[], Optional[dict]],
    out: Callable[[str], None] = _to_stderr,
    sleep: Callable[[float], None] = time.sleep,
) -> Optional[str]:
    """Ask the server for room up to this kernel's cap (`ask`: QuotaClient.ask_room bound to a device) and say,
    under the failed cell, how it goes until the room is made or the broker gives up. Says nothing when the server
    does not make room (off, or the cap itself was the limit). The outcome: "made", "told", "waiting" or None."""
    answer = ask()
    if getattr(answer, "outcome", None) != "accepted":
        return None
    out(f"{PREFIX} the GPU was full below this kernel's cap: the broker parks idle kernels to make room")
    began = time.monotonic()
    said: Optional[str] = None
    limit: float = 300.0
    try:
        while True:
            park = park_state() or {}
            room = park.get("room")
            if isinstance(park.get("wait_limit"), (int, float)):
                limit = float(park["wait_limit"])
            if room == "made":
                out(f"{PREFIX} room made after {time.monotonic() - began:.0f} s: run the cell again")
                return "made"
            if room != "asking":
                out(f"{PREFIX} no room made: {park.get('reason') or 'the broker gave up'}")
                return "told"
            reason = park.get("reason")
            if reason and reason != said:
                out(f"{PREFIX} {reason}")
                said = reason
            if time.monotonic() - began > limit + 10:
                out(f"{PREFIX} room is still being made; run the cell again in a moment")
                return "waiting"
            sleep(POLL_S)
    except KeyboardInterrupt:
        out(f"{PREFIX} stopped following; the broker goes on making room: run the cell again in a moment")
        return "waiting"
