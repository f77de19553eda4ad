"""HAMi inside a container: the pod's share of each GPU, read from the environment HAMi gives it (through its
device plugin, or through its DRA driver's CDI edits: the same variables).

Pure: reads a mapping (the server's environment), returns sizes and devices; no I/O.

What HAMi puts in a container that asked for `nvidia.com/gpumem` or `nvidia.com/gpumem-percentage`
(Project-HAMi/HAMi, the NVIDIA device plugin's Allocate, pkg/device-plugin/nvidiadevice/nvinternal/plugin/
server.go):
- `CUDA_DEVICE_MEMORY_LIMIT_<i>` = "<MiB>m" for the container's i-th GPU (the scheduler turns a
  percentage into MiB before this point, so the variable is always in MiB);
- `CUDA_DEVICE_SM_LIMIT` = the `nvidia.com/gpucores` percentage (0: no limit);
- `CUDA_DEVICE_MEMORY_SHARED_CACHE` = a file that every process of the container maps;
- HAMi-core (libvgpu.so) mounted and listed in /etc/ld.so.preload, unless the container's own
  environment sets `CUDA_DISABLE_CONTROL=true` (HAMi's docs: "no resource isolation", for debugging).

How HAMi-core reads them (Project-HAMi/HAMi-core, src/multiprocess/multiprocess_memory_limit.c):
`CUDA_DEVICE_MEMORY_LIMIT_<i>` for CUDA device i, else `CUDA_DEVICE_MEMORY_LIMIT` for every device; a
last letter g/m/k (either case) multiplies by 1024^3, 1024^2, 1024 ("m" is MiB here, unlike "MB" in
our own sizes); 0 means no limit. The first process of the container to use CUDA or NVML writes the
limits into the shared file; every later process counts against that same total, and a process whose own
variables differ only gets "Limit inconsistency detected" in its log. So the limit is the pod's, for
all its processes together: a kernel must inherit these variables unchanged. Giving a kernel its own
`CUDA_DEVICE_MEMORY_LIMIT*` either does nothing or, if that kernel is the first to start CUDA, becomes
the limit of the whole pod; giving it its own shared file takes its memory out of the pod's total.

What NVML and CUDA report inside such a container: HAMi-core hooks `nvmlDeviceGetMemoryInfo` (total =
the limit, used = the container's usage; src/nvml/hook.c) and `cuDeviceTotalMem` (the limit;
src/cuda/device.c) in every process it is preloaded into, the Jupyter server's included. So the
server's NVML may already show the share; with CUDA_DISABLE_CONTROL=true (or the library missing) it
shows the whole GPU. Either way the share is min(NVML's total, the variable), and that is what this
module makes each device's total. It is also what torch sees as `total_memory` under HAMi-core, so a
fraction cap written against the share means the same bytes inside the kernel.

HAMi's DRA driver (Project-HAMi/k8s-dra-driver, `hami-core-gpu.project-hami.io`: cmd/hami-kubelet-plugin/
hami_core.go) gives a container that holds a claim the same HAMi-core through CDI: `CUDA_DEVICE_MEMORY_LIMIT_<i>`
= the claim's consumed `memory` capacity in MiB ("<MiB>m"), `CUDA_DEVICE_SM_LIMIT_<i>` = its `cores`, and a
`CUDA_DEVICE_MEMORY_SHARED_CACHE` under `<hook path>/vgpu/claims/<claim uid>/`. Either sign says the share came
through a DRA claim; the reading is the same.
"""

from __future__ import annotations

import re
from typing import Dict, Mapping, Optional

from ..shared.sizes import GiB, KiB, MiB, PolicyError
from .share import HAMI, HAMI_DRA, PodShare, describe_share, share_devices

__all__ = [
    "LIMIT_VARIABLE", "SM_LIMIT_VARIABLE", "DISABLE_VARIABLE", "CACHE_VARIABLE", "MAX_DEVICES", "SHARE_MARK",
    "PodShare", "parse_hami_size", "read_pod_share", "share_devices", "describe_share",
]

