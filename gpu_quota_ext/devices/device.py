"""The Device type, and CUDA_VISIBLE_DEVICES as CUDA reads it: the one place a device entry ("1",
"GPU-8f3c…", "MIG-…") is matched against a device.

Pure: no NVML, no environment of its own (callers pass the variable's value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence

if TYPE_CHECKING:  # only the type: share.py is where a pod's share is read
    from .share import DeviceShare


@dataclass(frozen=True)
class Device:
    """One GPU as the server sees it.

    Three numberings meet here, and only `index` is used between the server's parts:
    - `index`, the server's: the device's position in the list this server manages (after the server's own
      CUDA_VISIBLE_DEVICES). Grants, the ledger, the REST API, `%gpucap --device` and the sidebar use it.
    - `nvml_index`, NVML's: the driver's numbering of the whole machine (what `nvidia-smi` shows). Used
      only to read NVML and to match a kernelspec that pins CUDA_VISIBLE_DEVICES by number
      (`nvml_number`, which falls back to `index` where no NVML number is known: a static inventory).
    - the torch ordinal, the kernel's: `cuda:0`, `cuda:1`, ... inside a kernel, counting only what its own
      CUDA_VISIBLE_DEVICES shows (a placed kernel sees one GPU: its ordinal 0 is the server's `index` N).
      The kernel maps ordinals back to server indexes (kernel/usage.py) before it reports.
    The UUID names a device unambiguously across all three (and across servers: the host service's wire).
    """

    index: int
    name: str
    uuid: str
    total: int  # bytes, as NVML (or the static config) reports; inside a pod with a share of the GPU, the share
    nvml_index: Optional[int] = None
    share: Optional["DeviceShare"] = None  # set when `total` is a pod's share: where it came from, who enforces it

    @property
    def nvml_number(self) -> int:
        """The device's number in the machine's numbering (what a CUDA_VISIBLE_DEVICES digit names)."""
        return self.nvml_index if self.nvml_index is not None else self.index

    @property
    def cuda_id(self) -> str:
        """What to write into a kernel's CUDA_VISIBLE_DEVICES: the UUID when known (order-proof)."""
        return self.uuid if self.uuid.startswith(("GPU-", "MIG-")) else str(self.nvml_number)

    def matches(self, entry: str) -> bool:
        """Whether one CUDA_VISIBLE_DEVICES entry names this device: a number (the machine's numbering)
        or a UUID prefix. Whether a prefix is unambiguous is a question about all devices: `find_device`."""
        return int(entry) == self.nvml_number if entry.isdigit() else self.uuid.startswith(entry)


def find_device(devices: Sequence[Device], entry: str) -> Optional[Device]:
    """The device one CUDA_VISIBLE_DEVICES entry names, as CUDA decides: by number, or by a UUID prefix
    that matches exactly one device (an ambiguous prefix names none)."""
    found = [device for device in devices if device.matches(entry)]
    return found[0] if len(found) == 1 or (found and entry.isdigit()) else None


def parse_cuda_visible_devices(value: Optional[str]) -> Optional[List[str]]:
    """`CUDA_VISIBLE_DEVICES` as CUDA reads it: None when unset (all devices), else the entries it keeps.

    CUDA stops at the first invalid entry ("0,1,-1,2" is "0,1"); an empty string hides every device.
    Entries are indexes ("1"), UUIDs ("GPU-8f3c…", prefixes allowed) or MIG instances ("MIG-…").
    """
    if value is None:
        return None
    entries: List[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            break
        if entry.isdigit() or entry.startswith(("GPU-", "MIG-")):
            entries.append(entry)
            continue
        break  # "-1", "none", garbage: CUDA ignores it and everything after it
    return entries


def devices_named(devices: Sequence[Device], entries: Sequence[str]) -> List[Device]:
    """The devices CUDA_VISIBLE_DEVICES entries (from parse_cuda_visible_devices) name, in their order, each once,
    as they are (not re-indexed). CUDA ends the list at an entry that names no device."""
    chosen: List[Device] = []
    for entry in entries:
        match = find_device(devices, entry)
        if match is None:
            break
        if match not in chosen:
            chosen.append(match)
    return chosen


def select_visible(devices: Sequence[Device], visible: Optional[List[str]]) -> List[Device]:
    """The devices that `visible` (from parse_cuda_visible_devices) keeps, in its order, re-indexed."""
    chosen = list(devices) if visible is None else devices_named(devices, visible)
    return [
        Device(index=i, name=d.name, uuid=d.uuid, total=d.total, nvml_index=d.nvml_index)
        for i, d in enumerate(chosen)
    ]
