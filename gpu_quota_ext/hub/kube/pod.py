"""Edits on the pod KubeSpawner built (a kubernetes_asyncio V1Pod), made in its modify_pod_hook: the claim, the
downward API file the server reads its share from, the hub's record. Every edit merges into what KubeSpawner
and the admin's own hooks put there; none replaces a list or the container's resources.

Why a hook on the finished pod: KubeSpawner has no trait for resource claims, and its `extra_container_config`
replaces the container's whole `resources` (the CPU and memory limits KubeSpawner set with it), while a
profile's `kubespawner_override` may still change volumes and annotations after the pre_spawn_hook.

No I/O; kubernetes_asyncio's model classes are imported when an edit runs (the hub has them: KubeSpawner does).
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

from ...devices import ANNOTATIONS_ITEM, POD_INFO_DIR, RECORD_ANNOTATION

POD_INFO_VOLUME = "gpu-quota-pod-info"
NOTEBOOK = "notebook"  # KubeSpawner's name for the user's server container


def notebook_container(pod):
    """The container that runs the user's server (KubeSpawner names it "notebook"; else the first)."""
    return next((c for c in pod.spec.containers if c.name == NOTEBOOK), pod.spec.containers[0])


def ensure_resources(container):
    from kubernetes_asyncio.client import V1ResourceRequirements

    if container.resources is None:
        container.resources = V1ResourceRequirements()
    return container.resources


def mount_pod_info(pod, container) -> None:
    """A downwardAPI volume with the pod's annotations at POD_INFO_DIR/ANNOTATIONS_ITEM, mounted read-only."""
    from kubernetes_asyncio.client import (
        V1DownwardAPIVolumeFile,
        V1DownwardAPIVolumeSource,
        V1ObjectFieldSelector,
        V1Volume,
        V1VolumeMount,
    )

    volume = V1Volume(
        name=POD_INFO_VOLUME,
        downward_api=V1DownwardAPIVolumeSource(
            items=[
                V1DownwardAPIVolumeFile(
                    path=ANNOTATIONS_ITEM, field_ref=V1ObjectFieldSelector(field_path="metadata.annotations")
                )
            ]
        ),
    )
    pod.spec.volumes = [v for v in (pod.spec.volumes or []) if _name(v) != POD_INFO_VOLUME] + [volume]
    mounts = [m for m in (container.volume_mounts or []) if _name(m) != POD_INFO_VOLUME]
    container.volume_mounts = mounts + [V1VolumeMount(name=POD_INFO_VOLUME, mount_path=POD_INFO_DIR, read_only=True)]


def set_record(pod, record: Dict[str, Any]) -> None:
    """The hub's record of the pod's GPU, as an annotation (devices.downward reads it in the pod)."""
    annotations = dict(pod.metadata.annotations or {})
    annotations[RECORD_ANNOTATION] = json.dumps(record, sort_keys=True, separators=(",", ":"))
    pod.metadata.annotations = annotations


def set_claim(pod, container, template: Optional[str], request: str, claim: str) -> None:
    """The pod's claim `claim` made from `template`, used by `container` for `request`; None: no such claim.

    Other claims (a profile's or the admin's own) stay as they are."""
    from kubernetes_asyncio.client import CoreV1ResourceClaim, V1PodResourceClaim

    claims = [c for c in (pod.spec.resource_claims or []) if _name(c) != claim]
    if template is not None:
        claims.append(V1PodResourceClaim(name=claim, resource_claim_template_name=template))
    pod.spec.resource_claims = claims or None
    resources = ensure_resources(container)
    used = [c for c in (resources.claims or []) if _name(c) != claim]
    if template is not None:
        used.append(CoreV1ResourceClaim(name=claim, request=request))
    resources.claims = used or None


def _name(item: Any) -> Optional[str]:
    return item.get("name") if isinstance(item, dict) else getattr(item, "name", None)
