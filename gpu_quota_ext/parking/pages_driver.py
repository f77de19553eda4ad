"""The fast park path as a CheckpointDriver (checkpoint.py's interface), so that the parker parks and resumes a
kernel the same way whichever path it takes (parker.park_processes, resume_processes): here the kernel's own
process does the work, through the fast park library it preloaded (kernel/fast_park.py answers on the kernel's
control channel), instead of the driver's checkpoint calls from the server.

    lock, unlock   nothing: the parker parks only idle kernels, and the library waits for the device's work
                   itself (cuCtxSynchronize) before it copies anything
    checkpoint     {"action": "park", "arena": bytes, "release_as_copied": bool}: the kernel makes its arena
                   (reserved in the host's account first) where it has none big enough, then the library parks,
                   giving each piece of device memory back as soon as it is copied (release_as_copied)
    restore        {"action": "resume", "keep_arena": bool, "wait_for_room": seconds}: where the device is
                   full, the library waits that long at most for a park under way to free memory (a swap)
    state          {"action": "facts"}: the library's state (CHECKPOINTED while parked)

One driver per park or resume of one kernel (it knows the kernel, the arena and the answers' seconds). Its calls
block (they run in the parker's threads, as the checkpoint driver's do); `ask` is the kernel channel called from
such a thread (`threadsafe_ask`). A failure raises CheckpointError with the library's code (a positive one is the
driver's CUresult: CUDA_ERROR_OUT_OF_MEMORY, 2, for a resume that found no room, or whose wait for room ran out),
the kernel as it was: a park that failed released nothing, a resume that failed keeps every byte on the host and
the kernel parked. One failure is not raised: a park that released some pieces and then failed (E_PARTIAL, only
with release_as_copied) has left the kernel parked in part, some bytes on the host and the rest on the device, and
the library runs no GPU work of the kernel's until a resume: it is parked (a warning says what happened), and its
resume brings everything back. Taken as a failed park, it would be shown running and hang at its next cell. The
same holds for any failed park after which the library says it is parked (one whose last pieces would not unmap).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Callable, Optional

import psutil

from .checkpoint import (
    CHECKPOINTED,
    CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_TIMEOUT,
    DRIVER_RUNNING,
    CheckpointDriver,
    CheckpointError,
)
from .kernel_channel import KernelChannel

log = logging.getLogger("gpu_quota_ext")

Ask = Callable[[dict, float], Optional[dict]]  # (content, timeout) -> the kernel's answer, None: no answer

E_PARTIAL = -6  # the library's: a park that released some pieces, then failed: parked in part
STILL_RUNNING = -100  # kernel/fast_park.py: the call had not returned when the kernel's wait ended
E_REQUEST = -101  # kernel/fast_park.py: the request was malformed, refused before the library was called
CODE_NAMES = {
    -1: "state", -2: "arena", -3: "driver", -4: "host memory", -5: "no context", E_PARTIAL: "parked in part",
    STILL_RUNNING: "still running", E_REQUEST: "request", 2: "CUDA_ERROR_OUT_OF_MEMORY",
}


def threadsafe_ask(channel: KernelChannel, kernel_id: str, loop: asyncio.AbstractEventLoop) -> Ask:
    """The kernel channel's `ask`, callable from a thread: the request runs on the server's event loop."""

    def ask(content: dict, timeout: float) -> Optional[dict]:
        future = asyncio.run_coroutine_threadsafe(channel.ask(kernel_id, content, timeout), loop)
        try:
            return future.result(timeout + 5.0)
        except Exception as error:  # broad: a timeout, a loop that stopped, or the ask's own bug: no answer
            log.debug("gpu-quota-ext: kernel %s: no answer on the control channel: %r", kernel_id, error)
            future.cancel()
            return None

    return ask


class PagesDriver(CheckpointDriver):
    """One kernel's fast park or resume, through its control channel."""

    def __init__(
        self,
        ask: Ask,
        arena: int = 0,
        keep_arena: bool = True,
        timeout: float = 600.0,
        release_as_copied: bool = True,
        wait_for_room: float = 0.0,
    ):
        self.ask = ask
        self.arena = arena  # the arena's size, reserved in the host's account, for a kernel that has none
        self.keep_arena = keep_arena  # after a resume (path.keep_arena)
        self.timeout = timeout  # seconds the kernel's park or resume may take before it answers "still running"
        self.release_as_copied = release_as_copied  # a park gives each piece back as it is copied
        self.wait_for_room = wait_for_room  # seconds a resume may wait for a park under way to free memory
        self.seconds: Optional[float] = None  # the library's copy, as the kernel timed it (the last call)
        self.waited: Optional[float] = None  # of a resume's seconds, its wait for a park under way to free room
        self.answers: list = []

    def open(self) -> None:
        pass

    def lock(self, pid: int, timeout_ms: int) -> None:
        pass

    def unlock(self, pid: int) -> None:
        pass

    def checkpoint(self, pid: int) -> None:
        content = {
            "action": "park",
            "arena": int(self.arena),
            "release_as_copied": bool(self.release_as_copied),
            "timeout": self.timeout,
        }
        answer = self._call("park", pid, content)
        code = None if answer is None else answer.get("code")
        # Not a success, yet the library holds the kernel parked: parked in part (E_PARTIAL says so itself), a piece
        # that would not unmap after every byte was copied, or an answer that was lost. It runs none of the kernel's
        # GPU work until a resume, which brings everything back: parked (taken as failed, it would hang its next cell).
        if code != 0 and (code == E_PARTIAL or self._library_state(pid) == "parked"):
            if answer is not None:
                log.warning(
                    "gpu-quota-ext: process %s is parked although its park answered %s (%s); it counts as parked, "
                    "and its resume brings everything back", pid,
                    CODE_NAMES.get(code, f"code {code}") if isinstance(code, int) else f"code {code!r}",
                    answer.get("message") or "no message",
                )
            return
        self._check("park", pid, answer)

    def restore(self, pid: int) -> None:
        content = {
            "action": "resume",
            "keep_arena": bool(self.keep_arena),
            "wait_for_room": float(self.wait_for_room),
            "timeout": self.timeout,
        }
        answer = self._call("resume", pid, content)
        if answer is None and self._library_state(pid) == "running":
            return
        self._check("resume", pid, answer)

    def state(self, pid: int) -> int:
        """CHECKPOINTED while the library holds the process's memory on the host (or is moving it: a resume then
        answers the library's own refusal), DRIVER_RUNNING once it is back."""
        state = self._library_state(pid)
        if state is None:
            raise CheckpointError("facts", pid, CUDA_ERROR_TIMEOUT, "no answer from the kernel")
        return DRIVER_RUNNING if state == "running" else CHECKPOINTED

    def _call(self, action: str, pid: int, content: dict) -> Optional[dict]:
        if not psutil.pid_exists(pid):
            raise CheckpointError(action, pid, CUDA_ERROR_NOT_FOUND)
        answer = self.ask(content, self.timeout + 5.0)
        self.answers.append((action, answer))
        if isinstance(answer, dict):
            self.seconds = _seconds(answer.get("seconds"))
            # The kernel's process says it: shown only as a share of its own seconds, never trusted further.
            waited = _seconds(answer.get("waited"))
            self.waited = None if waited is None or self.seconds is None else min(waited, self.seconds)
        return answer if isinstance(answer, dict) else None

    def _library_state(self, pid: int) -> Optional[str]:
        if not psutil.pid_exists(pid):
            raise CheckpointError("facts", pid, CUDA_ERROR_NOT_FOUND)
        answer = self.ask({"action": "facts"}, 10.0)
        state = answer.get("state") if isinstance(answer, dict) else None
        return state if isinstance(state, str) else None

    @staticmethod
    def _check(action: str, pid: int, answer: Optional[dict]) -> None:
        if answer is None:
            raise CheckpointError(action, pid, CUDA_ERROR_TIMEOUT, "no answer from the kernel")
        code = answer.get("code")
        if code == 0:
            return
        code = code if isinstance(code, int) else -1
        message = str(answer.get("message") or answer.get("error") or "no message")
        name = str(CODE_NAMES.get(code, f"code {code}"))
        raise CheckpointError(f"the fast {action}", pid, code, message if name in message else f"{name}: {message}")


def _seconds(value: object) -> Optional[float]:
    """A duration from the kernel's answer: a finite number, 0 or more; None otherwise (a bool is no number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    # Compared before float(): JSON's integers have no bound, and a float() of a huge one raises OverflowError.
    return float(value) if 0 <= value <= sys.float_info.max else None
