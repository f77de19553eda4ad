"""Which way the cluster gave this pod its GPU share, and the share: the one decision over the readers beside it.

Pure: takes the server's environment and the pod's annotations (downward.py parses the file; the inventory
reads it), returns the share and, when the hub asked for a share the container does not show, one warning.

The evidence, strongest first (an enforcing layer before a figure nothing enforces):
1. `NVIDIA_GPU_MEMORY_LIMITS` (kai-gpu-fractioning; the NVIDIA driver enforces it) -> KAI;
2. HAMi-core's `CUDA_DEVICE_MEMORY_LIMIT*` (hami.py): HAMi's device plugin, HAMi's DRA driver (CDI), or KAI's
   hamicore plugin with KAI-resource-isolator; which one, the hub's record says, else the variables' own signs;
3. the hub's record of an NVIDIA DRA claim with an MPS limit (nvidia_dra.py);
4. KAI's annotations or GPU_PORTION (kai.py), enforced by nothing in the container.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Tuple

from .downward import pod_record
from .hami import read_pod_share as read_hami
from .kai import asks_share, read_annotations, read_fractioning
from .nvidia_dra import read_claim_share
from .share import HAMI, HAMI_DRA, KAI, NVIDIA_DRA, WAY_LABEL, PodShare

DEFAULT_CONTAINER = "notebook"  # KubeSpawner's container name
_EVIDENCE = {
    HAMI: "no CUDA_DEVICE_MEMORY_LIMIT variables (HAMi's device plugin sets them)",
    HAMI_DRA: "no CUDA_DEVICE_MEMORY_LIMIT variables (HAMi's DRA driver sets them through CDI)",
    KAI: "no KAI annotation, GPU_PORTION, NVIDIA_GPU_MEMORY_LIMITS or CUDA_DEVICE_MEMORY_LIMIT",
    NVIDIA_DRA: "no MPS memory limit in the hub's record",
}


def read_share(
    env: Mapping[str, str], annotations: Optional[Mapping[str, str]] = None
) -> Tuple[Optional[PodShare], Optional[str]]:
    """(the pod's share or None, a warning or None). Raises PolicyError naming a value no reader can read."""
    record = pod_record(annotations)
    asked = record.get("way") if record else None
    container = str(record.get("container") or DEFAULT_CONTAINER) if record else DEFAULT_CONTAINER
    share = read_fractioning(env)
    if share is not None:
        return share, None
    share = read_hami(env)
    if share is not None:
        if asked == KAI or (asked is None and asks_share(annotations)):
            return dataclasses.replace(share, way=KAI, enforcer="HAMi-core (KAI-resource-isolator)"), None
        if asked in (HAMI, HAMI_DRA):
            share = dataclasses.replace(share, way=asked)
        return share, None
    if asked == NVIDIA_DRA:
        share = read_claim_share(env, record)
        if share is not None or not (record or {}).get("gpu_memory"):
            return share, None
    share = read_annotations(env, annotations, container)
    if share is not None:
        return share, None
    if record and record.get("gpu_memory") and asked in _EVIDENCE:
        return None, (
            f"the hub asked {WAY_LABEL[asked]} for gpu_memory {record['gpu_memory']} but this container shows "
            f"{_EVIDENCE[asked]}: each GPU's whole memory is the budget"
        )
    return None, None
