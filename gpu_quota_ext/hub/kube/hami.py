"""The HAMi way: each user's pod asks HAMi's device plugin for its GPUs and its share of their memory as
extended resources, and HAMi's scheduler annotations. Also the vocabulary every way starts from: the
pre_spawn_hook writes the policy as HAMi's resources, a profile's `kubespawner_override` may lower them, and
`settle_limits` holds the finished pod to the policy; the other ways then turn the settled values into their
own objects (dra.py, kai.py).

Pure: mappings in, mappings out.

What the pod carries: `nvidia.com/gpu` (GPUs in the pod), `nvidia.com/gpumem` (MiB of each, rounded down) or
`nvidia.com/gpumem-percentage` (whole percents), `nvidia.com/gpucores` (percent of each GPU's compute), and
the annotations `nvidia.com/use-gputype` (comma-separated models), `hami.io/gpu-scheduler-policy`,
`hami.io/node-scheduler-policy`. HAMi's chart may rename the resources (`resource_names`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ...shared.sizes import MiB, PolicyError, parse_cap

GPU_TYPE_ANNOTATION = "nvidia.com/use-gputype"
GPU_POLICY_ANNOTATION = "hami.io/gpu-scheduler-policy"
NODE_POLICY_ANNOTATION = "hami.io/node-scheduler-policy"


@dataclass(frozen=True)
class HamiResources:
    """HAMi's resource names (its chart can rename them: nvidia.resourceCountName and the like)."""

    count: str = "nvidia.com/gpu"
    memory: str = "nvidia.com/gpumem"
    memory_percentage: str = "nvidia.com/gpumem-percentage"
    cores: str = "nvidia.com/gpucores"

    @property
    def all(self) -> Tuple[str, ...]:
        return (self.count, self.memory, self.memory_percentage, self.cores)


HAMI_NAMES = HamiResources()  # HAMi's chart's default names

ANNOTATION_OF = {
    "gpu_type": GPU_TYPE_ANNOTATION,
    "gpu_scheduler_policy": GPU_POLICY_ANNOTATION,
    "node_scheduler_policy": NODE_POLICY_ANNOTATION,
}


# --- the decision for one pod (pure) -----------------------------------------------------------------------


@dataclass(frozen=True)
class PodGpu:
    """What the policy gives one user's pod. `limits`: resource -> quantity, or None for "none of it"."""

    limits: Mapping[str, Optional[str]] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)  # resource or annotation -> where it came from
    implied_count: bool = False  # memory or cores without a GPU count: the pod gets 1 unless it has one
    no_gpu: bool = False  # gpus = 0: none of HAMi's resources, no GPU annotations

    def describe(self) -> str:
        parts = [
            f"{name} {value if value is not None else 'none'} ({self.sources[name]})"
            for name, value in self.limits.items()
        ]
        parts += [f"{name}={value} ({self.sources[name]})" for name, value in self.annotations.items()]
        return ", ".join(parts) or "nothing"


