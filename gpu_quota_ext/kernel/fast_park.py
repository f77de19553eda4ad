"""The kernel's side of a fast park (docs/admin/fast-park.md): the server's requests on the control channel,
answered here in ipykernel's control thread (park_wait.ParkWatch dispatches them). Stdlib only; torch is read
only where the user has imported it, and nothing here creates a CUDA context or opens the driver in a kernel
that has not used CUDA.

    {"action": "facts"}                -> what the parker's choice of path needs (FACTS below)
    {"action": "park", "arena": bytes, "release_as_copied": bool}
                                       -> the library parks the process into its arena (made first, of that
                                          size, where the kernel has none big enough: the server reserved it);
                                          release_as_copied: each piece of device memory is given back as soon
                                          as its bytes are in the arena (a swap: another kernel's resume may
                                          take it meanwhile), instead of all of it at the end
    {"action": "resume", "keep_arena": bool, "wait_for_room": seconds}
                                       -> the library maps and copies every byte back; wait_for_room: where the
                                          device is full it waits, at most that long in all, for a park under way
                                          in another process to free memory (0, the default: it does not wait);
                                          at most half the request's "timeout" (WAIT_FOR_ROOM_SHARE: the other
                                          half is the copy's), a longer wait is cut to that
    {"action": "release"}              -> a running kernel gives back the arena it kept (the host needs it)

A park or resume answers {"code": 0 or the library's or driver's code, "message", "seconds", "bytes"}. It runs in
a thread of its own (the library's copy releases the GIL; the control thread waits for it, at most the server's
"timeout"), so a call that never returns leaves the control thread free to answer "still running". A park that
released some pieces and then failed answers E_PARTIAL with the library's message: the kernel is parked in part
(the library's state is "parked", the released pieces' bytes in the arena, the others still on the device), and a
resume brings everything back. A resume whose wait for room ran out answers the driver's out-of-memory code, every
byte still on the host and the kernel parked. A request whose release_as_copied or wait_for_room is not what it
should be (a bool; a finite number of seconds, 0 or more) is refused (E_REQUEST) before the library is called.

The library's Python wrapper (gpu_quota_ext/parking/pages/__init__.py) is the server's module, stdlib only and
made to be loaded on its own (the probe does so on the GPU machine): it is loaded here from its file, since the
kernel's side imports nothing of the server's package but shared/.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

PAGES_MODULE = Path(__file__).resolve().parents[1] / "parking" / "pages" / "__init__.py"
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either (the second from 2.8)
DEFAULT_TIMEOUT = 600.0
MAX_TIMEOUT = 86400.0  # the server's park_call_timeout is at most a day (settings.py): a longer one is cut to it
E_STATE, E_ARENA = -1, -2  # the library's codes (pages.c), for refusals made here
E_PARTIAL = -6  # the library's: a park that released some pieces, then failed: parked in part (see above)
STILL_RUNNING = -100  # the call has not returned within the server's timeout; the kernel says so and goes on
E_REQUEST = -101  # the server's request is malformed (release_as_copied, wait_for_room): refused, nothing moved
# A resume's wait for room is at most this share of the request's timeout: the rest is left to the copy itself, so
# that a wait that runs out still answers (every byte on the host) before the server's wait for the answer ends.
WAIT_FOR_ROOM_SHARE = 0.5

FACTS = (
    "preloaded",  # the library is in this process (the kernel started with it in LD_PRELOAD)
    "library_problem",  # why it serves nothing here (it could not open the driver), or None
    "torch_cuda",  # torch has made its CUDA context here
    "allocator_backend",  # torch's: "native" or "cudaMallocAsync"
    "expandable_segments",  # torch maps its own virtual memory then: the library never sees it
    "served_bytes",  # what the library maps: what a park moves
    "arena_bytes",  # the pinned arena this kernel holds now (kept from its last park), 0: none
    "state",  # the library's: "running", "parking", "parked", "resuming"; None without it
)

_module: Any = None
_pages: Any = None
_arena: Any = None
_lock = threading.Lock()  # one park or resume at a time


def _pages_module() -> Any:
    global _module
    if _module is None:
        spec = importlib.util.spec_from_file_location("gpu_quota_ext_pages", PAGES_MODULE)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        _module = module
    return _module


def pages() -> Any:
    """The library this process preloaded (its Pages wrapper), or None."""
    global _pages
    if _pages is None:
        _pages = _pages_module().Pages.in_process()
    return _pages


def _torch_cuda() -> Optional[Any]:
    torch = sys.modules.get("torch")
    try:
        return torch if torch is not None and torch.cuda.is_initialized() else None
    except Exception:  # broad: a half-imported or unusual torch: taken as not in use
        return None


def expandable_segments(environ=os.environ) -> bool:
    """torch's expandable segments, as its allocator settings in the environment turn them on."""
    for name in ALLOC_CONF:
        for part in (environ.get(name) or "").split(","):
            key, _, value = part.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return True
    return False