LIMIT_VARIABLE = "CUDA_DEVICE_MEMORY_LIMIT"
SM_LIMIT_VARIABLE = "CUDA_DEVICE_SM_LIMIT"
DISABLE_VARIABLE = "CUDA_DISABLE_CONTROL"
CACHE_VARIABLE = "CUDA_DEVICE_MEMORY_SHARED_CACHE"
# HAMi-core keeps limits for this many CUDA devices (CUDA_DEVICE_MAX_COUNT).
MAX_DEVICES = 16
SHARE_MARK = "HAMi share"
DRA_CACHE_FOLDER = "/vgpu/claims/"  # where HAMi's DRA driver puts a claim's shared cache file

_HAMI_SIZE_RE = re.compile(r"^([0-9]+)([gGmMkK]?)$")
_SCALE = {"": 1, "k": KiB, "m": MiB, "g": GiB}


def parse_hami_size(text: str, name: str) -> int:
    """A HAMi-core limit ("20480m", "20g", "1048576k", "21474836480") -> bytes; 0 means no limit.

    Only the forms HAMi's device plugin writes and HAMi-core reads the same way are accepted. HAMi-core
    would read "1.5g" as 1 GiB and "abc" as no limit: rather than guess along, say so.
    """
    value = text.strip()
    match = _HAMI_SIZE_RE.match(value)
    if not match:
        raise PolicyError(
            f"{name}={text!r}: not a size HAMi-core reads as written; HAMi writes whole MiB such as '20480m' "
            "(a number with an optional g, m or k: GiB, MiB, KiB)"
        )
    nbytes = int(match.group(1)) * _SCALE[match.group(2).lower()]
    if nbytes and nbytes < MiB:
        raise PolicyError(f"{name}={text!r}: {nbytes} bytes is less than 1 MiB; no GPU job fits in that")
    return nbytes


def _per_device(name: str, prefix: str) -> Optional[int]:
    """The device index of `PREFIX_<i>`, or None when `name` is not HAMi-core's variable for a device."""
    if not name.startswith(prefix + "_"):
        return None
    suffix = name[len(prefix) + 1:]
    if not suffix.isdigit() or int(suffix) >= MAX_DEVICES:
        return None  # HAMi-core reads indexes 0..15 only; anything else is not its variable
    return int(suffix)


def read_pod_share(env: Mapping[str, str]) -> Optional[PodShare]:
    """The HAMi limits in `env` (the server's environment), or None when HAMi set none.

    Raises PolicyError naming the variable when a value is not one HAMi-core reads as written.
    """
    per_device: Dict[int, int] = {}
    sources: Dict[int, str] = {}
    every_device: Optional[int] = None
    fallback_source: Optional[str] = None
    per_device_sm: Dict[int, str] = {}
    for name in sorted(env):
        if name == LIMIT_VARIABLE:
            nbytes = parse_hami_size(env[name], name)
            if nbytes:
                every_device, fallback_source = nbytes, f"{name}={env[name].strip()}"
            continue
        sm_index = _per_device(name, SM_LIMIT_VARIABLE)
        if sm_index is not None:
            per_device_sm[sm_index] = env[name].strip()
            continue
        index = _per_device(name, LIMIT_VARIABLE)
        if index is None:
            continue
        nbytes = parse_hami_size(env[name], name)
        if nbytes:  # 0: HAMi-core falls back to CUDA_DEVICE_MEMORY_LIMIT for that device
            per_device[index] = nbytes
            sources[index] = f"{name}={env[name].strip()}"
    if not per_device and every_device is None:
        return None
    disabled = str(env.get(DISABLE_VARIABLE, "")).strip().lower() in ("1", "t", "true", "yes", "on")
    through_dra = bool(per_device_sm) or DRA_CACHE_FOLDER in str(env.get(CACHE_VARIABLE, ""))
    sm_name, sm_limit = SM_LIMIT_VARIABLE, env.get(SM_LIMIT_VARIABLE)
    if sm_limit is None and per_device_sm:
        first = min(per_device_sm)
        sm_name, sm_limit = f"{SM_LIMIT_VARIABLE}_{first}", per_device_sm[first]
    return PodShare(
        per_device=per_device,
        every_device=every_device,
        sources=sources,
        fallback_source=fallback_source,
        sm_limit=sm_limit,
        sm_name=sm_name,
        enforced=not disabled,
        off_reason=f"{DISABLE_VARIABLE}=true: HAMi-core is off in this container" if disabled else None,
        way=HAMI_DRA if through_dra else HAMI,
        enforcer="HAMi-core",
    )
