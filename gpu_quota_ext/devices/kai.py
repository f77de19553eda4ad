"""KAI Scheduler's GPU fractions inside a container: the pod's share, from its annotations (the downward API
file) and from what KAI's node parts put in the environment.

Pure: reads a mapping (the environment) and the parsed annotations; no I/O.

What a fractional pod carries (kai-scheduler/KAI-Scheduler, pkg/common/constants, docs/gpu-sharing):
- annotation `gpu-memory` = MiB of one GPU (an integer, no unit), or `gpu-fraction` = a portion ("0.5"), with
  `gpu-fraction-num-devices` for several GPUs and `gpu-fraction-container-name` for the container that gets them;
  KAI schedules by them, and "does not enforce memory allocation limits" by itself;
- environment from KAI's binder (a ConfigMap it fills at bind time): `GPU_PORTION` (the portion it reserved),
  and with its `hamicore` binder plugin and Project-HAMi/KAI-resource-isolator, `CUDA_DEVICE_MEMORY_LIMIT` =
  portion x the node's GPU memory label, in MiB, which HAMi-core enforces (hami.py reads it);
- with kai-scheduler/kai-gpu-fractioning (NVIDIA driver r615 or newer, NRI), per-container annotations
  `nvidia.com/container.<name>.gpu-memory.limit` / `.request` (Kubernetes quantities) become
  `NVIDIA_GPU_MEMORY_LIMITS` / `NVIDIA_GPU_MEMORY_REQUESTS` (whole MiB) in the container, with an MPS pipe:
  the driver enforces the limit, and "a container that exceeds its limit is terminated (out-of-memory)".
So the share is, first found: NVIDIA_GPU_MEMORY_LIMITS (enforced by the driver), the per-container limit
annotation, `gpu-memory`, `gpu-fraction`, `GPU_PORTION` (none of these last four enforced without one of the
two enforcing layers).
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

from ..shared.sizes import GiB, KiB, MiB, PolicyError
from .share import KAI, PodShare

FRACTIONING_LIMIT = "NVIDIA_GPU_MEMORY_LIMITS"
PORTION_VARIABLE = "GPU_PORTION"
GPU_MEMORY = "gpu-memory"
GPU_FRACTION = "gpu-fraction"
NUM_DEVICES = "gpu-fraction-num-devices"
CONTAINER_NAME = "gpu-fraction-container-name"
CONTAINER_PREFIX = "nvidia.com/container."
DRIVER = "the NVIDIA driver (r615+ memory limit, kai-gpu-fractioning)"
DRIVER_AT_LIMIT = "the container is ended (out of memory) and every kernel with it"
NOT_ENFORCED = "KAI schedules by it; no NVIDIA_GPU_MEMORY_LIMITS and no HAMi-core limit in this container"

_QUANTITY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_QUANTITY_SCALE = {
    None: 1,
    "Ki": KiB,
    "Mi": MiB,
    "Gi": GiB,
    "Ti": 1024 * GiB,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def container_limit_annotation(container: str) -> str:
    """kai-gpu-fractioning's per-container limit annotation for `container`."""
    return f"{CONTAINER_PREFIX}{container}.gpu-memory.limit"


def container_request_annotation(container: str) -> str:
    return f"{CONTAINER_PREFIX}{container}.gpu-memory.request"


def parse_quantity(text: str, name: str) -> int:
    """A whole Kubernetes quantity ("8Gi", "8192Mi", "1G", "1048576") -> bytes, at least 1 MiB."""
    match = _QUANTITY.match(text.strip())
    if not match:
        raise PolicyError(f"{name}={text!r}: not a whole Kubernetes quantity such as '8Gi' or '8192Mi'")
    nbytes = int(match.group(1)) * _QUANTITY_SCALE[match.group(2)]
    if nbytes < MiB:
        raise PolicyError(f"{name}={text!r}: less than 1 MiB; no GPU job fits in that")
    return nbytes


def _whole_mib(text: str, name: str) -> int:
    value = text.strip()
    if not value.isdigit() or int(value) < 1:
        raise PolicyError(f"{name}={text!r}: KAI writes whole MiB here, at least 1")
    return int(value) * MiB


def _fraction(text: str, name: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise PolicyError(f"{name}={text!r}: not a portion of a GPU such as '0.5'") from None
    if not 0 < value <= 1:
        raise PolicyError(f"{name}={text!r}: a portion of one GPU is above 0 and at most 1")
    return value


def read_fractioning(env: Mapping[str, str]) -> Optional[PodShare]:
    """kai-gpu-fractioning's driver-enforced limit in `env`, or None."""
    if FRACTIONING_LIMIT not in env:
        return None
    nbytes = _whole_mib(env[FRACTIONING_LIMIT], FRACTIONING_LIMIT)
    return PodShare(
        every_device=nbytes,
        fallback_source=f"{FRACTIONING_LIMIT}={env[FRACTIONING_LIMIT].strip()}",
        way=KAI,
        enforcer=DRIVER,
        at_limit=DRIVER_AT_LIMIT,
    )


def asks_share(annotations: Optional[Mapping[str, str]]) -> bool:
    """Whether the pod carries KAI's fraction annotations."""
    return bool(annotations) and (GPU_MEMORY in annotations or GPU_FRACTION in annotations)  # type: ignore[operator]


def _scheduled(source: str, nbytes: Optional[int] = None, fraction: Optional[float] = None) -> PodShare:
    """A share KAI scheduled the pod for, that nothing in the container enforces."""
    return PodShare(
        every_device=nbytes,
        fraction=fraction,
        fallback_source=source,
        way=KAI,
        enforced=False,
        enforcer=None,
        off_reason=NOT_ENFORCED,
    )


def read_annotations(
    env: Mapping[str, str], annotations: Optional[Mapping[str, str]], container: str = "notebook"
) -> Optional[PodShare]:
    """The share KAI scheduled this pod for, from its annotations (or GPU_PORTION), not enforced; or None."""
    annotations = annotations or {}
    limit_name = container_limit_annotation(container)
    if limit_name in annotations:
        nbytes = parse_quantity(annotations[limit_name], limit_name)
        return _scheduled(f"annotation {limit_name}={annotations[limit_name]}", nbytes=nbytes)
    if GPU_MEMORY in annotations:
        nbytes = _whole_mib(annotations[GPU_MEMORY], GPU_MEMORY)
        return _scheduled(f"annotation {GPU_MEMORY}={annotations[GPU_MEMORY]}", nbytes=nbytes)
    if GPU_FRACTION in annotations:
        fraction = _fraction(annotations[GPU_FRACTION], GPU_FRACTION)
        return _scheduled(f"annotation {GPU_FRACTION}={annotations[GPU_FRACTION]}", fraction=fraction)
    if PORTION_VARIABLE in env:
        fraction = _fraction(env[PORTION_VARIABLE], PORTION_VARIABLE)
        if fraction < 1:  # a whole GPU is no share
            return _scheduled(f"{PORTION_VARIABLE}={env[PORTION_VARIABLE].strip()}", fraction=fraction)
    return None