def facts() -> dict:
    """What this kernel says for the choice of its park's path (FACTS). Never raises."""
    torch = _torch_cuda()
    lib = pages()
    answer = {name: None for name in FACTS}
    answer.update(preloaded=lib is not None, torch_cuda=torch is not None, served_bytes=0, arena_bytes=0)
    answer["allocator_backend"] = "native"
    answer["expandable_segments"] = expandable_segments()
    if torch is not None:
        try:
            answer["allocator_backend"] = str(torch.cuda.get_allocator_backend())
        except Exception:
            pass  # a torch before 2.0 has only its native allocator
    if lib is not None:
        answer["state"] = lib.state()
        answer["arena_bytes"] = _arena.size if _arena is not None and _arena.handle else 0
        # Whether the library could open the driver is asked only once CUDA is in use here: asking opens the
        # driver (cuInit), which a kernel that never touched the GPU should not pay for.
        if torch is not None:
            if not lib.active():
                answer["library_problem"] = lib.last_error() or "it could not open the CUDA driver"
            answer["served_bytes"] = lib.mapped_bytes()
    return answer


def parked_here() -> bool:
    """The library holds this process's memory on the host (or is moving it): no GPU work may run."""
    try:
        lib = pages()
        return lib is not None and lib.state() != "running"
    except Exception:  # broad: asked before each cell; a library that cannot say is taken as running
        return False


def park(content: dict) -> dict:
    """The library parks the process into its arena; the arena is made first where there is none big enough,
    of the size the server reserved for it (never bigger: the host's account holds that much)."""
    return _in_thread(_park, content)


def resume(content: dict) -> dict:
    return _in_thread(_resume, content)


def release(content: dict) -> dict:
    """The arena kept since the last resume, given back to the host (another park or the host itself needs the
    memory more than this kernel's next park needs the pinning saved). Refused while parked: then it holds the
    kernel's memory."""
    return _in_thread(_release, content)


def _release(content: dict) -> dict:
    global _arena
    lib = pages()
    if lib is None:
        return _answer(E_STATE, "the fast park library is not in this kernel's process")
    if lib.state() != "running":
        return _answer(E_STATE, f"the kernel is {lib.state()}: its arena holds its GPU memory")
    freed = _arena.size if _arena is not None and _arena.handle else 0
    if _arena is not None:
        _arena.close()
        _arena = None
    return _answer(0, "released", nbytes=freed)


