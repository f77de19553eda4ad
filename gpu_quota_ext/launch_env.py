"""Pure: a grant becomes the environment a kernel starts with.

What each framework reads (measured, see docs/measurements.md):
- CUDA_VISIBLE_DEVICES: which GPUs the kernel sees (UUIDs, so the order cannot be misread);
- CUPY_GPU_MEMORY_LIMIT: bytes, CuPy's memory pool limit per device;
- XLA_PYTHON_CLIENT_MEM_FRACTION (or XLA_CLIENT_MEM_FRACTION, never both): JAX's limit, the size of its BFC
  allocator's pool, with XLA_PYTHON_CLIENT_PREALLOCATE=false so that the pool grows up to the limit as arrays
  need it instead of being taken whole at the first JAX operation;
- TF_FORCE_GPU_ALLOW_GROWTH: TensorFlow has no cap by environment; this stops it grabbing the GPU.
A kernel holds what it uses, not its cap: under overcommit the room it does not use is another kernel's, and
a park moves only what it holds (a JAX kernel with a 4 GiB array parked its whole 28 GiB cap, issue 31).
torch is capped by the bootstrap inside the kernel (gpu_quota_ext/kernel), which knows the kernel's
torch version; it reads GPU_QUOTA_DEVICES (shared/env_vars.py lists our own variables).

Values the kernelspec or the user already set are merged, never loosened: the smaller limit wins. An
inherited limit that is not a positive number (CuPy reads 0 as "no limit") is ignored, never passed on;
no framework variable is ever written as 0 (the ledger grants no cap below 1 MiB).

The kernel's secret (and the API's address) go only to kernels whose bootstrap runs: ipykernel's, for the
Python language (IPython runs PYTHONSTARTUP at start), and the bootstrap moves the secret out of the
environment. Any other kernel (bash_kernel's argv[0] is a python too) would keep it in its environment for
every child process to read, and it could not use `%gpucap` anyway; it gets its caps and nothing else.

Our own kernel-side variables (shared/env_vars.KERNEL_SIDE) are set or removed here, every one, at every
launch: none is inherited from the server's environment (`kernel_environment`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence

from .devices import Device
from .ledger import Grant
from .shared.env_vars import (
    API_URL,
    CAP_SOURCE,
    CPU_ONLY_REASON,
    DEVICES,
    KERNEL_ID,
    KERNEL_SIDE,
    TOKEN,
    USER_STARTUP,
)

STARTUP_FILE = Path(__file__).parent / "kernel" / "startup.py"
JAX_FRACTION_NAMES = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")
JAX_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"


def launch_env(
    grant: Grant,
    devices: Mapping[int, Device],
    env: Mapping[str, str],
    *,
    api_url: Optional[str] = None,
    token: Optional[str] = None,
    python_kernel: bool = True,
    hard_limit: Optional[Mapping[str, str]] = None,
) -> Dict[str, str]:
    """The variables to add to (or replace in) `env`, the kernel's environment as it stands.

    `hard_limit`: the hard layer's variables (hard_limit.decide: MPS limit and pipe directory), added last."""
    out: Dict[str, str] = {KERNEL_ID: grant.kernel_id}
    if python_kernel and api_url:
        out[API_URL] = api_url
    if python_kernel and token:
        out[TOKEN] = token

    if grant.placed:
        # An empty CUDA_VISIBLE_DEVICES hides every GPU: that is what "cpu-only" means.
        out["CUDA_VISIBLE_DEVICES"] = ",".join(devices[i].cuda_id for i in grant.devices)
    if grant.cpu_only_reason:
        out[CPU_ONLY_REASON] = grant.cpu_only_reason
    if grant.devices:
        out[CAP_SOURCE] = grant.source
        granted = [devices[i] for i in grant.devices]
        out[DEVICES] = json.dumps(
            [
                {
                    "ordinal": ordinal,
                    "index": d.index,
                    "uuid": d.uuid,
                    "cap": grant.caps[d.index],
                    "max_cap": grant.max_caps[d.index],
                    "total": d.total,
                }
                for ordinal, d in enumerate(granted)
            ],
            separators=(",", ":"),
        )
        if not grant.placed:
            # The kernel sees the server's devices; make CUDA number them the way NVML (and we) do.
            out.setdefault("CUDA_DEVICE_ORDER", env.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID"))
        # One value per variable, so a kernel on several devices gets the tightest of its caps.
        smallest_cap = min(grant.caps[d.index] for d in granted)
        smallest_fraction = min(grant.caps[d.index] / d.total for d in granted)
        out["CUPY_GPU_MEMORY_LIMIT"] = str(_tighter_bytes(env.get("CUPY_GPU_MEMORY_LIMIT"), smallest_cap))
        fraction = _fraction_text(smallest_fraction)
        # JAX reads one of two names; JAX 0.11 falls back to the CPU when both are set (measured on an
        # H200, 2026-11-29). Every JAX we measured reads the older one, so that is ours, unless the
        # user already chose the newer one: then we tighten theirs and add nothing.
        for name in [n for n in JAX_FRACTION_NAMES if n in env] or [JAX_FRACTION_NAMES[0]]:
            out[name] = _tighter_fraction(env.get(name), fraction)
        # Grow, never preallocate (JAX: the fraction above still bounds the pool, XLA's gpu_helpers sizes the
        # BFC allocator total x fraction either way). A choice the kernelspec or the server's environment made
        # is kept: preallocation trades held memory for speed, and it never lifts the cap.
        out[JAX_PREALLOCATE] = env.get(JAX_PREALLOCATE, "false")
        out["TF_FORCE_GPU_ALLOW_GROWTH"] = env.get("TF_FORCE_GPU_ALLOW_GROWTH", "true")

    if python_kernel:
        # ipykernel runs PYTHONSTARTUP at start; ours applies the torch cap and then runs the user's own.
        user_startup = env.get("PYTHONSTARTUP")
        if user_startup and Path(user_startup) != STARTUP_FILE:
            out[USER_STARTUP] = user_startup
        elif user_startup and env.get(USER_STARTUP):
            # A server started inside one of our kernels: the user's own startup is what that kernel chained.
            out[USER_STARTUP] = env[USER_STARTUP]
        out["PYTHONSTARTUP"] = str(STARTUP_FILE)
    out.update(hard_limit or {})
    return out


def preload(env: Mapping[str, str], library: str) -> Dict[str, str]:
    """LD_PRELOAD with the fast park library first (fast_park on, Python kernels only: docs/admin/fast-park.md),
    what the kernelspec or the server's environment preloads kept after it. First: the dynamic linker binds
    torch's cudaMalloc to the first library that defines it."""
    kept = [part for part in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if part and part != library]
    return {"LD_PRELOAD": ":".join([library, *kept])}


def kernel_environment(env: Mapping[str, str], variables: Mapping[str, str]) -> Dict[str, str]:
    """The kernel's whole environment: `env` (the kernelspec's merged into the server's) with `variables`
    (launch_env's), and without any other kernel-side variable of ours: a GPU_QUOTA_LAYERS, a CPU-only
    reason or a secret the server's own environment carries is no statement about this kernel."""
    kept = {name: value for name, value in env.items() if name not in KERNEL_SIDE}
    kept.update(variables)
    return kept


def _fraction_text(fraction: float) -> str:
    # Round down so the written fraction never allows more than the cap; the tiny epsilon keeps a cap
    # of int(0.2 x total) bytes reading "0.2000" rather than "0.1999" (it is worth a few bytes).
    # A small cap on a big device (1 MiB of 80 GiB) takes more places: never write "0.0000".
    for places in range(4, 13):
        scale = 10**places
        rounded = int(fraction * scale + 1e-6) / scale
        if rounded > 0:
            return f"{rounded:.{places}f}"
    return f"{fraction:.12e}"  # pragma: no cover - below 1e-12 of a device: no cap is that small


def _tighter_bytes(existing: Optional[str], cap: int) -> int:
    """CuPy accepts bytes or "N%"; a percentage set by the user is kept out of the comparison (kept as ours),
    and so is anything that is not a positive number of bytes (CuPy reads 0 as "no limit")."""
    if existing and existing.strip().isdigit() and int(existing.strip()) > 0:
        return min(int(existing.strip()), cap)
    return cap


def _tighter_fraction(existing: Optional[str], ours: str) -> str:
    """The user's own fraction when it is tighter than ours and a real one (above 0: JAX would take 0
    literally); anything else, ours."""
    try:
        if existing is not None and 0 < float(existing) < float(ours):
            return existing
    except ValueError:
        pass
    return ours


def is_python_kernel(argv: Sequence[str], language: Optional[str]) -> bool:
    """Whether the bootstrap runs in the kernel: the kernelspec's language is Python (bash_kernel, whose argv[0]
    is a python, says "bash") and it runs ipykernel (`-m ipykernel_launcher`, or a python launcher)."""
    if (language or "").strip().lower() != "python" or not argv:
        return False
    program = Path(str(argv[0])).name.lower()
    joined = " ".join(str(a) for a in argv).lower()
    return program.startswith("python") or "ipykernel" in joined
