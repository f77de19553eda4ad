"""What the monitor asks the driver: per device, the memory used and which processes use how much.

One small interface (`NvmlBackend`) with the real pynvml-backed implementation here and a fake for tests
in `gpu_quota_ext.devices.fake_nvml`. Devices are named by UUID, never by NVML index: the UUID is what
`devices.Device` carries and it survives reordering. Every NVML error becomes one of two exceptions so
the monitor can degrade to a clear state instead of crashing:

- `NvmlUnavailable` from `open()`: no library, no driver; the monitor reports "no GPU" and retries rarely.
- `NvmlFailure` from a per-device call: a call failed mid-run or the GPU disappeared.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple, TypeVar

T = TypeVar("T")


class NvmlUnavailable(Exception):
    """NVML cannot start here (no nvidia-ml-py, no driver, broken driver). The message says which."""


class NvmlFailure(Exception):
    """One NVML call failed (a lost GPU, a driver hiccup). The message says which call and why."""


class NvmlBackend:
    """The interface the monitor uses. Called from the monitor's own thread only, never the event loop."""

    def open(self) -> None:
        """Start NVML; raise NvmlUnavailable when it cannot."""

    def close(self) -> None:
        """Release NVML. Safe to call when open() failed."""

    def device_used(self, uuid: str) -> int:
        """Bytes of device memory in use on the whole device (all processes, all users)."""
        raise NotImplementedError

    def device_processes(self, uuid: str) -> List[Tuple[int, int]]:
        """(pid, used bytes) for every compute process on the device, as NVML reports the PIDs."""
        raise NotImplementedError


class PynvmlBackend(NvmlBackend):
    """The real driver through nvidia-ml-py. Handles are looked up by UUID and dropped on failure, so a
    GPU that comes back (after a reset) is found again on a later tick."""

    def __init__(self) -> None:
        self._pynvml = None
        self._handles: Dict[str, object] = {}

    def open(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise NvmlUnavailable("nvidia-ml-py (pynvml) is not installed") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            raise NvmlUnavailable(f"NVML could not start ({error.__class__.__name__}: {error})") from None
        self._pynvml = pynvml

    def close(self) -> None:
        pynvml, self._pynvml = self._pynvml, None
        self._handles.clear()
        if pynvml is not None:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass

    def _handle(self, uuid: str) -> Any:  # pynvml's handle
        handle = self._handles.get(uuid)
        if handle is None:
            handle = self._handles[uuid] = self._pynvml.nvmlDeviceGetHandleByUUID(uuid)
        return handle

    def _call(self, uuid: str, what: str, call: Callable[[Any], T]) -> T:
        pynvml = self._pynvml
        if pynvml is None:
            raise NvmlFailure("NVML is not open")
        try:
            return call(self._handle(uuid))
        except pynvml.NVMLError as error:
            self._handles.pop(uuid, None)  # a lost GPU gets a fresh handle when it returns
            raise NvmlFailure(f"{what} failed on {uuid} ({error.__class__.__name__}: {error})") from None

    def device_used(self, uuid: str) -> int:
        return int(self._call(uuid, "nvmlDeviceGetMemoryInfo", lambda h: self._pynvml.nvmlDeviceGetMemoryInfo(h).used))

    def device_processes(self, uuid: str) -> List[Tuple[int, int]]:
        processes = self._call(
            uuid, "nvmlDeviceGetComputeRunningProcesses", self._pynvml.nvmlDeviceGetComputeRunningProcesses
        )
        # usedGpuMemory is None when the driver cannot tell (some vGPU / permission cases): count 0, keep the PID.
        return [(int(p.pid), int(p.usedGpuMemory or 0)) for p in processes]
