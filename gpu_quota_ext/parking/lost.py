"""A kernel lost while parked, in words: what its user is told once, at its next cell and in the sidebar. Pure.

A parked (or parking, waiting, resuming) kernel's process can die: the host's out-of-memory killer picks it (its
parked bytes are its resident memory), someone kills it, a restore breaks it. jupyter_server's restarter then
starts it again under the same kernel id, and without a word from us its next cell would fail with NameError for
its own variables. The parker (parker.py) makes a LostNotice when the restarter reports the death of a kernel it
held, keeps it under the kernel id (which survives the restart), gives it to the new process in its environment
at launch and on its control channel, shows it in the status's "park"."lost", and drops it once the kernel says
it has printed it at the start of a cell (kernel/lost_notice.py).
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from typing import Optional

PREFIX = "gpu-quota:"
ACTION = "lost"  # the control request's action (kernel/lost_notice.py answers it)

# What the kernel was doing when its process ended, by park state (states.HELD).
_WHILE = {
    "parking": "while it was being parked",
    "parked": "while parked",
    "waiting": "while parked (waiting for room to come back to)",
    "resuming": "while its GPU memory was coming back from host memory",
    "lost": "after its GPU memory could not be brought back",
}


@dataclass(frozen=True)
class LostNotice:
    at: float  # wall clock when the server saw the process dead
    why: str  # "its process ended while parked (killed by SIGKILL: ...)"
    words: str  # the one line its next cell says (stderr) and the sidebar shows


def death_cause(exit_code: Optional[int]) -> str:
    """How the process ended, from its exit status (Popen's: -N for signal N), in a few words."""
    if exit_code is None:
        return "the cause is not known: the host's out-of-memory killer?"
    if exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return "killed by SIGKILL: the host's out-of-memory killer, or a kill -9?"
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        return f"killed by {name}"
    return f"it exited with status {exit_code}"


def lost_notice(state: str, at: float, exit_code: Optional[int], clock: str = "") -> LostNotice:
    """The notice for a kernel whose process ended in park state `state`; `clock`: "01:23" (the server's local
    time of `at` by default)."""
    when = clock or time.strftime("%H:%M", time.localtime(at))
    why = f"its process ended {_WHILE.get(state, 'while parked')} ({death_cause(exit_code)})"
    words = (
        f"{PREFIX} this kernel was restarted at {when} because {why}; its variables and GPU memory are gone. "
        "Run the notebook's cells again."
    )
    return LostNotice(at=at, why=why, words=words)


def notice_json(notice: Optional[LostNotice]) -> Optional[dict]:
    """The status's "park"."lost": {"at", "why", "words"}, or None."""
    if notice is None:
        return None
    return {"at": notice.at, "why": notice.why, "words": notice.words}


def notice_env(notice: LostNotice) -> str:
    """The value of shared.env_vars.LOST in the restarted kernel's environment (kernel/lost_notice.py reads it)."""
    return json.dumps({"at": notice.at, "words": notice.words})


def notice_request(notice: LostNotice) -> dict:
    """The control request: the kernel keeps the words if it has not got them yet, and answers {"shown": bool}."""
    return {"action": ACTION, "at": notice.at, "words": notice.words}


def shown(answer: Optional[dict]) -> bool:
    """The kernel's answer says it printed the notice at the start of a cell."""
    return isinstance(answer, dict) and answer.get("shown") is True
