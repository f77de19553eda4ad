"""HAMi inside a container: the pod's share of each GPU, read from the environment HAMi gives it.

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
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Tuple

from ..shared.sizes import GiB, KiB, MiB, PolicyError, format_bytes

if TYPE_CHECKING:  # only the type: device.py is the one place Device is defined
    from .device import Device

LIMIT_VARIABLE = "CUDA_DEVICE_MEMORY_LIMIT"
SM_LIMIT_VARIABLE = "CUDA_DEVICE_SM_LIMIT"
DISABLE_VARIABLE = "CUDA_DISABLE_CONTROL"
# HAMi-core keeps limits for this many CUDA devices (CUDA_DEVICE_MAX_COUNT).
MAX_DEVICES = 16
SHARE_MARK = "HAMi share"

_HAMI_SIZE_RE = re.compile(r"^([0-9]+)([gGmMkK]?)$")
_SCALE = {"": 1, "k": KiB, "m": MiB, "g": GiB}


@dataclass(frozen=True)
class PodShare:
    """The GPU memory HAMi allows this container, per device index (in bytes), and where it was read."""

    per_device: Mapping[int, int] = field(default_factory=dict)  # CUDA_DEVICE_MEMORY_LIMIT_<i>
    every_device: Optional[int] = None  # CUDA_DEVICE_MEMORY_LIMIT
    sources: Mapping[int, str] = field(default_factory=dict)  # index -> "NAME=value" it came from
    fallback_source: Optional[str] = None
    sm_limit: Optional[str] = None  # percent, as written; informative only
    enforced: bool = True  # False: CUDA_DISABLE_CONTROL=true, HAMi-core is not loaded

    def limit_for(self, index: int) -> Optional[int]:
        """Bytes HAMi-core allows on device `index`, or None (no limit on that device)."""
        if index in self.per_device:
            return self.per_device[index]
        return self.every_device

    def source_for(self, index: int) -> Optional[str]:
        return self.sources.get(index, self.fallback_source if self.every_device is not None else None)


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


def read_pod_share(env: Mapping[str, str]) -> Optional[PodShare]:
    """The HAMi limits in `env` (the server's environment), or None when HAMi set none.

    Raises PolicyError naming the variable when a value is not one HAMi-core reads as written.
    """
    per_device: Dict[int, int] = {}
    sources: Dict[int, str] = {}
    every_device: Optional[int] = None
    fallback_source: Optional[str] = None
    for name in sorted(env):
        if name == LIMIT_VARIABLE:
            nbytes = parse_hami_size(env[name], name)
            if nbytes:
                every_device, fallback_source = nbytes, f"{name}={env[name].strip()}"
            continue
        if not name.startswith(LIMIT_VARIABLE + "_"):
            continue
        suffix = name[len(LIMIT_VARIABLE) + 1:]
        if not suffix.isdigit() or int(suffix) >= MAX_DEVICES:
            continue  # HAMi-core reads indexes 0..15 only; anything else is not its variable
        nbytes = parse_hami_size(env[name], name)
        if nbytes:  # 0: HAMi-core falls back to CUDA_DEVICE_MEMORY_LIMIT for that device
            per_device[int(suffix)] = nbytes
            sources[int(suffix)] = f"{name}={env[name].strip()}"
    if not per_device and every_device is None:
        return None
    disabled = str(env.get(DISABLE_VARIABLE, "")).strip().lower() in ("1", "t", "true", "yes", "on")
    return PodShare(
        per_device=per_device,
        every_device=every_device,
        sources=sources,
        fallback_source=fallback_source,
        sm_limit=env.get(SM_LIMIT_VARIABLE),
        enforced=not disabled,
    )


def share_devices(devices: List["Device"], share: PodShare) -> Tuple[List["Device"], List[str]]:
    """Each device with the pod's share as its total (never more than NVML's total), and one line per device.

    Indexes are positions in the server's device list, which is what CUDA numbers them in the server
    and what HAMi-core's `_<i>` suffixes mean for a process with the same CUDA_VISIBLE_DEVICES.
    A device already marked (an inventory wrapping one that applied the share) is left as it is.
    """
    shared: List["Device"] = []
    lines: List[str] = []
    for device in devices:
        limit = share.limit_for(device.index)
        if limit is None or SHARE_MARK in device.name:
            shared.append(device)
            if limit is None:
                lines.append(f"{device.index}: {device.name}, no HAMi limit: the whole {format_bytes(device.total)}")
            continue
        total = min(limit, device.total)
        if device.total > limit:
            seen = f"the GPU has {format_bytes(device.total)} (this process's NVML is not HAMi's)"
        elif device.total == limit:
            seen = "NVML already reports the share (HAMi-core is loaded in this process)"
        else:
            seen = f"the GPU has only {format_bytes(device.total)}: that is the budget"
        lines.append(f"{device.index}: {device.name}, budget {format_bytes(total)} from "
            f"{share.source_for(device.index)}; {seen}")
        shared.append(dataclasses.replace(device, name=f"{device.name} ({SHARE_MARK})", total=total))
    return shared, lines


def describe_share(share: PodShare) -> str:
    """One line for the server log: where the share comes from and who enforces it."""
    enforcer = (
        "HAMi-core enforces the pod's total; this extension splits it among kernels"
        if share.enforced
        else f"{DISABLE_VARIABLE}=true: HAMi-core is off in this container, nothing below this extension "
        "enforces the pod's total"
    )
    sm = f", {SM_LIMIT_VARIABLE}={share.sm_limit}" if share.sm_limit not in (None, "", "0") else ""
    return f"HAMi pod share{sm}: {enforcer}"
