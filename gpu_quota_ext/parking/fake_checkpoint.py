"""A fake CUDA checkpoint driver for tests, tied to the fake NVML: a parked fake process shows 0 B.

Like FakeNvml, its state lives on the class (the server runs in the test's own process): the test
configures it, the parker's instance (made from `c.GpuQuota.checkpoint_class`) obeys. Checkpointing a
process moves its FakeNvml usage into `FakeCheckpoint.host`; restoring it puts it back. What a test can ask:

- `FakeCheckpoint.refuse(801)`: every lock fails with that code (801: an MPS client);
- `FakeCheckpoint.foreign.add(pid)`: that process belongs to another Unix user (800 NOT_PERMITTED);
- a restore into a full device (FakeNvml.totals names the device's memory, and the process's bytes do not fit
  in what is free) fails with out-of-memory (2), and from then on the process is broken as the real driver
  leaves it (NVIDIA's driver 580, measured on an H200; cuda-checkpoint issue #44): every later restore fails
  with CUDA_ERROR_OPERATING_SYSTEM (304), unlock with CUDA_ERROR_ILLEGAL_STATE (401), whatever is free then;
- `FakeCheckpoint.fail_restores(n)`: the next n restores fail the same way, whatever is free;
- `release = FakeCheckpoint.hang("cuCheckpointProcessCheckpoint")`: that call blocks until `release.set()`
  (or `reset()`, so no test leaves a thread stuck);
- `FakeCheckpoint.unavailable = "..."`: open() fails (no driver).

A process that has exited loses its fake host state, as the real one's host memory goes with it.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Set, Tuple

import psutil

from ..devices import FakeNvml
from .checkpoint import (
    CHECKPOINTED,
    CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_NOT_PERMITTED,
    CUDA_ERROR_OPERATING_SYSTEM,
    CUDA_ERROR_OUT_OF_MEMORY,
    DRIVER_RUNNING,
    LOCKED,
    CheckpointDriver,
    CheckpointError,
    CheckpointUnavailable,
)


class FakeCheckpoint(CheckpointDriver):
    _lock = threading.RLock()
    states: Dict[int, int] = {}  # pid -> LOCKED / CHECKPOINTED (absent: DRIVER_RUNNING)
    host: Dict[int, Dict[str, int]] = {}  # pid -> device uuid -> bytes moved to host memory
    refusal: Optional[int] = None  # every lock fails with this CUresult
    foreign: Set[int] = set()
    restore_failures: int = 0
    broken: Set[int] = set()  # processes whose restore failed: checkpointed for good
    unavailable: Optional[str] = None
    gates: Dict[str, threading.Event] = {}  # call name -> event it waits on
    calls: List[Tuple[str, int]] = []  # (call, pid), in order

    @classmethod
    def reset(cls) -> None:
        with cls._lock:
            for gate in cls.gates.values():
                gate.set()  # a call still hanging from the last test returns now
            cls.gates = {}
            cls.states, cls.host, cls.foreign, cls.calls, cls.broken = {}, {}, set(), [], set()
            cls.refusal, cls.unavailable, cls.restore_failures = None, None, 0

    @classmethod
    def refuse(cls, code: Optional[int]) -> None:
        cls.refusal = code

    @classmethod
    def fail_restores(cls, count: int) -> None:
        cls.restore_failures = count

    @classmethod
    def hang(cls, call: str) -> threading.Event:
        with cls._lock:
            gate = cls.gates[call] = threading.Event()
            return gate

    @classmethod
    def parked_pids(cls) -> Dict[int, Dict[str, int]]:
        """pid -> bytes on the host, for processes still alive."""
        with cls._lock:
            for pid in [p for p in cls.host if not psutil.pid_exists(p)]:
                cls.host.pop(pid, None)
                cls.states.pop(pid, None)
            return {pid: dict(per) for pid, per in cls.host.items()}

    def open(self) -> None:
        if self.unavailable:
            raise CheckpointUnavailable(self.unavailable)

    def _enter(self, call: str, pid: int) -> int:
        gate = self.gates.get(call)
        if gate is not None:
            gate.wait()
        with self._lock:
            self.calls.append((call, pid))
        if not psutil.pid_exists(pid):
            raise CheckpointError(call, pid, CUDA_ERROR_NOT_FOUND)
        return self.states.get(pid, DRIVER_RUNNING)

    def _expect(self, call: str, pid: int, state: int, wanted: int) -> None:
        if state != wanted:
            raise CheckpointError(call, pid, CUDA_ERROR_ILLEGAL_STATE)

    def lock(self, pid: int, timeout_ms: int) -> None:
        call = "cuCheckpointProcessLock"
        state = self._enter(call, pid)
        if pid in self.foreign:
            raise CheckpointError(call, pid, CUDA_ERROR_NOT_PERMITTED)
        if self.refusal is not None:
            raise CheckpointError(call, pid, self.refusal)
        self._expect(call, pid, state, DRIVER_RUNNING)
        with self._lock:
            self.states[pid] = LOCKED

    def checkpoint(self, pid: int) -> None:
        call = "cuCheckpointProcessCheckpoint"
        self._expect(call, pid, self._enter(call, pid), LOCKED)
        with self._lock:
            self.host[pid] = dict(FakeNvml.usage.get(pid, {}))
            FakeNvml.clear_usage(pid)
            self.states[pid] = CHECKPOINTED

    def restore(self, pid: int) -> None:
        call = "cuCheckpointProcessRestore"
        self._expect(call, pid, self._enter(call, pid), CHECKPOINTED)
        with self._lock:
            if pid in self.broken:
                raise CheckpointError(call, pid, CUDA_ERROR_OPERATING_SYSTEM)
            held = self.host.get(pid, {})
            free = {uuid: FakeNvml.free(uuid) for uuid in held}
            full = any(free[uuid] is not None and nbytes > (free[uuid] or 0) for uuid, nbytes in held.items())
            if self.restore_failures > 0 or full:
                if self.restore_failures > 0:
                    type(self).restore_failures -= 1
                self.broken.add(pid)
                raise CheckpointError(call, pid, CUDA_ERROR_OUT_OF_MEMORY)
            for uuid, nbytes in self.host.pop(pid, {}).items():
                FakeNvml.set_usage(pid, uuid, nbytes)
            self.states[pid] = LOCKED

    def unlock(self, pid: int) -> None:
        call = "cuCheckpointProcessUnlock"
        state = self._enter(call, pid)
        if pid in self.broken:
            raise CheckpointError(call, pid, CUDA_ERROR_ILLEGAL_STATE)
        self._expect(call, pid, state, LOCKED)
        with self._lock:
            self.states.pop(pid, None)

    def state(self, pid: int) -> int:
        return self._enter("cuCheckpointProcessGetState", pid)
