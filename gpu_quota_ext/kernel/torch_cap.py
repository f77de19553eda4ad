"""Applying caps to torch inside a kernel, without creating a CUDA context: the one module that does.

Two routes, both lazy (measured on an H200, see docs/measurements.md):
- torch >= 2.10 reads `per_process_memory_fraction:F` from PYTORCH_CUDA_ALLOC_CONF when CUDA starts.
  Child processes (DataLoader workers, subprocesses) inherit it. Older torch fails on the unknown key,
  so it is only written when the installed torch is known to read it.
- For every torch: when `torch` is imported, `torch.cuda._lazy_call` queues a call that runs at CUDA's
  first initialisation and sets each device's exact fraction from torch's own `total_memory`
  (NVML's total is about 615 MiB larger, so a fraction computed from it would be slightly off).
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.util
import os
import re
import sys
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

if TYPE_CHECKING:  # the record is passed in; this module reads it and never imports state at run time
    from .state import KernelCapState

FRACTION_KEY = "per_process_memory_fraction"


def parse_version(text: str) -> Optional[tuple]:
    """"2.11.0+cu130" -> (2, 11); anything unreadable -> None."""
    match = re.match(r"^\s*(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def reads_fraction_from_alloc_conf(version: Optional[str]) -> bool:
    parsed = parse_version(version or "")
    return parsed is not None and parsed >= (2, 10)


def alloc_conf_variable(env) -> str:
    """torch >= 2.9 prefers PYTORCH_ALLOC_CONF when it is set; otherwise the CUDA-specific name."""
    return "PYTORCH_ALLOC_CONF" if env.get("PYTORCH_ALLOC_CONF") else "PYTORCH_CUDA_ALLOC_CONF"


def merge_alloc_conf(existing: Optional[str], fraction: float, tighten_only: bool = True) -> str:
    """Add (or tighten) per_process_memory_fraction in an allocator config, keeping every other option.

    A smaller fraction the user set stays; a larger one is lowered to the cap. With tighten_only=False
    (a cap the server just granted through %gpucap) the fraction is replaced, so a raised cap is inherited too.
    """
    options: List[str] = []
    for part in (existing or "").split(","):
        part = part.strip()
        if not part:
            continue
        key, _, value = part.partition(":")
        if key.strip() == FRACTION_KEY:
            if tighten_only:
                try:
                    fraction = min(fraction, float(value))
                except ValueError:
                    pass
            continue
        options.append(part)
    options.append(f"{FRACTION_KEY}:{_floor(fraction)}")
    return ",".join(options)


def _floor(fraction: float) -> str:
    # Written with 6 decimals, rounded down so the written value never allows more than the cap.
    return f"{int(max(fraction, 0.0) * 1_000_000) / 1_000_000:.6f}"


def installed_torch_version() -> Optional[str]:
    """The installed torch's version without importing torch (import costs seconds and memory)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    site = os.path.dirname(list(spec.submodule_search_locations)[0])
    for path in glob.glob(os.path.join(site, "torch-*.dist-info")):
        match = re.match(r"torch-([^-]+)\.dist-info$", os.path.basename(path))
        if match:
            return match.group(1)
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # broad: a broken install's metadata; the version is only shown
        return None


def apply_exact_caps(torch, caps_by_ordinal: Sequence[int]) -> List[float]:
    """Set each visible device's fraction from torch's own total. Runs inside CUDA's lazy init."""
    fractions = []
    for ordinal, cap in enumerate(caps_by_ordinal):
        if ordinal >= torch.cuda.device_count():
            break
        total = torch.cuda.get_device_properties(ordinal).total_memory
        fraction = min(1.0, cap / total)
        torch.cuda.set_per_process_memory_fraction(fraction, ordinal)
        fractions.append(fraction)
    return fractions


def apply_current_caps(torch, state) -> List[float]:
    """Apply the caps `state` (kernel/state.py) holds *now*. The lazy hook calls this at CUDA's first use,
    so a %gpucap change made before then is the one applied, not the cap the kernel started with."""
    if state.devices:
        return apply_exact_caps(torch, state.caps_by_ordinal())
    if state.local_caps:
        return apply_local_caps(torch, state.local_caps)
    return []


def apply_local_caps(torch, local_caps) -> List[float]:
    """Kernels no server started: caps the user set with %gpucap (CapSpec per ordinal, None = every device)."""
    fractions = []
    for ordinal in range(torch.cuda.device_count()):
        spec = local_caps.get(ordinal, local_caps.get(None))
        if spec is None:
            continue
        total = torch.cuda.get_device_properties(ordinal).total_memory
        fraction = min(1.0, spec.to_bytes(total) / total)
        torch.cuda.set_per_process_memory_fraction(fraction, ordinal)
        fractions.append(fraction)
    return fractions


