"""A pod's share of its GPUs, whichever way the cluster gave it: the type every reader returns, what each
device becomes under it, and the one line the log and the status say about it.

Pure: no environment, no file, no clock. The readers beside it (hami.py, kai.py, nvidia_dra.py, chosen among
by pod_share.py) turn what the cluster put in the container into a `PodShare`; `share_devices` makes each
device's total the pod's share of it (never more than the device has) and records on the device where that
figure came from (`DeviceShare`, the status answer's `share` field of each device).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Mapping, Optional, Tuple

from ..shared.sizes import MiB, format_bytes

if TYPE_CHECKING:  # only the type: device.py is the one place Device is defined
    from .device import Device

# The ways a cluster gives a pod part of a GPU (the hub's `way` setting names the same four).
HAMI, HAMI_DRA, KAI, NVIDIA_DRA = "hami", "hami-dra", "kai", "nvidia-dra"
WAYS = (HAMI, HAMI_DRA, KAI, NVIDIA_DRA)
# How a device's name shows the share (the sidebar lists devices by name).
WAY_LABEL = {HAMI: "HAMi", HAMI_DRA: "HAMi-DRA", KAI: "KAI", NVIDIA_DRA: "NVIDIA DRA"}
# The scope of a limit: the pod's processes together (HAMi-core's shared file, a driver limit per container),
# or each process alone (an MPS pinned-memory limit is per MPS client).
POD, PROCESS = "pod", "process"


@dataclass(frozen=True)
class DeviceShare:
    """Where a device's total came from when it is a pod's share (the status answer shows it per device)."""

    way: str  # one of WAYS
    bytes: int  # the share on this device: the device's total in the status answer
    source: str  # what was read, e.g. "CUDA_DEVICE_MEMORY_LIMIT_0=20480m" or "annotation gpu-memory=10240"
    enforced_by: Optional[str]  # who holds the pod to it ("HAMi-core", "the NVIDIA driver", "MPS"); None: nobody
    scope: str = POD  # POD or PROCESS

    def to_json(self) -> dict:
        return {
            "way": self.way,
            "bytes": self.bytes,
            "source": self.source,
            "enforced_by": self.enforced_by,
            "scope": self.scope,
        }


@dataclass(frozen=True)
class PodShare:
    """The GPU memory the cluster allows this container, per device index (in bytes), and where it was read.

    A device's limit is its own entry, else `every_device`, else `fraction` of the device's total (KAI's
    gpu-fraction), else none.
    """

    per_device: Mapping[int, int] = field(default_factory=dict)
    every_device: Optional[int] = None
    sources: Mapping[int, str] = field(default_factory=dict)  # index -> what it came from
    fallback_source: Optional[str] = None  # for every_device / fraction
    sm_limit: Optional[str] = None  # percent of compute, as written; informative only
    sm_name: str = "CUDA_DEVICE_SM_LIMIT"  # where sm_limit was read
    enforced: bool = True  # False: the layer that would hold the pod to it is off or absent
    off_reason: Optional[str] = None  # why not enforced, in words
    way: str = HAMI
    enforcer: Optional[str] = "HAMi-core"  # who enforces when `enforced`
    fraction: Optional[float] = None  # of each device's total, where no byte limit applies
    scope: str = POD
    at_limit: str = "the allocation fails (CUDA out of memory) in the process that asked"

    def limit_for(self, index: int, total: Optional[int] = None) -> Optional[int]:
        """Bytes allowed on device `index` (of `total` bytes, for a fraction), or None (no limit there)."""
        if index in self.per_device:
            return self.per_device[index]
        if self.every_device is not None:
            return self.every_device
        if self.fraction is not None and total is not None:
            return int(total * self.fraction) // MiB * MiB  # whole MiB, never more than the fraction
        return None

    def source_for(self, index: int) -> Optional[str]:
        if index in self.sources:
            return self.sources[index]
        return self.fallback_source if (self.every_device is not None or self.fraction is not None) else None

    @property
    def enforced_by(self) -> Optional[str]:
        return self.enforcer if self.enforced else None

    @property
    def label(self) -> str:
        return WAY_LABEL.get(self.way, self.way)


def share_mark(way: str) -> str:
    return f"{WAY_LABEL.get(way, way)} share"


def share_devices(devices: List["Device"], share: PodShare) -> Tuple[List["Device"], List[str]]:
    """Each device with the pod's share as its total (never more than NVML's total), and one line per device.

    Indexes are positions in the server's device list, which is what CUDA numbers them in the server and
    what a per-device variable's `_<i>` suffix means for a process with the same CUDA_VISIBLE_DEVICES.
    A device that already carries a share (an inventory wrapping one that applied it) is left as it is.
    """
    shared: List["Device"] = []
    lines: List[str] = []
    for device in devices:
        limit = share.limit_for(device.index, device.total)
        if limit is None or device.share is not None:
            shared.append(device)
            if limit is None:
                lines.append(
                    f"{device.index}: {device.name}, no {share.label} limit: the whole {format_bytes(device.total)}"
                )
            continue
        total = min(limit, device.total)
        if device.total > limit:
            seen = f"the GPU has {format_bytes(device.total)} (this process's NVML is not limited to the share)"
        elif device.total == limit:
            seen = "NVML already reports the share (HAMi-core is loaded in this process)"
        else:
            seen = f"the GPU has only {format_bytes(device.total)}: that is the budget"
        source = share.source_for(device.index) or share.label
        lines.append(f"{device.index}: {device.name}, budget {format_bytes(total)} from {source}; {seen}")
        shown = DeviceShare(way=share.way, bytes=total, source=source, enforced_by=share.enforced_by, scope=share.scope)
        shared.append(
            dataclasses.replace(device, name=f"{device.name} ({share_mark(share.way)})", total=total, share=shown)
        )
    return shared, lines


def describe_share(share: PodShare) -> str:
    """One line for the server log: where the share comes from, who enforces it, what happens at the limit."""
    scope = "each process's limit" if share.scope == PROCESS else "the pod's total"
    if share.enforced:
        enforcer = (
            f"{share.enforcer} enforces {scope}; at the limit {share.at_limit}; this extension splits it among kernels"
        )
    else:
        why = share.off_reason or f"{share.enforcer or 'no enforcing layer'} is not there"
        enforcer = f"{why}, nothing below this extension enforces {scope}"
    sm = f", {share.sm_name}={share.sm_limit}" if share.sm_limit not in (None, "", "0") else ""
    return f"{share.label} pod share{sm}: {enforcer}"
