"""Which way a kernel parks, per kernel: "pages" (the fast park library copies its torch allocations to a pinned
host arena at link speed, gpu_quota_ext/parking/pages) or "checkpoint" (the driver's checkpoint calls move the
whole process, checkpoint.py), with the reason, in words the status shows. Pure: the facts come from the kernel
(what its library and torch report) and from NVML (what its processes hold); nothing here reads them.

The fast path moves only what torch's caching allocator asked cudaMalloc for. So it is chosen only where that
is (nearly) all the kernel holds: anything else on the device would stay there through a park, and the parker
promises the room a park makes. Every doubt falls back to the checkpoint path, which moves everything.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Mapping, Optional, Tuple

from ..shared.sizes import MiB, format_bytes

CUDA_ERROR_OUT_OF_MEMORY = 2  # cuda.h; what the library answers when the device has no room for a resume

PAGES = "pages"
CHECKPOINT = "checkpoint"

# What a CUDA context takes on the device, and stays through a fast park: 612 MiB measured with torch on the H200
# (driver 580, benchmarks/results/fast_park_probe-20261204T0442Z-h200.json); about 514 MiB under MPS.
CONTEXT_ALLOWANCE = 640 * MiB
# Held outside the library beyond the context, still small enough to leave on the device through a park.
FOREIGN_TOLERANCE = 256 * MiB


@dataclass(frozen=True)
class KernelFacts:
    """What is known of one kernel when its park is asked for."""

    fast_park: str = "off"  # the setting: "on", "auto" or "off"
    answered: bool = True  # the kernel answered the question about its facts (False: nothing below is known)
    preloaded: bool = False  # the library is in the kernel's process (started with LD_PRELOAD)
    library_problem: Optional[str] = None  # why the library serves nothing (it could not open the driver), or None
    torch_cuda: bool = False  # torch has made its CUDA context in the kernel
    allocator_backend: str = "native"  # torch's allocator: "native" or "cudaMallocAsync"
    expandable_segments: bool = False  # torch maps its own virtual memory then, never through cudaMalloc
    served_bytes: int = 0  # what the library maps: what a fast park moves
    process_bytes: int = 0  # what NVML sees the kernel's processes hold on the device, all of them
    gpu_processes: int = 1  # the kernel's processes that hold device memory
    devices: int = 1  # devices the kernel's process holds memory on


@dataclass(frozen=True)
class ParkPath:
    path: str  # PAGES or CHECKPOINT
    reason: str  # one sentence, for the status and the docs
    stays_on_device: int = 0  # bytes a park leaves behind (PAGES: the context and what the library does not hold)


def choose_path(facts: KernelFacts) -> ParkPath:
    """The path for this kernel and why: the first rule that sends it to the checkpoint path, else pages."""
    slow = _checkpoint_reason(facts)
    if slow is not None:
        return ParkPath(CHECKPOINT, slow)
    stays = max(0, facts.process_bytes - facts.served_bytes)
    return ParkPath(
        PAGES,
        f"a torch kernel with the fast park library: its {format_bytes(facts.served_bytes)} move at the link's "
        f"speed; {format_bytes(stays)} (its CUDA context) stay on the device",
        stays,
    )


def fast_park_on(setting: str) -> bool:
    """Whether parks ask kernels for their facts and may take the fast path ("on" and "auto")."""
    return setting in ("on", "auto")


def preloads(setting: str, python_kernel: bool, mps_client: bool) -> bool:
    """Whether a kernel starts with the fast park library: Python kernels where fast_park is on; under "auto",
    not those given an MPS hard limit (an MPS client is never parked: the library would serve nothing)."""
    if not python_kernel or not fast_park_on(setting):
        return False
    return setting == "on" or not mps_client


def _checkpoint_reason(facts: KernelFacts) -> Optional[str]:
    if not fast_park_on(facts.fast_park):
        return "fast_park is off"
    if not facts.answered:
        return "the kernel did not say what it holds (no answer on its control channel in time)"
    if not facts.preloaded:
        return "the kernel started without the fast park library (before fast_park was on, or not a Python kernel)"
    if facts.library_problem:
        return f"the fast park library serves nothing in this kernel: {facts.library_problem}"
    if not facts.torch_cuda:
        return "no torch on the GPU in this kernel: other libraries (CuPy, JAX, TensorFlow) allocate on their own"
    if facts.allocator_backend != "native":
        return f"torch's {facts.allocator_backend} allocator does not allocate through cudaMalloc"
    if facts.expandable_segments:
        return "torch's expandable segments map their own memory, not through cudaMalloc"
    if facts.gpu_processes > 1:
        return f"{facts.gpu_processes} processes of this kernel hold GPU memory: only the kernel's own would move"
    if facts.devices > 1:
        return f"this kernel holds memory on {facts.devices} devices: the fast path maps one device's memory only"
    foreign = facts.process_bytes - facts.served_bytes - CONTEXT_ALLOWANCE
    if foreign > FOREIGN_TOLERANCE:
        return (
            f"{format_bytes(foreign)} on the device are held outside torch's allocator (a library allocating "
            "on its own): only the checkpoint path moves them"
        )
    # The kernel's answer is the user's process speaking: more than NVML sees it hold would size an arena (and the
    # host memory reserved for it) on a claim, and count bytes a swap would wait for that no park frees. NVML is read
    # after the answer (parker._check_park), so an honest kernel's count is its served bytes plus its context; the
    # tolerance covers a sample that lags a little (one whose fresh reading did not come: the last one is used).
    if facts.served_bytes - facts.process_bytes > FOREIGN_TOLERANCE:
        return (
            f"the kernel says the fast park library maps {format_bytes(facts.served_bytes)}, more than its processes "
            f"hold on the device ({format_bytes(facts.process_bytes)}, NVML): not believed"
        )
    return None


def arena_bytes(served_bytes: int, slack: int = 256 * MiB) -> int:
    """The pinned arena a fast park needs: what the library maps, with room for torch's cache to grow a little
    between the arena's making and the park."""
    return served_bytes + slack


