"""Reasons in plain words: a raw detail (a driver's error text, a dlopen failure, a long explanation) as the
few words a person reads first, the detail kept for whoever wants it (a tooltip, a log, `%gpucap`).

One place for the wording that the server's status answer (each `reasons` pair) and the kernel's `%gpucap`
(kernel/reasons.py) both use, so that the sidebar and the notebook say the same thing. Standard library
only, no I/O: `short_reason` only reads the text it is given.
"""

from __future__ import annotations

import functools
import re
from typing import Dict, Optional, Pattern, Tuple

# The facts, worded once.
NO_DRIVER = "no NVIDIA driver is loaded on this machine"
DRIVER_NOT_LOADED = "the NVIDIA driver is installed but not loaded"
NO_PERMISSION = "this user may not open the GPU devices"
NO_PYNVML = "nvidia-ml-py is not installed on the server"
NO_CHECKPOINT_API = "this NVIDIA driver cannot park kernels (no checkpoint API; a newer driver has it)"
CUDA_DID_NOT_START = "the CUDA driver did not start"
MPS_CLIENT = "an MPS client cannot be parked"
OTHER_USER = "a process of the kernel belongs to another Unix user"
MONITOR_STALLED = "the GPU driver has not answered for a while"
# A lost kernel (its restore failed): what is gone and what the user can still do, before the driver's words.
RESTORE_FAILED = "its GPU memory could not be brought back: save what is in host memory, then restart the kernel"

MAX_WORDS_CHARS = 100  # the most a short reason says; the detail has the rest

# (what the detail says, the words for it), the first match wins. Patterns name the driver's own terms,
# so that a new wording of ours around them still matches.
_RULES: Tuple[Tuple[Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.I), words)
    for pattern, words in (
        (r"NVMLError_LibraryNotFound|NVML Shared Library Not Found|libnvidia-ml\.so", NO_DRIVER),
        (r"libcuda\.so[.\d]* cannot be loaded|libcuda\.so[.\d]*: cannot open shared object", NO_DRIVER),
        (r"NVMLError_DriverNotLoaded|Driver Not Loaded", DRIVER_NOT_LOADED),
        (r"NVMLError_NoPermission|Insufficient Permissions", NO_PERMISSION),
        (r"pynvml\)? is not installed|nvidia-ml-py.* not installed", NO_PYNVML),
        (r"has no checkpoint API", NO_CHECKPOINT_API),
        (r"cuInit\(0\) returned", CUDA_DID_NOT_START),
        (r"MPS client", MPS_CLIENT),
        (r"belongs to another Unix user|refuses another Unix user", OTHER_USER),
        # Before the lost GPU's rules: a lost kernel's reason says "what was on the GPU is lost" too.
        (r"could not be brought back", RESTORE_FAILED),
        (r"(GPU \d+) unreadable: .*(GpuIsLost|GPU is lost)", r"\1 is lost (off the bus or being reset)"),
        (r"GpuIsLost|GPU is lost", "a GPU is lost (off the bus or being reset)"),
        (r"an NVML call has not returned", MONITOR_STALLED),
        (r"^this kernel holds no GPU memory$", "it holds no GPU memory"),
        (r"^what it holds on (GPU \d+(, GPU \d+)*) is unknown", r"its usage on \1 is unknown"),
    )
)

_PARENTHESES = re.compile(r"\s*\([^()]*\)")


def short_reason(detail: Optional[str]) -> Optional[str]:
    """The few words for `detail`: a known driver problem in plain words, else the detail's first clause
    without its parenthesized technical parts, at most MAX_WORDS_CHARS characters. None for no detail."""
    if detail is None:
        return None
    return _said(str(detail))[0]


def reason_pair(detail: Optional[str]) -> Optional[Dict[str, str]]:
    """A status answer's `{"reason": short words, "detail": the raw text}` (contract.REASON_FIELDS), or
    None when there is nothing to explain."""
    if detail is None:
        return None
    words, text = _said(str(detail))
    return None if words is None else {"reason": words, "detail": text}


# The status answer asks for every kernel's reasons at every poll, and they are mostly the same few texts.
@functools.lru_cache(maxsize=512)
def _said(detail: str) -> Tuple[Optional[str], str]:
    """(the few words, the detail on one line)."""
    text = " ".join(detail.split())
    if not text:
        return None, text
    for pattern, words in _RULES:
        match = pattern.search(text)
        if match:
            return match.expand(words), text
    words = _PARENTHESES.sub("", _PARENTHESES.sub("", text))  # twice: one level of nesting
    words = words.split("; ")[0].strip().rstrip(".,:;") or text
    if len(words) > MAX_WORDS_CHARS:
        words = words[: MAX_WORDS_CHARS - 1].rstrip() + "…"
    return words, text
