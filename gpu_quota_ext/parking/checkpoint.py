"""The CUDA driver's checkpoint API, called from this server on a kernel's processes: one interface
(`CheckpointDriver`) with the real driver through ctypes here and a fake for tests in
`gpu_quota_ext.parking.fake_checkpoint`.

The driver moves a whole process's GPU state (its allocations and its CUDA context) to that process's
host memory and back: lock (wait for its GPU work to finish, block new CUDA calls), checkpoint (GPU
memory to host memory), restore (back to the GPU), unlock (its CUDA calls run again). No Python binding
ships these calls, hence ctypes; they need `cuInit(0)` in the calling process first (it creates no
context and takes no GPU memory). Every call may block for seconds (13 s for 20 GiB on an H200):
callers run them in a thread of their own, never on the event loop. A failed call raises
CheckpointError with the driver's own code kept, so the caller can tell "not supported" (MPS clients,
801) from "out of memory" (2, a restore that finds the device full) from anything else.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

# CUresult values the parker tells apart (cuda.h).
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_OPERATING_SYSTEM = 304
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_TIMEOUT = 909

ERROR_NAMES = {
    CUDA_ERROR_INVALID_VALUE: "CUDA_ERROR_INVALID_VALUE",
    CUDA_ERROR_OUT_OF_MEMORY: "CUDA_ERROR_OUT_OF_MEMORY",
    CUDA_ERROR_NOT_INITIALIZED: "CUDA_ERROR_NOT_INITIALIZED",
    CUDA_ERROR_OPERATING_SYSTEM: "CUDA_ERROR_OPERATING_SYSTEM",
    CUDA_ERROR_ILLEGAL_STATE: "CUDA_ERROR_ILLEGAL_STATE",
    CUDA_ERROR_NOT_FOUND: "CUDA_ERROR_NOT_FOUND",
    CUDA_ERROR_NOT_PERMITTED: "CUDA_ERROR_NOT_PERMITTED",
    CUDA_ERROR_NOT_SUPPORTED: "CUDA_ERROR_NOT_SUPPORTED",
    CUDA_ERROR_TIMEOUT: "CUDA_ERROR_TIMEOUT",
}

# CUprocessState (cuda.h): one process as the driver has it; DRIVER_RUNNING so that it is never taken for a kernel's
# park state (shared/park_state.py) or the parker's record state (states.RUNNING)
DRIVER_RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3
STATE_NAMES = {DRIVER_RUNNING: "running", LOCKED: "locked", CHECKPOINTED: "checkpointed", FAILED: "failed"}

CALLS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)
LIBRARY = "libcuda.so.1"


class CheckpointUnavailable(Exception):
    """This machine cannot park: no driver library, a driver without the checkpoint API, cuInit failed."""


class CheckpointError(Exception):
    """One checkpoint call failed; `code` is the driver's CUresult."""

    def __init__(self, call: str, pid: int, code: int, name: Optional[str] = None):
        self.call, self.pid, self.code = call, pid, code
        self.name = name or ERROR_NAMES.get(code, f"CUresult {code}")
        super().__init__(f"{call}(pid {pid}) failed: {self.name} ({code})")


class CheckpointDriver:
    """What the parker asks the driver, per process id. Blocking calls: run them off the event loop."""

    def open(self) -> None:
        """Load and initialize the driver; raise CheckpointUnavailable, saying why, when it cannot park."""

    def lock(self, pid: int, timeout_ms: int) -> None:
        """Wait (at most `timeout_ms`, 0: no limit) for the process's GPU work to finish; block its CUDA calls."""
        raise NotImplementedError

    def checkpoint(self, pid: int) -> None:
        """A locked process's GPU memory (context included) to its host memory."""
        raise NotImplementedError

    def restore(self, pid: int) -> None:
        """A checkpointed process's memory back to the GPU (stays locked)."""
        raise NotImplementedError

    def unlock(self, pid: int) -> None:
        """A locked process's CUDA calls run again."""
        raise NotImplementedError

    def state(self, pid: int) -> int:
        """DRIVER_RUNNING, LOCKED, CHECKPOINTED or FAILED."""
        raise NotImplementedError


class _LockArgs(ctypes.Structure):
    # CUcheckpointLockArgs: unsigned int timeoutMs; unsigned int reserved0; cuuint64_t reserved1[7]
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class CudaCheckpointDriver(CheckpointDriver):
    """The real driver (libcuda.so.1) through ctypes. One call at a time: the driver's checkpoint entry
    points were measured one by one, and a parker has no reason to overlap them."""

    def __init__(self, library: str = LIBRARY) -> None:
        self.library = library
        self._lib = None
        self._lock = threading.Lock()

    def open(self) -> None:
        if self._lib is not None:
            return
        try:
            lib = ctypes.CDLL(self.library)
        except OSError as error:
            raise CheckpointUnavailable(f"no CUDA driver here ({self.library} cannot be loaded: {error})") from None
        missing = [name for name in CALLS if not hasattr(lib, name)]
        if missing:
            version = self._driver_version(lib)
            raise CheckpointUnavailable(
                f"this CUDA driver{version} has no checkpoint API ({', '.join(missing)} missing); a newer driver has it"
            )
        code = lib.cuInit(0)
        if code != CUDA_SUCCESS:
            raise CheckpointUnavailable(
                f"the CUDA driver did not start: cuInit(0) returned {self._name(lib, code)} ({code})"
            )
        for name in CALLS:
            getattr(lib, name).restype = ctypes.c_int
        self._lib = lib

    @staticmethod
    def _driver_version(lib) -> str:
        version = ctypes.c_int(0)
        try:
            if lib.cuDriverGetVersion(ctypes.byref(version)) == CUDA_SUCCESS:
                return f" (CUDA {version.value // 1000}.{version.value % 1000 // 10})"
        except AttributeError:
            pass
        return ""

    @staticmethod
    def _name(lib, code: int) -> str:
        text = ctypes.c_char_p()
        try:
            if lib.cuGetErrorName(code, ctypes.byref(text)) == CUDA_SUCCESS and text.value:
                return text.value.decode()
        except AttributeError:
            pass
        return ERROR_NAMES.get(code, f"CUresult {code}")

    def _call(self, name: str, pid: int, argument) -> None:
        lib = self._lib
        if lib is None:
            raise CheckpointError(name, pid, CUDA_ERROR_NOT_INITIALIZED)
        with self._lock:
            code = getattr(lib, name)(ctypes.c_int(pid), argument)
        if code != CUDA_SUCCESS:
            raise CheckpointError(name, pid, code, self._name(lib, code))

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = _LockArgs(timeoutMs=max(0, int(timeout_ms)))
        self._call("cuCheckpointProcessLock", pid, ctypes.byref(args))

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid, None)

    def restore(self, pid: int) -> None:
        self._call("cuCheckpointProcessRestore", pid, None)

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, None)

    def state(self, pid: int) -> int:
        value = ctypes.c_int(-1)
        self._call("cuCheckpointProcessGetState", pid, ctypes.byref(value))
        return value.value
