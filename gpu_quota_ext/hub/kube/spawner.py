"""The glue: KubeSpawner's two hooks carry the policy into each user's pod, the way the admin chose, and the
ResourceClaimTemplate a DRA way needs is created through KubeSpawner's own API client.

- `pre_spawn_hook`: the server's environment (its caps), and the pod's GPU as HAMi's resources and annotations
  (`extra_resource_limits`, `extra_resource_guarantees`, `extra_annotations`), the vocabulary a profile's
  `kubespawner_override` speaks too. A bad group property fails the spawn here, naming it.
- `modify_pod_hook`, on the finished pod: holds the pod to the policy (hami.settle_limits: a profile can offer
  less, never more), then for the other ways replaces HAMi's resources with the way's objects (dra.py: a claim
  and its template; kai.py: the scheduler, the queue, the annotations), adds the downward API file and the
  hub's record (pod.py), and says in the hub's log every value changed or kept against the policy.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from ...shared.sizes import PolicyError
from ..caps import HubCaps, chain_hooks, choose_settings, environment_of, hub_caps, set_spawner_environment
from .dra import DRIVERS, POD_CLAIM, REQUEST, claim_spec, claim_template, describe_claim
from .hami import (
    ANNOTATION_OF,
    GPU_TYPE_ANNOTATION,
    HamiResources,
    PodGpu,
    align_requests,
    merge_limits,
    pod_gpu,
    settle_limits,
    settled_gpu,
    without_hami,
)
from .kai import WHOLE_GPUS, KaiNames, kai_annotations, profile_limits
from .keys import DRA_WAYS, HAMI, HAMI_DRA, KAI, NVIDIA_DRA, POD_KEYS, check_way
from .pod import ensure_resources, mount_pod_info, notebook_container, set_claim, set_record

WAYS = (HAMI, HAMI_DRA, KAI, NVIDIA_DRA)


class ClaimTemplateError(RuntimeError):
    """The hub could not create a ResourceClaimTemplate: the spawn fails with what to do."""


@dataclass(frozen=True)
class KubeGpu:
    """The validated mapping, the way, and the names each way uses. Build it with `configure_kubespawner_gpu`."""

    caps: HubCaps
    way: str = HAMI
    names: HamiResources = HamiResources()
    kai_names: KaiNames = KaiNames()
    device_class: Optional[str] = None  # a DRA way's DeviceClass, where the cluster names its own

    def decide(self, user: str, groups: Iterable[Any] = ()) -> Tuple[Dict[str, str], PodGpu]:
        """(the server's environment, the pod's GPU) for `user`. Raises PolicyError naming the entry."""
        env, decision, _ = self._decide(user, groups)
        return env, decision

    def _decide(self, user: str, groups: Iterable[Any]) -> Tuple[Dict[str, str], PodGpu, Dict[str, str]]:
        chosen, sources = choose_settings(self.caps, user, groups)
        pod_keys = {key: value for key, value in chosen.items() if key in POD_KEYS}
        where = f"the settings of user {user!r} (" + ", ".join(f"{k} from {sources[k]}" for k in pod_keys) + ")"
        check_way(self.way, pod_keys, where)
        if self.way == KAI and "kai_queue" not in chosen:
            raise PolicyError(f"user {user!r} has no kai_queue: with the 'kai' way every pod goes to a KAI queue")
        return environment_of(chosen, sources, user), pod_gpu(chosen, sources, self.names), chosen

    def pre_spawn_hook(self, previous: Optional[Callable] = None) -> Callable:
        """Runs `previous` (the admin's hook), then sets environment, extra_resource_limits and
        extra_resource_guarantees, extra_annotations from the policy."""

        def apply(spawner) -> None:
            env, decision, chosen = self._decide(spawner.user.name, getattr(spawner.user, "groups", ()))
            set_spawner_environment(spawner, env)
            base = _base_of(spawner)
            limits = merge_limits(base["extra_resource_limits"], decision, self.names)
            spawner.extra_resource_limits = limits
            spawner.extra_resource_guarantees = align_requests(base["extra_resource_guarantees"], limits, self.names)
            annotations = dict(base["extra_annotations"])
            if decision.no_gpu:
                for name in ANNOTATION_OF.values():
                    annotations.pop(name, None)  # no GPU: no GPU scheduling hints either
            annotations.update(decision.annotations)
            spawner.extra_annotations = annotations
            spawner._gpu_quota_pod = decision
            spawner._gpu_quota_chosen = chosen
            spawner.log.info("gpu-quota-ext: pod of %s (%s): %s", spawner.user.name, self.way, decision.describe())

        return chain_hooks(previous, apply)

    def modify_pod_hook(self, previous: Optional[Callable] = None) -> Callable:
        """Runs `previous`, then holds the finished pod to the policy and writes it the way's objects."""

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
            notes = await self.settle_pod(spawner, pod, decision, getattr(spawner, "_gpu_quota_chosen", {}))
            for note in notes:
                spawner.log.warning("gpu-quota-ext: pod of %s: %s", spawner.user.name, note)
            return pod

        return settle

    async def settle_pod(self, spawner, pod, decision: PodGpu, chosen: Mapping[str, str]) -> List[str]:
        """The finished pod held to `decision` and written the way's objects; the notes for the hub's log."""
        container = notebook_container(pod)
        resources = ensure_resources(container)
        annotations = dict(pod.metadata.annotations or {})
        limits: Dict[str, Any] = dict(resources.limits or {})
        notes: List[str] = []
        if self.way == KAI:
            limits, annotations, read = profile_limits(limits, annotations, container.name, self.names)
            notes += read
        limits, settled_notes = settle_limits(limits, decision, self.names)
        notes += settled_notes
        gpu = settled_gpu(limits, self.names)
        record: Dict[str, Any] = {"way": self.way, "container": container.name, **gpu.record()}
        if self.way == HAMI:
            for name, value in decision.annotations.items():
                if gpu.count == 0 and annotations.get(name) == value:
                    annotations.pop(name)  # the pod has no GPU: the policy's GPU hints mean nothing
                elif annotations.get(name) != value:
                    notes.append(
                        f"annotation {name}={annotations.get(name)!r} from the profile kept over the policy's {value!r}"
                    )
        elif self.way in DRA_WAYS:
            gpu_types = annotations.pop(GPU_TYPE_ANNOTATION, None) if gpu.count else None
            for name in ANNOTATION_OF.values():
                annotations.pop(name, None)  # HAMi's scheduler does not place a DRA pod
            limits = without_hami(limits, self.names)
            template = None
            if gpu.count:
                spec = claim_spec(DRIVERS[self.way], gpu, gpu_types, self.device_class)
                manifest = claim_template(self.way, spec, spawner.namespace)
                template = manifest["metadata"]["name"]
                record["claim"] = template
                await self.ensure_claim_template(spawner, manifest)
                spawner.log.info(
                    "gpu-quota-ext: pod of %s: claim %s: %s", spawner.user.name, template, describe_claim(spec)
                )
            set_claim(pod, container, template, REQUEST, POD_CLAIM)
        else:  # KAI
            limits = without_hami(limits, self.names)
            if gpu.count and gpu.memory_mib is None and gpu.percent is None:
                limits[WHOLE_GPUS] = str(gpu.count)  # whole GPUs: KAI schedules the device plugin's resource
            if gpu.cores is not None:
                notes.append(f"{self.names.cores} {gpu.cores} dropped: KAI schedules GPU memory, not a compute share")
            annotations.update(kai_annotations(gpu, container.name))
            pod.spec.scheduler_name = self.kai_names.scheduler_name
            labels = dict(pod.metadata.labels or {})
            labels[self.kai_names.queue_label] = chosen["kai_queue"]
            pod.metadata.labels = labels
        resources.limits = limits or None
        resources.requests = align_requests(resources.requests or {}, limits, self.names) or None
        pod.metadata.annotations = annotations
        set_record(pod, record)
        mount_pod_info(pod, container)
        return notes

    async def ensure_claim_template(self, spawner, manifest: Dict[str, Any]) -> None:
        """Create the template in the pod's namespace through KubeSpawner's API client; one that exists (its name
        is its content's hash) is the same template."""
        key = (manifest["metadata"]["namespace"], manifest["metadata"]["name"])
        from kubernetes_asyncio.client import ApiException, ResourceV1Api

        api = ResourceV1Api(spawner.api.api_client)
        try:
            await asyncio.wait_for(
                api.create_namespaced_resource_claim_template(key[0], manifest),
                getattr(spawner, "k8s_api_request_timeout", 10),
            )
        except ApiException as error:
            if error.status != 409:  # 409: it exists, with this very content
                raise ClaimTemplateError(_template_problem(key, error.status, error.reason)) from None
        except asyncio.TimeoutError:
            raise ClaimTemplateError(_template_problem(key, None, "no answer in time")) from None


def _template_problem(key: Tuple[str, str], status: Optional[int], reason: Any) -> str:
    namespace, name = key
    hint = (
        f"the hub's ServiceAccount may not create resourceclaimtemplates (resource.k8s.io) in namespace "
        f"{namespace!r}: apply the Role and RoleBinding of the docs (Kubernetes, the DRA ways)"
        if status == 403
        else "is the cluster on Kubernetes 1.34 or newer (resource.k8s.io/v1) with DRA on?"
    )
    return f"gpu-quota-ext: could not create ResourceClaimTemplate {namespace}/{name} ({status or ''} {reason}): {hint}"


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


def kube_gpu(
    *,
    way: str = HAMI,
    resource_names: Optional[Mapping[str, str]] = None,
    kai_names: Optional[Mapping[str, str]] = None,
    device_class: Optional[str] = None,
    **mapping: Any,
) -> KubeGpu:
    """Validate the mapping, pod keys included (raises PolicyError naming the first bad entry).

    `way`: "hami" (HAMi's device plugin, the default), "hami-dra", "kai" or "nvidia-dra"; `mapping`: hub_caps's
    keywords (users, groups, default, property_key), whose entries may also hold the pod keys (keys.POD_KEYS)
    that way reads; `resource_names`: HAMi's resource names where a cluster renamed them; `kai_names`: KAI's
    scheduler_name and queue_label; `device_class`: a DRA way's DeviceClass, where the cluster has its own."""
    if way not in WAYS:
        raise PolicyError(f"way={way!r}: one of {', '.join(repr(w) for w in WAYS)}")
    try:
        names = HamiResources(**dict(resource_names or {}))
    except TypeError:
        raise PolicyError(
            f"resource_names = {resource_names!r}: known keys are count, memory, memory_percentage, cores"
        ) from None
    try:
        kai_config = KaiNames(**dict(kai_names or {}))
    except TypeError:
        raise PolicyError(f"kai_names = {kai_names!r}: known keys are scheduler_name, queue_label") from None
    if device_class is not None and (way not in DRA_WAYS or not isinstance(device_class, str) or not device_class):
        raise PolicyError(f"device_class={device_class!r}: a DeviceClass name, for the DRA ways only")
    caps = hub_caps(**mapping, extra_keys=POD_KEYS)
    for where, settings in (
        [("default", caps.default)]
        + [(f"groups[{n!r}]", s) for n, s in caps.groups]
        + [(f"users[{n!r}]", s) for n, s in caps.users.items()]
    ):
        check_way(way, settings, where)
    return KubeGpu(caps=caps, way=way, names=names, kai_names=kai_config, device_class=device_class)


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
