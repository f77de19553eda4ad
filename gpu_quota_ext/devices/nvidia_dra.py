"""NVIDIA's DRA driver for GPUs inside a container: the claim's MPS memory limit, as far as a container can know it.

Pure: reads the environment mapping and the hub's record (downward.py); no I/O.

What the driver gives a container whose claim has an MPS `GpuConfig` (kubernetes-sigs/dra-driver-nvidia-gpu,
formerly NVIDIA/k8s-dra-driver-gpu: cmd/gpu-kubelet-plugin/sharing.go, templates/mps-control-daemon.tmpl.yaml):
its GPUs, `CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps` and the pipe folder of an MPS control daemon that the driver
starts for that claim alone. The daemon runs `set_default_device_pinned_mem_limit <device> <MiB>M` from
`mpsConfig.defaultPinnedDeviceMemoryLimit`: a limit on each MPS client, that is on each process, not on the
processes together. Nothing in the container states the figure, and CUDA and NVML still report the whole GPU
under an MPS limit (measured on an H200). So the figure comes from the hub's record of the claim it made
(annotation gpu-quota-ext/pod-gpu, through the downward API), and the pipe variable says whether MPS holds it.
"""

from __future__ import annotations

from typing import Mapping, Optional

from ..shared.sizes import GiB, MiB, PolicyError
from .share import NVIDIA_DRA, PROCESS, PodShare

PIPE_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY"
ENFORCER = "MPS (the claim's control daemon, per process)"
AT_LIMIT = "the allocation fails in the process that asked (each process has the whole limit)"
OFF = (
    "no CUDA_MPS_PIPE_DIRECTORY in this container: the claim was prepared without MPS (the driver's MPSSupport "
    "feature gate?)"
)
_UNITS = {"Mi": MiB, "Gi": GiB}


def record_bytes(text: object, where: str) -> int:
    """The record's memory, as the hub writes it ("10240Mi") -> bytes."""
    value = str(text).strip()
    unit = value[-2:]
    if unit not in _UNITS or not value[:-2].isdigit() or int(value[:-2]) < 1:
        raise PolicyError(f"{where}: gpu_memory={text!r} is not a size the hub writes ('10240Mi')")
    return int(value[:-2]) * _UNITS[unit]


def read_claim_share(env: Mapping[str, str], record: Optional[Mapping[str, object]]) -> Optional[PodShare]:
    """Each process's limit on each of the claim's GPUs, or None when the claim asked for whole GPUs."""
    if not record or record.get("way") != NVIDIA_DRA or not record.get("gpu_memory"):
        return None
    nbytes = record_bytes(record["gpu_memory"], "annotation gpu-quota-ext/pod-gpu")
    piped = bool(str(env.get(PIPE_VARIABLE, "")).strip())
    claim = record.get("claim") or "the pod's claim"
    return PodShare(
        every_device=nbytes,
        fallback_source=f"the MPS limit of {claim} ({record['gpu_memory']}), from annotation gpu-quota-ext/pod-gpu",
        way=NVIDIA_DRA,
        enforced=piped,
        enforcer=ENFORCER,
        off_reason=None if piped else OFF,
        scope=PROCESS,
        at_limit=AT_LIMIT,
    )
