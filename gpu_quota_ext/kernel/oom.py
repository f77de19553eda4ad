"""One line after a torch out-of-memory error saying which wall was hit, the kernel's cap or the device, decided
by numbers; and, when the device was the wall, the ask for room (park_on_device_full).

The original exception and its traceback are left exactly as they are; the line comes from a post_run_cell
hook, after IPython has shown the traceback. Stdlib only.

Which wall is a matter of numbers, never of torch's wording: once a per-process fraction is set, torch writes
"… allowed;" in every out-of-memory message, whether the cap or the device refused (measured on an H200,
docs/measurements.md). torch's caching allocator refuses at the cap when what it reserves plus the request
(rounded as it says "Tried to allocate …") passes the cap; it has emptied its cache and retried before it raises,
so what it reserves when the error reaches the cell is what counted. So: reserved + request > cap is the cap;
anything else is the device (other processes hold the rest). The message gives the request, the device's free
bytes and torch's own figure for the cap; the kernel's cap record and the allocator's reading give the rest.
The cudaMallocAsync backend words its error differently: without a request in it, a kernel with a cap that
reserves at least the cap is read as the cap, else as the device.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Dict, Optional

from ..shared.sizes import format_bytes

PREFIX = "gpu-quota:"
CAP, DEVICE = "cap", "device"
_SIZE = r"([0-9.]+) (bytes|KiB|MiB|GiB|TiB)"
_DEVICE_RE = re.compile(r"GPU (\d+) has a total capacity")
_REQUEST_RE = re.compile(r"Tried to allocate " + _SIZE)
_FREE_RE = re.compile(r"of which " + _SIZE + " is free")
_ALLOWED_RE = re.compile(_SIZE + " allowed;")
_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


@dataclass(frozen=True)
class OomFacts:
    """What torch's message says, in bytes (None where it does not say)."""

    ordinal: Optional[int] = None
    request: Optional[int] = None
    free: Optional[int] = None  # the device's free memory when torch gave up
    allowed: Optional[int] = None  # torch's cap, when a per-process fraction is set


def read_oom(message: str) -> OomFacts:
    """The numbers of a torch out-of-memory message."""
    device = _DEVICE_RE.search(message)
    return OomFacts(
        ordinal=int(device.group(1)) if device else None,
        request=_size(_REQUEST_RE.search(message)),
        free=_size(_FREE_RE.search(message)),
        allowed=_size(_ALLOWED_RE.search(message)),
    )


def _size(match: Optional["re.Match[str]"]) -> Optional[int]:
    if match is None:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def which_wall(request: Optional[int], cap: Optional[int], reserved: Optional[int]) -> str:
    """CAP when the kernel's cap refused the allocation, DEVICE when the device had no room for it. Pure. An
    unknown reading counts as nothing reserved (torch raised, so its allocator is up: it is unknown only where
    CUDA itself is not, as in a test); an unknown request leaves the cap to blame where the kernel has one."""
    if cap is None:
        return DEVICE
    if request is None:
        return CAP if reserved is None or reserved >= cap else DEVICE
    return CAP if (reserved or 0) + request > cap else DEVICE


def is_torch_oom(error: BaseException) -> bool:
    """torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class), without importing torch."""
    torch = sys.modules.get("torch")
    oom_class = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom_class is not None and isinstance(error, oom_class)


def explain_oom(message: str, caps: Dict[int, int], reserved: Dict[int, int]) -> str:
    """The one line for an OOM whose text is `message`. caps / reserved: bytes by torch ordinal."""
    return _explain(read_oom(message), caps, reserved)[1]


def _explain(facts: OomFacts, caps: Dict[int, int], reserved: Dict[int, int]):
    ordinal = facts.ordinal
    cap = caps.get(ordinal) if ordinal is not None else None
    if cap is None:
        cap = facts.allowed
    held = reserved.get(ordinal) if ordinal is not None else None
    where = f"cuda:{ordinal}" if ordinal is not None else "the GPU"
    asked = f"{format_bytes(facts.request)} more" if facts.request is not None else ""
    wall = which_wall(facts.request, cap, held)
    if wall == CAP:
        if held is not None:
            what = f"this kernel reserves {format_bytes(held)}" + (f" and asked for {asked}" if asked else "")
        else:
            what = f"{asked} was asked for" if asked else "it is used up"
        return wall, (
            f"{PREFIX} your GPU quota on {where} was the limit: {format_bytes(cap or 0)} allowed, {what}; "
            "`%gpucap` shows details, `torch.cuda.empty_cache()` or freeing tensors helps"
        )
    free = f"{format_bytes(facts.free)} free" if facts.free is not None else "no room"
    request = f" for {asked}" if asked else ""
    quota = ""
    if cap is not None:
        within = f", {format_bytes(held)} of it reserved" if held is not None else ""
        quota = f"; your quota there is {format_bytes(cap)}{within}: the quota was not the limit"
    return wall, (
        f"{PREFIX} {where} itself is full ({free}{request}): other processes hold the rest of its memory{quota}; "
        "`%gpucap` shows details"
    )


def explain_after_cell(result, state, stream=None) -> Optional[str]:
    """post_run_cell hook body: print the line when the cell ended in a torch OOM, and ask for room when the
    device was the wall. Never raises."""
    try:
        error = getattr(result, "error_in_exec", None)
        if error is None or not is_torch_oom(error):
            return None
        from .usage import read_usage

        caps = {d.ordinal: d.cap for d in state.devices}
        reserved = {o: u.reserved for o, u in read_usage().items()}
        facts = read_oom(str(error))
        wall, line = _explain(facts, caps, reserved)
        print(line, file=stream or sys.stderr, flush=True)
        if wall == DEVICE:  # room can be made, where the server does so
            ask_for_room(facts.ordinal, state, stream)
        return line
    except Exception:  # broad: explaining must never replace the user's own out-of-memory traceback
        return None


def ask_for_room(ordinal: Optional[int], state, stream=None) -> None:
    """Ask the server to park idle kernels so that this kernel gets its cap (park_on_device_full), and follow."""
    from .client import QuotaClient
    from .park_wait import follow_room

    client = QuotaClient.from_environment()
    if client is None:
        return
    device = next((d.index for d in state.devices if d.ordinal == ordinal), None)
    follow_room(
        lambda: client.ask_room(device),
        client.park_state,
        lambda line: print(line, file=stream or sys.stderr, flush=True),
    )