def keep_arena(arena: int, host_available: int, host_margin: int) -> bool:
    """Whether a resumed kernel keeps its pinned arena for its next park (pinning again costs seconds: 1.55 s for
    20 GiB measured) or gives the host memory back: kept only while the host has the margin beside it."""
    return host_available - arena >= host_margin


def arenas_to_release(kept: Mapping[str, int], short: int) -> Tuple[str, ...]:
    """The running kernels whose kept arenas are given back so that a park finds `short` bytes more of host memory:
    the largest first, the fewest that cover it; none where all of them together would not (each one given back
    costs its kernel the pinning again at its next park: 1.5 to 3.3 s for 20 to 56 GiB measured)."""
    if short <= 0 or sum(kept.values()) < short:
        return ()
    chosen: List[str] = []
    for kernel_id, nbytes in sorted(kept.items(), key=lambda item: (-item[1], item[0])):
        if short <= 0:
            break
        chosen.append(kernel_id)
        short -= nbytes
    return tuple(chosen)


def kernel_facts(
    fast_park: str,
    answer: Optional[Mapping[str, object]],
    device_bytes: Mapping[int, int],
    gpu_processes: int,
) -> KernelFacts:
    """The facts `choose_path` reads: the kernel's answer to {"action": "facts"} (kernel/fast_park.py, None when
    it did not answer) and what the monitor's sample says its processes hold (bytes by device, how many)."""
    held = {index: n for index, n in device_bytes.items() if n > 0}
    base = KernelFacts(
        fast_park=fast_park,
        process_bytes=sum(held.values()),
        gpu_processes=gpu_processes,
        devices=len(held),
    )
    if not fast_park_on(fast_park):
        return base
    if not isinstance(answer, Mapping) or "preloaded" not in answer:
        return replace(base, answered=False)
    problem = answer.get("library_problem")
    return replace(
        base,
        preloaded=answer.get("preloaded") is True,
        library_problem=str(problem) if problem else None,
        torch_cuda=answer.get("torch_cuda") is True,
        allocator_backend=str(answer.get("allocator_backend") or "native"),
        expandable_segments=answer.get("expandable_segments") is True,
        served_bytes=_count(answer.get("served_bytes")),
    )


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def host_need(served_bytes: int, arena_now: int) -> int:
    """Host memory a fast park takes beyond what the kernel holds already: a new arena (`arena_bytes`) in place
    of the one it has (freed first), or nothing when the one it has holds every served byte."""
    if arena_now >= served_bytes:
        return 0
    return max(0, arena_bytes(served_bytes) - arena_now)


def resume_deferred_reason(code: int, message: str, nbytes: int) -> str:
    """Why a fast resume did not happen: the kernel stays parked, whole, and waits for room again (unlike the
    checkpoint path, where a failed restore loses the kernel)."""
    if code == CUDA_ERROR_OUT_OF_MEMORY:
        why = f"the device had no room for its {format_bytes(nbytes)} when the resume ran ({message})"
    else:
        why = f"the fast resume failed ({message})"
    return f"{why}; nothing was lost: the kernel stays parked with every byte on the host and waits for room again"
