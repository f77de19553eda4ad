"""A stand-in for `torch` with a CUDA that can be started on demand: what the kernel-side code calls,
recorded, so unit tests can check what would reach a real GPU without one."""

from __future__ import annotations

import types
from typing import Dict, List


class FakeCuda:
    def __init__(self, totals: List[int]):
        self.totals = totals
        self.initialized = False
        self.queued: list = []
        self.fractions: Dict[int, float] = {}
        self.reserved: Dict[int, int] = {i: 0 for i in range(len(totals))}
        self.allocated: Dict[int, int] = {i: 0 for i in range(len(totals))}
        self.peak: Dict[int, int] = {i: 0 for i in range(len(totals))}
        self.cache_emptied = 0
        self.context_calls = 0  # calls that would create a CUDA context on a real GPU

    # what our code may call at any time
    def is_initialized(self) -> bool:
        return self.initialized

    def _lazy_call(self, fn) -> None:
        if self.initialized:
            fn()
        else:
            self.queued.append(fn)

    def is_available(self) -> bool:  # asks the driver, creates no context
        return bool(self.totals)

    def device_count(self) -> int:
        return len(self.totals)

    def memory_stats(self, device=None) -> dict:
        if not self.initialized:
            return {}
        return {
            "allocated_bytes.all.current": self.allocated[device],
            "reserved_bytes.all.current": self.reserved[device],
            "reserved_bytes.all.peak": self.peak[device],
            "allocated_bytes.all.peak": self.peak[device],
        }

    # what creates a context on a real GPU: only allowed once "initialized"
    def init(self) -> None:
        self.initialized = True
        for fn in self.queued:
            fn()
        self.queued.clear()

    def _needs_init(self) -> None:
        if not self.initialized:
            self.context_calls += 1

    def get_device_properties(self, ordinal):
        self._needs_init()
        return types.SimpleNamespace(total_memory=self.totals[ordinal])

    def set_per_process_memory_fraction(self, fraction, ordinal) -> None:
        self._needs_init()
        self.fractions[ordinal] = fraction

    def memory_reserved(self, ordinal) -> int:
        return self.reserved[ordinal]

    def empty_cache(self) -> None:
        self.cache_emptied += 1

    def reset_peak_memory_stats(self, ordinal) -> None:
        self.peak[ordinal] = self.reserved[ordinal]


def fake_torch(*totals: int) -> types.ModuleType:
    module = types.ModuleType("torch")
    module.cuda = FakeCuda(list(totals))
    module.version = types.SimpleNamespace(cuda="13.0", hip=None)
    module.__version__ = "2.13.0+fake"

    class OutOfMemoryError(RuntimeError):
        pass

    module.OutOfMemoryError = OutOfMemoryError
    return module
