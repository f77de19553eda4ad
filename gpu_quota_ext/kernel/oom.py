"""One line after a torch out-of-memory error saying which wall was hit: the kernel's cap or the device.

The original exception and its traceback are left exactly as they are; the line comes from a
post_run_cell hook, after IPython has shown the traceback. Stdlib only.

torch's OOM text names the device ("GPU 0 has a total capacity of ...") and contains "allowed;" only
when a per-process cap is set (measured, docs/measurements.md): with it the cap was hit, without it the device
itself ran out (other processes hold the rest). The cudaMallocAsync backend words its error differently
and is read as "device full".
"""

from __future__ import annotations

import re
import sys
from typing import Dict, Optional

from ..shared.sizes import format_bytes

PREFIX = "gpu-quota:"
_DEVICE_RE = re.compile(r"GPU (\d+) has a total capacity")
_ALLOWED_RE = re.compile(r"([0-9.]+ [KMGT]?i?B) allowed;")


def is_torch_oom(error: BaseException) -> bool:
    """torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class), without importing torch."""
    torch = sys.modules.get("torch")
    oom_class = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom_class is not None and isinstance(error, oom_class)


def explain_oom(message: str, caps: Dict[int, int], reserved: Dict[int, int]) -> str:
    """The one line for an OOM whose text is `message`. caps / reserved: bytes by torch ordinal."""
    match = _DEVICE_RE.search(message)
    ordinal = int(match.group(1)) if match else None
    cap = caps.get(ordinal) if ordinal is not None else None
    held = reserved.get(ordinal) if ordinal is not None else None
    where = f"cuda:{ordinal}" if ordinal is not None else "the GPU"
    if "allowed;" in message:
        allowed = format_bytes(cap) if cap is not None else _torch_figure(message) or "the cap"
        held_text = f"{format_bytes(held)} reserved" if held is not None else "the cap is used up"
        return (
            f"{PREFIX} {allowed} allowed by your GPU quota on {where}; {held_text}; "
            "`%gpucap` shows details, `torch.cuda.empty_cache()` or freeing tensors helps"
        )
    cap_text = f" (your quota there is {format_bytes(cap)})" if cap is not None else ""
    return (
        f"{PREFIX} {where} itself is full: other processes hold the rest of its memory{cap_text}; "
        "your quota was not the limit; `%gpucap` shows details"
    )


def _torch_figure(message: str) -> Optional[str]:
    match = _ALLOWED_RE.search(message)
    return match.group(1) if match else None


def explain_after_cell(result, state, stream=None) -> Optional[str]:
    """post_run_cell hook body: print the line when the cell ended in a torch OOM. Never raises."""
    try:
        error = getattr(result, "error_in_exec", None)
        if error is None or not is_torch_oom(error):
            return None
        from .usage import read_usage

        caps = {d.ordinal: d.cap for d in state.devices}
        reserved = {o: u.reserved for o, u in read_usage().items()}
        line = explain_oom(str(error), caps, reserved)
        print(line, file=stream or sys.stderr, flush=True)
        if "allowed;" not in str(error):  # the device was full, not the cap: room can be made, where it is on
            ask_for_room(str(error), state, stream)
        return line
    except Exception:
        return None


def ask_for_room(message: str, state, stream=None) -> None:
    """Ask the server to park idle kernels so that this kernel gets its cap (park_on_device_full), and follow."""
    from .client import QuotaClient
    from .park_wait import follow_room

    client = QuotaClient.from_environment()
    if client is None:
        return
    match = _DEVICE_RE.search(message)
    ordinal = int(match.group(1)) if match else None
    device = next((d.index for d in state.devices if d.ordinal == ordinal), None)
    follow_room(
        lambda: client.ask_room(device),
        client.park_state,
        lambda line: print(line, file=stream or sys.stderr, flush=True),
    )
