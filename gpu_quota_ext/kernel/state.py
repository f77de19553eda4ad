"""The kernel's cap record (`KernelCapState`): its caps, who set them, what its start did. Stdlib only.

One writer changes the caps: `KernelCapState.write_caps`, under the record's lock, used by the magic's
PUT answer and by the background sync after each cell (they run on different threads).

Nothing at kernel start reaches the notebook (no cell is running), so what the user must know about the
start (a problem, a kernel started without a GPU although the server has some) is said once, after the
first cell, by `tell_once`; `%gpucap` shows it whenever asked. Nothing is printed on the kernel's own
stderr, which is the server's terminal.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import threading
from dataclasses import dataclass, field, fields
from typing import Callable, Dict, Iterable, List, Optional


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
    # Who set the caps now in force, in words (the server's grant source after a %gpucap request).
    cap_source: str = "the server, at kernel start"
    # Kernels no server started (`%load_ext gpu_quota_ext`): caps the user set with %gpucap, applied
    # by this kernel alone. Key: torch ordinal, or None for every device. Values are shared.sizes.CapSpec.
    local_caps: Dict[Optional[int], object] = field(default_factory=dict)
    # True once torch_cap.install_lazy_hook installed the hook (import watcher or _lazy_call).
    hook_installed: bool = False
    # Called at the kernel's first CUDA use, before its caps are put in force (sync.py's skipped sync).
    before_cuda: List[Callable[[], None]] = field(default_factory=list, repr=False)
    # The kernel's secret, moved here from the environment at start so that child processes and
    # `!env` never see it. Kept out of repr.
    token: Optional[str] = field(default=None, repr=False)
    # True once the user was told what happened at start (tell_once, or a `%gpucap` table).
    told: bool = False
    # Held while the caps, max caps and cap_source change together (write_caps).
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __deepcopy__(self, memo) -> "KernelCapState":
        # A copy (tests compare a record before and after) gets its own lock: a lock cannot be copied.
        values = {f.name: copy.deepcopy(getattr(self, f.name), memo) for f in fields(self) if f.name != "lock"}
        return KernelCapState(**values)

    def write_caps(self, granted: Iterable[dict], source: str, only_if_changed: bool = False) -> bool:
        """The server's grant (its devices: {"index", "cap", "max_cap"}) becomes this kernel's caps, with
        `source` as who set them, all under the lock. With only_if_changed, nothing is written unless a
        cap differs. True when a cap changed."""
        by_index = {int(d["index"]): d for d in granted if isinstance(d, dict) and "index" in d and "cap" in d}
        with self.lock:
            changed = any(int(by_index[d.index]["cap"]) != d.cap for d in self.devices if d.index in by_index)
            if only_if_changed and not changed:
                return False
            for device in self.devices:
                entry = by_index.get(device.index)
                if entry is not None:
                    device.cap = int(entry["cap"])
                    device.max_cap = int(entry.get("max_cap", device.max_cap))
            self.cap_source = source
            return changed

    def caps_by_ordinal(self) -> List[int]:
        """The caps in force now, in torch's device order: what the lazy hook applies at CUDA start."""
        return [d.cap for d in sorted(self.devices, key=lambda d: d.ordinal)]

    def device(self, ordinal: int) -> Optional[DeviceCap]:
        return next((d for d in self.devices if d.ordinal == ordinal), None)

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
    from ..shared.env_vars import CAP_SOURCE, CPU_ONLY_REASON, DEVICES, KERNEL_ID, TOKEN

    state = KernelCapState(kernel_id=env.get(KERNEL_ID), cpu_only_reason=env.get(CPU_ONLY_REASON), token=env.get(TOKEN))
    if env.get(CAP_SOURCE):
        state.cap_source = f"the server, at kernel start ({env[CAP_SOURCE]})"
    try:
        state.devices = read_devices(env.get(DEVICES))
    except (ValueError, KeyError, TypeError) as error:
        state.problems.append(f"unreadable {DEVICES}: {error!r}")
    return state


def tell_once(state: KernelCapState, stream=None) -> None:
    """After the first cell: the start's problems and a CPU-only start, once, on the cell's stderr."""
    if state.told:
        return
    state.told = True
    from .reasons import no_gpu_reason

    lines = []
    if state.cpu_only_reason:  # the server has GPUs, this kernel got none: worth knowing before training
        lines.append(f"gpu-quota: {no_gpu_reason(state)}")
    lines += [f"gpu-quota: problem: {problem}" for problem in state.problems]
    if lines:
        print("\n".join(lines), file=stream or sys.stderr, flush=True)
