"""Why a kernel has no GPU, or no usage to show, in words: what `%gpucap` and the panel say instead of a
bare "no GPU". Stdlib only; reads what the kernel itself can see, and never starts CUDA.

Three different facts, each with its own reason:
- the kernel holds no GPU: the server has none (no driver, or none it may use), or the kernel started
  CPU-only because no device had budget left (on_full = "cpu-only"), or its kernelspec pins GPUs the
  server does not manage;
- the kernel holds a grant but shows no usage: its torch is built without CUDA, finds no device, or has
  not started CUDA yet (the cap applies then);
- no server started the kernel (`%load_ext gpu_quota_ext` in a plain kernel): then nobody grants caps.

The words for a fact the server also states (no driver) come from shared/reasons.py, so that `%gpucap` and
the sidebar say it the same way.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from ..shared.reasons import NO_DRIVER

# Present while the NVIDIA kernel module is loaded; kernels run on the server's machine, so what this
# kernel sees here is what the server saw.
NVIDIA_DRIVER_FILE = "/proc/driver/nvidia/version"


def no_gpu_reason(state) -> Optional[str]:
    """Why this kernel, which the server started, holds no GPU; None when it holds one (or no server
    started it). One line, beginning with the fact ("no GPU on this server", "started without a GPU")."""
    if not state.managed or state.devices:
        return None
    if state.cpu_only_reason:
        return f"this kernel started without a GPU (CPU-only): {state.cpu_only_reason}"
    if not os.path.exists(NVIDIA_DRIVER_FILE):
        return f"no GPU on this server: {NO_DRIVER} ({NVIDIA_DRIVER_FILE} is absent)"
    return (
        "no GPU on this server that it may use: NVML failed or the server's CUDA_VISIBLE_DEVICES hides "
        "every device (the server's log says which)"
    )


def usage_unavailable_reason() -> Optional[str]:
    """Why the kernel's own torch can give no allocator usage although the kernel holds a grant; None
    when it can, or when torch is simply not imported or has not started CUDA yet (usage comes then).

    torch.cuda.is_available() asks the driver for a device count and creates no context."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        version = getattr(torch, "version", None)
        if getattr(version, "cuda", None) is None and getattr(version, "hip", None) is None:
            return f"this kernel's torch {getattr(torch, '__version__', '')} is built without CUDA"
        if not torch.cuda.is_available():
            return "this kernel's torch finds no CUDA device"
    except Exception as error:  # broad: torch's own code; the reason names what it raised
        return f"this kernel's torch cannot look for a GPU: {error!r}"
    return None
