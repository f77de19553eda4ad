"""The KAI way: each user's pod goes to KAI Scheduler (its `schedulerName`), in the user's queue (a label), with
the annotations KAI reads for a GPU fraction, and the per-container memory annotations that
kai-gpu-fractioning turns into a driver-enforced limit.

Pure: the settled GPU in, labels and annotations out.

What KAI reads (kai-scheduler/KAI-Scheduler: pkg/common/constants, docs/gpu-sharing, docs/queues):
`schedulerName: kai-scheduler`; label `kai.scheduler/queue: <queue>`; annotation `gpu-memory: "<MiB>"` (an
integer, one GPU) or `gpu-fraction: "<portion>"`, `gpu-fraction-num-devices: "<n>"` for several GPUs and
`gpu-fraction-container-name` naming the container that gets them (KubeSpawner's is "notebook"). Whole GPUs
stay `nvidia.com/gpu` limits, which KAI schedules too. With kai-gpu-fractioning (NVIDIA driver r615 or newer)
the annotations `nvidia.com/container.<container>.gpu-memory.limit` and `.request` (Kubernetes quantities)
become NVIDIA_GPU_MEMORY_LIMITS in the container, which the driver enforces; a fraction has no size before
the GPU is chosen, so only a size gets them. A profile may speak KAI's words too (`extra_annotations`
with `gpu-memory` or `gpu-fraction`): they are read as its offer, held to the policy like HAMi's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Tuple

from .hami import HAMI_NAMES, HamiResources, SettledGpu

GPU_MEMORY = "gpu-memory"
GPU_FRACTION = "gpu-fraction"
NUM_DEVICES = "gpu-fraction-num-devices"
CONTAINER_NAME = "gpu-fraction-container-name"
CONTAINER_PREFIX = "nvidia.com/container."
FRACTION_ANNOTATIONS = (GPU_MEMORY, GPU_FRACTION, NUM_DEVICES, CONTAINER_NAME)
WHOLE_GPUS = "nvidia.com/gpu"  # whole GPUs under KAI: the device plugin's resource


@dataclass(frozen=True)
class KaiNames:
    """KAI's scheduler name and queue label (its Helm chart can change both)."""

    scheduler_name: str = "kai-scheduler"
    queue_label: str = "kai.scheduler/queue"


def container_annotations(container: str) -> Tuple[str, str]:
    """kai-gpu-fractioning's (limit, request) annotation names for `container`."""
    return (f"{CONTAINER_PREFIX}{container}.gpu-memory.limit", f"{CONTAINER_PREFIX}{container}.gpu-memory.request")


def profile_limits(
    limits: Mapping[str, Any], annotations: Mapping[str, str], container: str, names: HamiResources = HAMI_NAMES
) -> Tuple[Dict[str, Any], Dict[str, str], List[str]]:
    """A profile's KAI annotations read as HAMi's limits (the vocabulary `settle_limits` holds to the policy), and
    the annotations without every fraction annotation (the settled pod gets its own). Notes say what was read.

    `gpu-memory` -> MiB; `gpu-fraction` -> whole percents, rounded down (never more than the profile offered);
    `gpu-fraction-num-devices` -> the GPU count."""
    limits = dict(limits)
    ours = FRACTION_ANNOTATIONS + container_annotations(container)
    kept = {name: value for name, value in annotations.items() if name not in ours}
    notes: List[str] = []
    if GPU_MEMORY in annotations:
        limits[names.memory] = str(annotations[GPU_MEMORY]).strip()
        limits.pop(names.memory_percentage, None)
        notes.append(f"the profile's {GPU_MEMORY}={annotations[GPU_MEMORY]} read as {names.memory}")
    elif GPU_FRACTION in annotations:
        try:
            percent = int(float(str(annotations[GPU_FRACTION]).strip()) * 100 + 1e-9)
        except ValueError:
            percent = -1
        # settle_limits refuses what is not a whole number, naming it: a bad fraction fails the spawn
        limits[names.memory_percentage] = str(percent) if 0 < percent <= 100 else str(annotations[GPU_FRACTION])
        limits.pop(names.memory, None)
        notes.append(f"the profile's {GPU_FRACTION}={annotations[GPU_FRACTION]} read as {names.memory_percentage}")
    if NUM_DEVICES in annotations:
        limits[names.count] = str(annotations[NUM_DEVICES]).strip()
    elif (GPU_MEMORY in annotations or GPU_FRACTION in annotations) and names.count not in limits:
        limits[names.count] = "1"
    return limits, kept, notes


def kai_annotations(gpu: SettledGpu, container: str) -> Dict[str, str]:
    """The fraction annotations for a settled GPU with a memory share ({} for whole GPUs or none)."""
    if gpu.count < 1 or (gpu.memory_mib is None and gpu.percent is None):
        return {}
    found = {CONTAINER_NAME: container}
    if gpu.count > 1:
        found[NUM_DEVICES] = str(gpu.count)
    if gpu.memory_mib is not None:
        found[GPU_MEMORY] = str(gpu.memory_mib)
        limit, request = container_annotations(container)
        found[limit] = found[request] = f"{gpu.memory_mib}Mi"
    elif gpu.percent is not None:
        found[GPU_FRACTION] = f"{gpu.percent / 100:.2f}"
    return found
