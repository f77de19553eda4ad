"""A kernel restarted because its process ended while parked, seen from the new process: its next cell says so,
once, on stderr, before any of its code runs (IPython's pre_run_cell), so that a NameError for its own variables
is never the first news. Stdlib only.

The words are the server's (parking/lost.py). They come in the kernel's environment at launch (shared.env_vars.LOST:
the restart is the server's own, so the notice is there before the first cell can run), and on the control channel
({"action": "lost", "at", "words"}), which the server also uses to ask whether they have been said: the answer
{"shown": true} lets it drop the notice from the status and the sidebar.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, MutableMapping, Optional, Tuple

from ..shared.env_vars import LOST

if TYPE_CHECKING:  # for the signature only: a kernel imports nothing heavy at its start
    from IPython.core.interactiveshell import InteractiveShell

ACTION = "lost"  # the server's control request (parking/lost.py sends it)

# (at, words) waiting for the next cell; set in the shell thread (environment) or the control thread (request), read
# and cleared in the shell thread: one tuple, assigned whole.
PENDING: Optional[Tuple[float, str]] = None
SHOWN_AT: Optional[float] = None  # the `at` of the notice the last cell said


def _notice(value: Any) -> Optional[Tuple[float, str]]:
    if not isinstance(value, dict):
        return None
    at, words = value.get("at"), value.get("words")
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not isinstance(words, str) or not words.strip():
        return None
    return float(at), words


def from_environment(env: MutableMapping[str, str] = os.environ) -> None:
    """Take the notice the launch gave this process (and take it out of the environment: child processes and
    `!env` do not need it, and a kernel started from this one is not the one that was lost)."""
    global PENDING
    raw = env.pop(LOST, None)
    if not raw:
        return
    try:
        notice = _notice(json.loads(raw))
    except ValueError:
        notice = None
    if notice is not None and notice[0] != SHOWN_AT:
        PENDING = notice


def on_request(content: dict) -> dict:
    """The server's "lost" request (control thread): keep the words unless said already; say whether they were."""
    global PENDING
    notice = _notice(content)
    if notice is None:
        return {"error": "lost needs at (a number) and words (text)"}
    if notice[0] != SHOWN_AT and PENDING is None:
        PENDING = notice
    return {"shown": SHOWN_AT == notice[0]}


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def say_once(out: Callable[[str], None] = _to_stderr) -> Optional[str]:
    """The pre_run_cell hook: the notice, once, on the cell's stderr (never mixed with its stdout). The words said."""
    global PENDING, SHOWN_AT
    notice = PENDING
    if notice is None:  # the whole cost of every other cell
        return None
    PENDING = None
    SHOWN_AT = notice[0]
    out(notice[1])
    return notice[1]


def install(shell: InteractiveShell) -> None:
    from_environment()
    shell.events.register("pre_run_cell", lambda info=None: say_once())