def pod_gpu(chosen: Mapping[str, str], sources: Mapping[str, str], names: HamiResources = HamiResources()) -> PodGpu:
    """The pod's GPU resources and HAMi annotations from `choose_settings`' result (normalized values)."""
    limits: Dict[str, Optional[str]] = {}
    where: Dict[str, str] = {}
    annotations = {ANNOTATION_OF[key]: chosen[key] for key in ANNOTATION_OF if key in chosen}
    for key, annotation in ANNOTATION_OF.items():
        if key in chosen:
            where[annotation] = f"{key} from {sources[key]}"
    if chosen.get("gpus") == "0":
        # No GPU: none of HAMi's resources, and no scheduling hints for a GPU the pod will not have.
        for name in names.all:
            limits[name], where[name] = None, f"gpus from {sources['gpus']}"
        return PodGpu(limits=limits, annotations={}, sources=where, no_gpu=True)
    if "gpus" in chosen:
        limits[names.count], where[names.count] = chosen["gpus"], f"gpus from {sources['gpus']}"
    if "gpu_memory" in chosen:
        text = chosen["gpu_memory"]
        source = f"gpu_memory {text} from {sources['gpu_memory']}"
        if text.endswith("%"):
            chosen_name, other = names.memory_percentage, names.memory
            value = text[:-1]
        else:
            chosen_name, other = names.memory, names.memory_percentage
            nbytes = parse_cap(text).nbytes
            assert nbytes is not None  # _gpu_memory wrote it: a percentage or whole MiB
            value = str(nbytes // MiB)
        limits[chosen_name], where[chosen_name] = value, source
        limits[other], where[other] = None, source  # one unit per pod, the policy's: never both
    if "gpu_cores" in chosen:
        limits[names.cores], where[names.cores] = chosen["gpu_cores"], f"gpu_cores from {sources['gpu_cores']}"
    implied = "gpus" not in chosen and ("gpu_memory" in chosen or "gpu_cores" in chosen)
    return PodGpu(limits=limits, annotations=annotations, sources=where, implied_count=implied)


def merge_limits(base: Mapping[str, Any], decision: PodGpu, names: HamiResources = HamiResources()) -> Dict[str, Any]:
    """Spawner-wide limits with the policy's GPU values in their place (the policy replaces them)."""
    merged = dict(base)
    for name, value in decision.limits.items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    if decision.implied_count and names.count not in merged:
        merged[names.count] = "1"
    return merged


def align_requests(
    requests: Mapping[str, Any], limits: Mapping[str, Any], names: HamiResources = HamiResources()
) -> Dict[str, Any]:
    """Kubernetes wants an extended resource's request equal to its limit: follow the limits."""
    aligned = dict(requests)
    for name in names.all:
        if name in aligned:
            if name in limits:
                aligned[name] = limits[name]
            else:
                aligned.pop(name)
    return aligned


def _quantity(value: Any, name: str) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit():
        raise PolicyError(f"the pod's {name} = {value!r} is not a whole number (HAMi counts GPUs, MiB and percents)")
    return int(text)


def settle_limits(
    pod_limits: Mapping[str, Any], decision: PodGpu, names: HamiResources = HamiResources()
) -> Tuple[Dict[str, Any], List[str]]:
    """The finished pod's limits (a profile may have changed them) held to the policy; what changed, said.

    Count, memory and cores: the smaller of the pod's value and the policy's. A pod left without a GPU
    (the profile gives none, or `nvidia.com/gpu: 0`) keeps none of HAMi's resources. Memory or cores the
    profile removed come back (HAMi would otherwise give the whole GPU). Memory in the other unit than
    the policy's cannot be compared: the policy's replaces it.
    """
    limits = dict(pod_limits)
    notes: List[str] = []
    count = limits.get(names.count)
    no_gpu = decision.no_gpu
    if not no_gpu and names.count in decision.limits:
        most = int(decision.limits[names.count])  # type: ignore[arg-type]
        have = None if count is None else _quantity(count, names.count)
        if have is None or have == 0:
            notes.append(f"the profile gives the pod no GPU (the policy: {most}, {decision.sources[names.count]})")
            no_gpu = True
        elif have > most:
            notes.append(f"{names.count} {have} from the profile lowered to {most} ({decision.sources[names.count]})")
            limits[names.count] = str(most)
    elif not no_gpu and count is not None and _quantity(count, names.count) == 0:
        no_gpu = True
    elif not no_gpu and count is None and decision.implied_count:
        limits[names.count] = "1"
    if no_gpu:
        extra = [f"{name} {limits[name]}" for name in names.all if name in limits and str(limits[name]).strip() != "0"]
        if decision.no_gpu and extra:
            notes.append(f"{', '.join(extra)} from the profile removed ({decision.sources[names.count]})")
        for name in names.all:
            limits.pop(name, None)
        return limits, notes
    for name, value in decision.limits.items():
        if name == names.count:
            continue
        if value is None:  # the memory unit the policy did not choose
            if name in limits:
                notes.append(
                    f"{name} {limits.pop(name)} from the profile replaced by the policy's ({decision.sources[name]})"
                )
            continue
        if name not in limits:
            notes.append(f"{name} {value} put back: the profile had removed it ({decision.sources[name]})")
            limits[name] = value
            continue
        have, most = _quantity(limits[name], name), int(value)
        if have > most:
            notes.append(f"{name} {have} from the profile lowered to {most} ({decision.sources[name]})")
            limits[name] = value
    return limits, notes


@dataclass(frozen=True)
class SettledGpu:
    """The finished pod's GPU after `settle_limits`, in numbers: what the other ways turn into their objects."""

    count: int = 0  # 0: no GPU
    memory_mib: Optional[int] = None  # MiB of each GPU, or
    percent: Optional[int] = None  # percent of each GPU's memory (never both)
    cores: Optional[int] = None  # percent of each GPU's compute (0: no compute limit, HAMi's default)

    def record(self) -> Dict[str, Any]:
        """As the hub's record annotation writes it (devices.downward reads it inside the pod)."""
        record: Dict[str, Any] = {"gpus": self.count}
        if self.count and self.memory_mib is not None:
            record["gpu_memory"] = f"{self.memory_mib}Mi"
        elif self.count and self.percent is not None:
            record["gpu_memory"] = f"{self.percent}%"
        if self.count and self.cores is not None:
            record["gpu_cores"] = self.cores
        return record


def settled_gpu(limits: Mapping[str, Any], names: HamiResources = HamiResources()) -> SettledGpu:
    """`settle_limits`' result (whole numbers where it kept a value) as a SettledGpu."""
    count = int(str(limits.get(names.count, "0")).strip() or 0)
    if count == 0:
        return SettledGpu()

    def number(name: str) -> Optional[int]:
        return _quantity(limits[name], name) if name in limits else None

    percent = number(names.memory_percentage)
    return SettledGpu(
        count=count,
        memory_mib=number(names.memory),
        percent=None if percent == 100 else percent,  # all of each GPU's memory: whole GPUs
        cores=number(names.cores),
    )


def without_hami(resources: Mapping[str, Any], names: HamiResources = HamiResources(), keep_count: bool = False):
    """`resources` less HAMi's names (the count kept when asked): for the ways that do not ask HAMi."""
    dropped = [name for name in names.all if not (keep_count and name == names.count)]
    return {name: value for name, value in resources.items() if name not in dropped}
