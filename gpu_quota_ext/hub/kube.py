"""JupyterHub on Kubernetes with HAMi: each user's pod asks HAMi for its GPUs and its share of their
memory, from the same mapping (and group properties) that gives the user's server its caps.

In the hub's configuration (zero-to-jupyterhub: `hub.extraConfig`):

    from gpu_quota_ext.hub.kube import configure_kubespawner_gpu

    configure_kubespawner_gpu(
        c,
        default={"gpus": 1, "gpu_memory": "10GiB", "default_cap": "0.5", "max_cap": "1.0"},
        groups={"staff": {"gpu_memory": "40GiB"}, "no-gpu": {"gpus": 0}},
        users={"alice": {"gpu_memory": "50%", "gpu_type": "H200"}},
    )

Besides the server's keys (gpu_quota_ext.hub: default_cap, max_cap, ...), an entry may set the pod's:
- `gpus`: GPUs in the pod (HAMi's `nvidia.com/gpu`); 0 means no GPU at all;
- `gpu_memory`: the pod's memory on each of its GPUs: a size ("10GiB" -> `nvidia.com/gpumem`, in MiB,
  rounded down) or a fraction ("0.25", "25%" -> `nvidia.com/gpumem-percentage`, whole percents);
- `gpu_cores`: percent of each GPU's compute (`nvidia.com/gpucores`);
- `gpu_type`: GPU models the pod may get (annotation `nvidia.com/use-gputype`, comma-separated);
- `gpu_scheduler_policy`, `node_scheduler_policy`: "binpack" or "spread" (annotations
  `hami.io/gpu-scheduler-policy`, `hami.io/node-scheduler-policy`).
Each key comes from the user's entry, else their first group with settings, else `default`, as for caps.

Who wins against KubeSpawner's own settings:
- spawner-wide `c.KubeSpawner.extra_resource_limits` / `extra_annotations` (z2jh `singleuser.extraResource`):
  the policy replaces the GPU values it sets; the others stay;
- a `profile_list` profile (its `kubespawner_override` is applied after pre_spawn_hook): for GPU count,
  memory and cores, the smaller of the profile's and the policy's (a profile can offer less than the
  user's policy, never more; a profile with no GPU, or `nvidia.com/gpu: 0`, gives none). A profile whose
  memory is in the other unit (percentage against MiB) cannot be compared: the policy's replaces it.
  For the annotations the profile's choice wins (a profile is a choice of hardware). Every value the
  hook changes or keeps against the policy is said in the hub's log.

The decision is pure (`pod_gpu`, `merge_limits`, `settle_limits`); the glue is two KubeSpawner hooks:
`pre_spawn_hook` (environment, limits, annotations; a bad group property fails the spawn here, with a
message naming it) and `modify_pod_hook` (the profile rule above, on the finished pod). This module does
not import jupyterhub or kubespawner.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from ..shared.sizes import MiB, PolicyError, parse_cap
from .caps import (
    HubCaps,
    chain_hooks,
    choose_settings,
    environment_of,
    hub_caps,
    set_spawner_environment,
)

MAX_GPUS = 16  # HAMi-core keeps limits for 16 devices per container
GPU_TYPE_ANNOTATION = "nvidia.com/use-gputype"
GPU_POLICY_ANNOTATION = "hami.io/gpu-scheduler-policy"
NODE_POLICY_ANNOTATION = "hami.io/node-scheduler-policy"
GPU_POLICIES = ("binpack", "spread", "topology-aware")
NODE_POLICIES = ("binpack", "spread")


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


# --- the pod keys of the mapping: each parser returns the normalized text, or raises PolicyError ------------


def _whole(value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PolicyError(f"{value!r} is not a whole number of {what}")
    text = str(value).strip().rstrip("%").strip() if what == "percent" else str(value).strip()
    if not text.isdigit():
        raise PolicyError(f"{value!r} is not a whole number of {what}")
    number = int(text)
    if not low <= number <= high:
        raise PolicyError(f"{value!r}: {what} must be from {low} to {high}")
    return number


def _gpus(value: Any) -> str:
    return str(_whole(value, 0, MAX_GPUS, "GPUs"))


def _gpu_memory(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        # 10240 could mean bytes (our caps) or MiB (HAMi's unit): make the admin say which.
        raise PolicyError(f"{value!r}: write a size with its unit ('10GiB', '10240MiB') or a fraction ('0.25', '25%')")
    spec = parse_cap(value)
    if spec.fraction is not None:
        percent = spec.fraction * 100
        if abs(percent - round(percent)) > 1e-9:
            raise PolicyError(f"{value!r}: HAMi's {HamiResources.memory_percentage} takes whole percents (1 to 100)")
        return f"{round(percent)}%"
    assert spec.nbytes is not None
    return f"{spec.nbytes // MiB}MiB"  # HAMi counts whole MiB: never more than asked


def _gpu_cores(value: Any) -> str:
    return str(_whole(value, 0, 100, "percent"))


def _gpu_type(value: Any) -> str:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise PolicyError(f"{value!r}: give a GPU model or a list of them, e.g. 'H200' or ['A100', 'H100']")
    names = []
    for item in items:
        if not isinstance(item, str) or not item.strip() or any(ch in item for ch in ",{}\n"):
            raise PolicyError(f"{value!r}: each GPU model must be a non-empty name without commas or braces")
        names.append(item.strip())
    return ",".join(names)


def _choice(allowed: Tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower() if isinstance(value, str) else None
        if text not in allowed:
            raise PolicyError(f"{value!r} must be one of {', '.join(repr(a) for a in allowed)}")
        return text

    return parse


POD_KEYS: Dict[str, Callable[[Any], str]] = {
    "gpus": _gpus,
    "gpu_memory": _gpu_memory,
    "gpu_cores": _gpu_cores,
    "gpu_type": _gpu_type,
    "gpu_scheduler_policy": _choice(GPU_POLICIES),
    "node_scheduler_policy": _choice(NODE_POLICIES),
}
_ANNOTATION_OF = {
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
    annotations = {_ANNOTATION_OF[key]: chosen[key] for key in _ANNOTATION_OF if key in chosen}
    for key, annotation in _ANNOTATION_OF.items():
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


# --- the glue: KubeSpawner hooks ----------------------------------------------------------------------------


@dataclass(frozen=True)
class KubeGpu:
    """The validated mapping and HAMi's resource names. Build it with `configure_kubespawner_gpu`."""

    caps: HubCaps
    names: HamiResources = HamiResources()

    def decide(self, user: str, groups: Iterable[Any] = ()) -> Tuple[Dict[str, str], PodGpu]:
        """(the server's environment, the pod's GPU) for `user`. Raises PolicyError naming the entry."""
        chosen, sources = choose_settings(self.caps, user, groups)
        return environment_of(chosen, sources, user), pod_gpu(chosen, sources, self.names)

    def pre_spawn_hook(self, previous: Optional[Callable] = None) -> Callable:
        """Runs `previous` (the admin's hook), then sets environment, extra_resource_limits and
        extra_resource_guarantees, extra_annotations from the policy."""

        def apply(spawner) -> None:
            env, decision = self.decide(spawner.user.name, getattr(spawner.user, "groups", ()))
            set_spawner_environment(spawner, env)
            base = _base_of(spawner)
            limits = merge_limits(base["extra_resource_limits"], decision, self.names)
            spawner.extra_resource_limits = limits
            spawner.extra_resource_guarantees = align_requests(base["extra_resource_guarantees"], limits, self.names)
            annotations = dict(base["extra_annotations"])
            if decision.no_gpu:
                for name in _ANNOTATION_OF.values():
                    annotations.pop(name, None)  # no GPU: no GPU scheduling hints either
            annotations.update(decision.annotations)
            spawner.extra_annotations = annotations
            spawner._gpu_quota_pod = decision
            spawner.log.info("gpu-quota-ext: pod of %s: %s", spawner.user.name, decision.describe())

        return chain_hooks(previous, apply)

    def modify_pod_hook(self, previous: Optional[Callable] = None) -> Callable:
        """Runs `previous`, then holds the finished pod to the policy (see `settle_limits`)."""

        async def settle(spawner, pod):
            if previous is not None:
                pod = previous(spawner, pod)
                if inspect.isawaitable(pod):
                    pod = await pod
            decision = getattr(spawner, "_gpu_quota_pod", None)
            if decision is None:
                raise PolicyError(
                    "gpu-quota-ext: the pre_spawn_hook of configure_kubespawner_gpu did not run for this spawn "
                    "(was c.KubeSpawner.pre_spawn_hook set after calling it?); refusing to start a pod without its GPU "
                    "policy"
                )
            container = next((c for c in pod.spec.containers if c.name == "notebook"), pod.spec.containers[0])
            limits, notes = settle_limits(container.resources.limits or {}, decision, self.names)
            container.resources.limits = limits
            container.resources.requests = align_requests(container.resources.requests or {}, limits, self.names)
            annotations = pod.metadata.annotations or {}
            for name, value in decision.annotations.items():
                if self.names.count not in limits and annotations.get(name) == value:
                    annotations.pop(name)  # the pod has no GPU: the policy's GPU hints mean nothing
                elif annotations.get(name) != value:
                    notes.append(
                        f"annotation {name}={annotations.get(name)!r} from the profile kept over the policy's {value!r}"
                    )
            for note in notes:
                spawner.log.warning("gpu-quota-ext: pod of %s: %s", spawner.user.name, note)
            return pod

        return settle


