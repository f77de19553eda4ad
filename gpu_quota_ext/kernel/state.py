"""What the bootstrap did in this kernel, for `%gpucap` and the usage panel to show. Stdlib only."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class DeviceCap:
    ordinal: int  # the device's number inside this kernel (torch's cuda:N)
    index: int  # the device's number on the server (the ledger's and the API's)
    uuid: str
    cap: int
    max_cap: int
    total: int  # as the server measured it (NVML); torch's own total is a little smaller


@dataclass
class KernelCapState:
    kernel_id: Optional[str] = None
    devices: List[DeviceCap] = field(default_factory=list)
    torch_route: str = "not applied"  # how the torch cap was set, in words
    problems: List[str] = field(default_factory=list)
    cpu_only_reason: Optional[str] = None

    @property
    def managed(self) -> bool:
        """True when the server's launch hook started this kernel (there is a server to ask)."""
        return self.kernel_id is not None


def read_devices(text: Optional[str]) -> List[DeviceCap]:
    """GPU_QUOTA_DEVICES (written by launch_env) -> DeviceCap list; garbage -> ValueError."""
    if not text:
        return []
    entries = json.loads(text)
    return [
        DeviceCap(
            ordinal=int(e["ordinal"]),
            index=int(e["index"]),
            uuid=str(e["uuid"]),
            cap=int(e["cap"]),
            max_cap=int(e["max_cap"]),
            total=int(e["total"]),
        )
        for e in entries
    ]


STATE = KernelCapState()


def from_environment(env=os.environ) -> KernelCapState:
    from ..names import CPU_ONLY_REASON, DEVICES, KERNEL_ID

    state = KernelCapState(kernel_id=env.get(KERNEL_ID), cpu_only_reason=env.get(CPU_ONLY_REASON))
    try:
        state.devices = read_devices(env.get(DEVICES))
    except (ValueError, KeyError, TypeError) as error:
        state.problems.append(f"unreadable {DEVICES}: {error!r}")
    return state
