"""A fake NVML for tests and benchmarks: the test says "PID p uses N bytes on device U", the monitor sees it.

The server runs in the test's own process under pytest-jupyter, so the fake's state lives on the class:
a test calls `FakeNvml.set_usage(pid, "static-0", 2 * GiB)` and every FakeNvml instance (the one the
monitor made from `c.GpuQuota.nvml_class`) reports it on its next tick. `FakeNvml.reset()` between tests.

A driver call that hangs: `release = FakeNvml.hang()` makes every device call block until `release.set()`
(or `reset()`, so no test leaves a thread stuck). `HungNvml` hangs for good, for a server in its own process.
`FileFakeNvml` reads the usage from a JSON file a test writes (`{"PID": {"UUID": bytes}}`, at the path in
$GPU_QUOTA_FAKE_NVML_FILE), for a process the test did not start itself (the host service under a hub).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Dict, List, Optional, Set, Tuple

from .nvml import NvmlBackend, NvmlFailure, NvmlUnavailable


class FakeNvml(NvmlBackend):
    _lock = threading.Lock()
    usage: Dict[int, Dict[str, int]] = {}  # pid -> device uuid -> bytes
    other_used: Dict[str, int] = {}  # device uuid -> bytes used by no process we list (e.g. another container)
    totals: Dict[str, int] = {}  # device uuid -> its memory, where a test needs the device to be able to fill up
    unavailable: Optional[str] = None  # open() fails with this message (no library / no driver)
    failing: Optional[str] = None  # every call fails with this message (a driver failing mid-run)
    crashing: bool = False  # every call raises a plain RuntimeError (a bug we did not foresee)
    lost: Set[str] = set()  # these devices fail as a GPU that fell off the bus
    calls: int = 0  # how many device calls were made (tests check that sampling happens)
    stuck: Optional[threading.Event] = None  # while set and not yet released, every device call waits on it

    @classmethod
    def reset(cls) -> None:
        with cls._lock:
            if cls.stuck is not None:
                cls.stuck.set()  # a call still hanging from the last test returns now
            cls.stuck = None
            cls.usage, cls.other_used, cls.lost, cls.totals = {}, {}, set(), {}
            cls.unavailable = cls.failing = None
            cls.crashing = False
            cls.calls = 0

    @classmethod
    def hang(cls) -> threading.Event:
        """From now on every device call blocks, as a driver call that does not return; setting the
        returned event lets them all return (and later ones pass)."""
        with cls._lock:
            cls.stuck = threading.Event()
            return cls.stuck

    @classmethod
    def set_usage(cls, pid: int, uuid: str, nbytes: int) -> None:
        with cls._lock:
            cls.usage = {**cls.usage, pid: {**cls.usage.get(pid, {}), uuid: nbytes}}

    @classmethod
    def free(cls, uuid: str) -> Optional[int]:
        """Bytes free on the device (its total less what every process and `other_used` hold); None: no total."""
        with cls._lock:
            total = cls.totals.get(uuid)
            if total is None:
                return None
            return total - cls.other_used.get(uuid, 0) - sum(per.get(uuid, 0) for per in cls.usage.values())

    @classmethod
    def clear_usage(cls, pid: int) -> None:
        with cls._lock:
            cls.usage = {p: u for p, u in cls.usage.items() if p != pid}

    def open(self) -> None:
        if self.unavailable:
            raise NvmlUnavailable(self.unavailable)

    def _check(self, uuid: str) -> None:
        type(self).calls += 1
        gate = self.stuck
        if gate is not None:
            gate.wait()
        if self.crashing:
            raise RuntimeError("fake NVML crashed")
        if self.failing:
            raise NvmlFailure(self.failing)
        if uuid in self.lost:
            raise NvmlFailure(f"nvmlDeviceGetHandleByUUID failed on {uuid} (NVMLError_GpuIsLost: GPU is lost)")

    def device_processes(self, uuid: str) -> List[Tuple[int, int]]:
        self._check(uuid)
        return [(pid, per[uuid]) for pid, per in self.usage.items() if uuid in per]

    def device_used(self, uuid: str) -> int:
        self._check(uuid)
        return self.other_used.get(uuid, 0) + sum(per.get(uuid, 0) for per in self.usage.values())


class HungNvml(FakeNvml):
    """Every device call hangs for good: a server started in its own process with this backend shows
    what a driver call that never returns does to the monitor and to the server's exit."""

    def _check(self, uuid: str) -> None:
        threading.Event().wait()


class FileFakeNvml(FakeNvml):
    """The usage of a JSON file, read at every call: {"PID": {"UUID": bytes}} (none while the file is absent)."""

    VARIABLE = "GPU_QUOTA_FAKE_NVML_FILE"

    def _file_usage(self) -> Dict[int, Dict[str, int]]:
        try:
            with open(os.environ[self.VARIABLE], encoding="utf-8") as handle:
                data = json.load(handle)
        except (KeyError, OSError, ValueError):
            return {}
        return {int(pid): {str(uuid): int(n) for uuid, n in per.items()} for pid, per in data.items()}

    def device_processes(self, uuid: str) -> List[Tuple[int, int]]:
        self._check(uuid)
        return [(pid, per[uuid]) for pid, per in self._file_usage().items() if uuid in per]

    def device_used(self, uuid: str) -> int:
        self._check(uuid)
        return sum(per.get(uuid, 0) for per in self._file_usage().values())