def _base_of(spawner) -> Dict[str, Dict[str, Any]]:
    """The spawner's own limits, requests and annotations (config and JupyterHub's group_overrides, which
    JupyterHub applies before the pre_spawn_hook) before the policy first touched them.

    JupyterHub makes a new spawner for each start after a clean stop, but keeps one whose start failed
    for the next try, and KubeSpawner merges a profile's overrides into these very dicts: a kept
    spawner starts again from its first values, not from the last profile's.
    """
    base = getattr(spawner, "_gpu_quota_base", None)
    if base is None:
        base = {
            name: dict(getattr(spawner, name) or {})
            for name in ("extra_resource_limits", "extra_resource_guarantees", "extra_annotations")
        }
        spawner._gpu_quota_base = base
    return base


def kube_gpu(*, resource_names: Optional[Mapping[str, str]] = None, **mapping: Any) -> KubeGpu:
    """Validate the mapping, pod keys included (raises PolicyError naming the first bad entry).

    `mapping`: hub_caps's keywords (users, groups, default, property_key), whose entries may also hold
    the pod keys above; `resource_names`: HAMi's resource names where a cluster renamed them."""
    try:
        names = HamiResources(**dict(resource_names or {}))
    except TypeError:
        raise PolicyError(
            f"resource_names = {resource_names!r}: known keys are count, memory, memory_percentage, cores"
        ) from None
    return KubeGpu(caps=hub_caps(**mapping, extra_keys=POD_KEYS), names=names)


def configure_kubespawner_gpu(c, **mapping: Any) -> KubeGpu:
    """For jupyterhub_config.py (z2jh: hub.extraConfig): validate, then set KubeSpawner's two hooks.

    Hooks already in `c` (c.KubeSpawner's, else c.Spawner's pre_spawn_hook; c.KubeSpawner's
    modify_pod_hook) keep running, first. Call it after any line that sets them, and instead of
    configure_hub_caps (it sets the same environment). Takes kube_gpu's keywords; returns the validated
    KubeGpu.
    """
    kube = kube_gpu(**mapping)
    section = c.KubeSpawner
    previous = section.pre_spawn_hook if "pre_spawn_hook" in section else c.Spawner.get("pre_spawn_hook")
    section.pre_spawn_hook = kube.pre_spawn_hook(previous if callable(previous) else None)
    modify = section.modify_pod_hook if "modify_pod_hook" in section else None
    section.modify_pod_hook = kube.modify_pod_hook(modify if callable(modify) else None)
    return kube