def cuda_torch():
    """The kernel's torch module when it is imported AND CUDA is initialized; else None.

    Never imports torch and never calls anything that would create a CUDA context (docs/measurements.md): a kernel
    that has not used the GPU yet must not start paying for it because we looked.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch if torch.cuda.is_initialized() else None
    except Exception:  # a half-imported or unusual torch: treat as "not in use"
        return None


def apply_to_running_torch(torch, state) -> List[str]:
    """Apply the caps in `state` to a torch whose CUDA is already running; return notes for the user.

    Raising a cap works at once. Lowering it below what the allocator holds: the cache is emptied first;
    if the kernel still holds more than the new cap, existing tensors stay and new allocations fail
    until usage drops (measured, docs/measurements.md).
    """
    notes = []
    caps = state.caps_by_ordinal() if state.devices else None
    if caps is not None:
        count = torch.cuda.device_count()
        held_above = [o for o, cap in enumerate(caps) if o < count and torch.cuda.memory_reserved(o) > cap]
        if held_above:
            torch.cuda.empty_cache()
    apply_current_caps(torch, state)
    if caps is not None:
        for ordinal, cap in enumerate(caps):
            if ordinal >= torch.cuda.device_count():
                break
            reserved = torch.cuda.memory_reserved(ordinal)
            if reserved > cap:
                notes.append(
                    f"cuda:{ordinal} still holds {_gib(reserved)} (above the new cap of {_gib(cap)}) after "
                    "torch.cuda.empty_cache(): existing tensors are kept; new allocations fail until usage drops"
                )
    return notes


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.1f} GiB"


def write_alloc_conf_fraction(state, env=os.environ) -> Optional[str]:
    """Put the tightest granted fraction into PYTORCH_CUDA_ALLOC_CONF so child processes started from now
    on (DataLoader workers, subprocesses) get the new cap. Only where the installed torch reads it
    (older torch fails at CUDA start on the unknown key). Returns the variable written, or None."""
    if not state.devices or not reads_fraction_from_alloc_conf(installed_torch_version()):
        return None
    fraction = min(d.cap / d.total for d in state.devices)
    name = alloc_conf_variable(env)
    env[name] = merge_alloc_conf(env.get(name), fraction, tighten_only=False)
    return name


class TorchImportWatcher(importlib.abc.MetaPathFinder):
    """Calls `on_import(torch)` right after `import torch` finishes, wherever that import happens."""

    def __init__(self, on_import: Callable[[object], None]):
        self._on_import = on_import
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" or self._searching:
            return None
        self._searching = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module
        watcher = self

        def exec_module(module):
            original(module)
            watcher.uninstall()
            try:
                watcher._on_import(module)
            except Exception as error:  # never break the user's import; say it in the cell that imported torch
                import warnings

                warnings.warn(f"gpu-quota-ext could not queue the torch cap: {error!r}", RuntimeWarning, stacklevel=2)

        spec.loader.exec_module = exec_module
        return spec

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        while self in sys.meta_path:
            sys.meta_path.remove(self)


# --- putting caps in force -----------------------------------------------------------------------


def cap_torch(state: "KernelCapState", env=os.environ) -> None:
    """At kernel start: the allocator option when this torch reads it, and the lazy hook; `state.torch_route`
    says which."""
    version = installed_torch_version()
    routes = []
    if reads_fraction_from_alloc_conf(version):
        # One fraction for every device and every child process: the tightest one.
        fraction = min(d.cap / d.total for d in state.devices)
        name = alloc_conf_variable(env)
        env[name] = merge_alloc_conf(env.get(name), fraction)
        routes.append(f"{name} (torch {version}, inherited by child processes)")
    install_lazy_hook(state)
    routes.append("set_per_process_memory_fraction at first CUDA use")
    state.torch_route = " + ".join(routes)


def install_lazy_hook(state: "KernelCapState") -> None:
    """Apply `state`'s caps when the kernel first uses CUDA (at once if it already does).

    The hook reads the caps from `state` when it runs, not when it is installed: a `%gpucap` change made
    before the first CUDA use is the cap applied then. Installed once per kernel.
    """
    if state.hook_installed:
        return
    state.hook_installed = True

    def on_torch_import(torch) -> None:
        def apply() -> None:
            for call in list(state.before_cuda):  # a cap changed outside since the last sync: sync.catch_up
                try:
                    call()
                except Exception as error:  # broad: inside the user's first CUDA use; said after the cell
                    state.problems.append(f"before CUDA start: {error!r}")
            try:
                apply_current_caps(torch, state)
            except Exception as error:  # broad: inside the user's first CUDA use; said after the cell
                state.problems.append(f"torch cap not applied at CUDA start: {error!r}")
            try:  # a kernel that held nothing yet: room for its cap before its first allocation (room_check.py)
                from . import room_check

                room_check.at_first_cuda()
            except Exception:  # broad: inside torch's CUDA start; no wait for room is no worse than before
                pass

        if torch.cuda.is_initialized():
            apply()
            return
        lazy_call = lazy_call_of(torch)
        if lazy_call is None:
            state.problems.append(no_lazy_call_problem(torch))
        else:
            lazy_call(apply)

    if "torch" in sys.modules:
        on_torch_import(sys.modules["torch"])
    else:
        TorchImportWatcher(on_torch_import).install()


def lazy_call_of(torch) -> Optional[Callable[[Callable[[], None]], None]]:
    """`torch.cuda._lazy_call`, the private torch API that queues a call for CUDA's first initialisation
    (torch 1.x to 2.13 have it); None when this torch has none (tests/unit/test_torch_cap.py guards it)."""
    lazy_call = getattr(getattr(torch, "cuda", None), "_lazy_call", None)
    return lazy_call if callable(lazy_call) else None


def no_lazy_call_problem(torch) -> str:
    version = getattr(torch, "__version__", "of unknown version")
    return (
        f"torch {version} has no torch.cuda._lazy_call (a private torch API): the cap cannot be queued for "
        "CUDA's start; it applies once CUDA runs and %gpucap or the next cell puts it in force"
    )


def put_caps_in_force(state, env=os.environ) -> List[str]:
    """The caps recorded in `state`, in force: now if CUDA runs, else at its first use (the lazy hook)."""
    notes = []
    written = write_alloc_conf_fraction(state, env)
    torch = cuda_torch()
    if torch is not None:
        notes += apply_to_running_torch(torch, state)
    else:
        install_lazy_hook(state)
        notes.append("torch has not started CUDA in this kernel: the cap applies at its first use")
    if written:
        notes.append(f"{written} updated: processes started from now on get the new cap")
    return notes
