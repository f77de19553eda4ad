"""A kernel's park state in words: what `%gpucap`, `%gpucap park|resume` and the usage panel say.
Pure and stdlib only; the state itself is the server's (shared.contract.PARK_FIELDS), never kept here.

The sidebar says the same things in the same words (labextension/src/format.ts, parkWords).
"""

from __future__ import annotations

import time
from typing import Optional

from ..shared.sizes import format_bytes

PARK_ANNOUNCEMENT = (
    "This kernel parks when this cell ends: its GPU memory goes to host memory; "
    "your next cell brings it back (a few seconds)."
)
RESUME_NOTE = "rarely needed: your next cell resumes a parked kernel by itself"

# Openings that already say the server refused, so that nothing is said twice ("cannot park: not parkable: ...").
_REFUSAL_OPENINGS = ("cannot park", "cannot resume", "not parkable", "not parked", "did not park", "not resumed")


def duration_words(seconds: Optional[float], exact: bool = False) -> str:
    """40 -> "40 s", 720 -> "12 min", 7500 -> "2 h 5 min". `exact` keeps the seconds below an hour (100 ->
    "1 min 40 s"): a wait and its limit are said exactly, so that 100 s of a 100 s limit never reads "waited 1 min
    of at most 1 min". The sidebar's formatDuration (labextension/src/format.ts) says the same."""
    if seconds is None or seconds < 0:
        return ""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        minutes, rest = divmod(seconds, 60)
        return f"{minutes} min {rest} s" if exact and rest else f"{minutes} min"
    hours, minutes = divmod(seconds // 60, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def clock(since: Optional[float]) -> str:
    """Wall-clock seconds -> "14:02", in the kernel's local time; "" when unknown."""
    if not isinstance(since, (int, float)):
        return ""
    return time.strftime("%H:%M", time.localtime(since))


def state_words(park: dict) -> str:
    """One kernel's park state as a person reads it: "running", "idle for 12 min", "parked since 14:02,
    17.8 GiB on host" (with "(fast park: 612.0 MiB stays on the GPU)" where the fast path parked it),
    "resuming", "waiting for device memory for 12 s (limit 5 min): <reason>", "waited past its limit (5 min):
    ...", "lost: <what to do>". The sidebar says the same (labextension/src/format.ts)."""
    state = park.get("state")
    reason = park.get("reason")
    if state == "busy":
        return "running"
    if state == "idle":
        idle = duration_words(park.get("idle_seconds"))
        return f"idle for {idle}" if idle else "idle"
    if state == "pending":
        return "parks when its current cell ends"
    if state == "parking":
        return "parking: its GPU memory is moving to host memory"
    if state == "parked":
        words = "parked"
        since = clock(park.get("since"))
        if since:
            words += f" since {since}"
        if isinstance(park.get("host_bytes"), int):
            words += f", {format_bytes(park['host_bytes'])} on host"
        path = park.get("path")
        if isinstance(path, dict) and path.get("path") == "pages" and isinstance(path.get("stays_on_device"), int):
            # The fast park leaves the CUDA context behind: the user sees it in nvidia-smi, so it is said.
            words += f" (fast park: {format_bytes(path['stays_on_device'])} stays on the GPU)"
        return words
    if state == "resuming":
        return "resuming"
    if state == "waiting":
        wait_limit = park.get("wait_limit")
        limited = isinstance(wait_limit, (int, float)) and wait_limit > 0
        limit = duration_words(wait_limit, exact=True) if limited else ""
        if park.get("told") is True:
            passed = f"waited past its limit ({limit})" if limit else "waited past its limit"
            return f"{passed}: the cell did not run; the kernel stays parked with its grant"
        if reason and reason.lower().startswith("waiting for device memory"):
            return reason  # an older server's reason says it already
        words = "waiting for device memory"
        waited = park.get("waited")
        if isinstance(waited, (int, float)) and waited >= 1:
            words += f" for {duration_words(waited, exact=True)}"
        if limit:
            words += f" (limit {limit})"
        return f"{words}: {reason}" if reason else words
    if state == "lost":
        return f"lost: {reason}" if reason else "lost: its GPU memory could not be brought back; restart the kernel"
    return str(state or "unknown")


def not_parkable_words(reason: Optional[str]) -> str:
    """Why the kernel cannot be parked, "not parkable" said once whether or not the server's reason says it."""
    reason = " ".join((reason or "").split())
    if not reason:
        return "not parkable"
    return reason if reason.lower().startswith(_REFUSAL_OPENINGS) else f"not parkable: {reason}"


def table_line(park: Optional[dict]) -> Optional[str]:
    """`%gpucap`'s line about parking, or None when the server says nothing about it. The cell that
    asks runs, so the kernel is "busy" then: the line says whether it can park, and how."""
    if not park:
        return None
    reason = park.get("reason")
    if park.get("parkable") is False:
        return f"parking: {not_parkable_words(reason)}"
    if park.get("state") in ("busy", "idle"):
        line = "parking: possible: %gpucap park moves its GPU memory to host memory when the cell ends"
        return f"{line} (last time: {reason})" if reason else line
    return f"parking: {state_words(park)}"


def refusal_text(message: str, verb: str = "park") -> str:
    """The server's refusal as written, its refusal said once ("not parkable: MPS client", not
    "cannot park: not parkable: MPS client")."""
    message = " ".join((message or "").split())
    if message.lower().startswith(_REFUSAL_OPENINGS):
        return message
    return f"cannot {verb}: {message}" if message else f"cannot {verb}"