def _park(content: dict) -> dict:
    global _arena
    lib = pages()
    if lib is None:
        return _answer(E_STATE, "the fast park library is not in this kernel's process")
    release = content.get("release_as_copied")
    release = False if release is None else release  # not given (JSON's null too): as before, released at the end
    if not isinstance(release, bool):
        return _answer(E_REQUEST, f"release_as_copied must be true or false, not {release!r}")
    moved = lib.mapped_bytes()
    size = content.get("arena")
    made = 0.0
    if _arena is None or not _arena.handle or _arena.size < moved:
        if not isinstance(size, int) or size < moved:
            return _answer(
                E_ARENA,
                f"the kernel holds {moved} bytes now, more than the {size} bytes of arena reserved for it (it "
                "allocated since the server looked)",
            )
        if _arena is not None:
            _arena.close()
            _arena = None
        _arena = lib.arena(size)
        made = _arena.populate_seconds + _arena.register_seconds
    start = time.perf_counter()
    try:
        lib.park(_arena, release_as_copied=release)
    except Exception as error:  # the wrapper's PagesError: parked in part is answered here, the rest by _in_thread
        if getattr(error, "code", None) != E_PARTIAL:
            raise
        message = getattr(error, "message", None) or str(error)
        return _answer(E_PARTIAL, message, time.perf_counter() - start, moved, released_as_copied=release)
    return _answer(0, "parked", time.perf_counter() - start, moved, arena_seconds=made, released_as_copied=release)


def _resume(content: dict) -> dict:
    global _arena
    lib = pages()
    if lib is None:
        return _answer(E_STATE, "the fast park library is not in this kernel's process")
    wait, refusal = wait_for_room(content)
    if refusal is not None:
        return _answer(E_REQUEST, refusal)
    moved = lib.mapped_bytes()
    start = time.perf_counter()
    lib.resume(wait_for_room=wait)
    seconds = time.perf_counter() - start
    waited = lib.resume_waited_seconds()  # of `seconds`: the wait for a park elsewhere to free the room
    kept = content.get("keep_arena") is not False
    if not kept and _arena is not None:
        try:
            _arena.close()  # the host needs its memory more than the next park needs the pinning saved
        except Exception:  # broad: the arena's own release; the kernel is resumed all the same
            pass
        _arena = None
    return _answer(0, "resumed", seconds, moved, arena_kept=kept, waited=waited)


def wait_for_room(content: dict) -> Tuple[float, Optional[str]]:
    """A resume's wait for room, in seconds (0: none), and why the request's value is refused (or None). A bool, a
    string, NaN, an infinity or a negative number is refused; a wait longer than WAIT_FOR_ROOM_SHARE of the
    request's timeout is cut to that."""
    value = content.get("wait_for_room", 0.0)
    if value is None:
        return 0.0, None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0, f"wait_for_room must be a number of seconds, not {value!r}"
    if (isinstance(value, float) and not math.isfinite(value)) or value < 0:
        return 0.0, f"wait_for_room must be a finite number of seconds, 0 or more, not {value!r}"
    # Compared before float(): JSON's integers have no bound, and a float() of a huge one overflows.
    return float(min(value, WAIT_FOR_ROOM_SHARE * _timeout(content))), None


def _timeout(content: dict) -> float:
    """The request's timeout in seconds: the default where it is not a positive finite number, at most
    MAX_TIMEOUT (a float() of a huge JSON integer would overflow, and a thread's wait refuses one that long)."""
    timeout = content.get("timeout")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        return DEFAULT_TIMEOUT  # (NaN fails the comparison too)
    return float(min(timeout, MAX_TIMEOUT))  # compared before float(), as wait_for_room's


def _answer(code: int, message: str, seconds: Optional[float] = None, nbytes: int = 0, **more: Any) -> dict:
    answer = {"code": code, "message": message, "seconds": seconds, "bytes": nbytes}
    answer.update(more)
    return answer


def _in_thread(call: Callable[[dict], dict], content: dict) -> dict:
    """`call(content)` in a thread of its own; its answer, or "still running" after the server's timeout."""
    timeout = _timeout(content)
    result: dict = {}

    def run() -> None:
        with _lock:
            try:
                result.update(call(content))
            except Exception as error:  # the wrapper's PagesError: the library's or the driver's code
                result.update(_answer(getattr(error, "code", E_STATE), str(error)))

    worker = threading.Thread(target=run, name=f"gpu-quota-{content.get('action')}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return _answer(STILL_RUNNING, f"still running after {timeout:.0f} s")
    return dict(result)
