"""A fake GPU for the browser tests and the pictures: gpu_quota_ext's fake NVML and fake checkpoint driver,
driven by a JSON file that a Galata spec writes through the Jupyter contents API (the server runs in a
process of its own, so the specs cannot set the fakes' class state as the pytest tests do).

The file (`$GQ_UI_SCENARIO`, in the server's root) says what NVML sees now:

    {"usage": {"<pid>": {"<device uuid>": bytes}},   # what each process holds (a parked one: on the host)
     "other_used": {"<device uuid>": bytes},          # held by processes that are no kernel's
     "lost": ["<device uuid>"],                       # devices NVML cannot read (usage unknown)
     "fail_restores": n}                              # the next n restores fail as a full device's do (lost)

It is read again whenever it changes; no file is an idle GPU. Everything else is the real server.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Optional, Tuple

from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
from gpu_quota_ext.devices.fake_nvml import FakeNvml

SCENARIO_ENV = "GQ_UI_SCENARIO"


class ScenarioNvml(FakeNvml):
    """FakeNvml that takes its state from the scenario file, once per change of the file."""

    _applied: Optional[Tuple[int, int]] = None  # (mtime_ns, size) of the file last applied
    _reading = threading.Lock()

    def _check(self, uuid: str) -> None:
        self._follow_scenario()
        super()._check(uuid)

    @classmethod
    def _follow_scenario(cls) -> None:
        path = os.environ.get(SCENARIO_ENV)
        try:
            stat = os.stat(path) if path else None
        except FileNotFoundError:
            stat = None
        seen = (stat.st_mtime_ns, stat.st_size) if stat else None
        if seen == cls._applied:
            return
        with cls._reading:
            try:
                scenario = json.loads(open(path).read() or "{}") if stat else {}
            except (OSError, ValueError):
                return  # written halfway: the next call reads it whole
            cls._apply(scenario)
            cls._applied = seen

    @classmethod
    def _apply(cls, scenario: dict) -> None:
        usage = {int(pid): {uuid: int(n) for uuid, n in per.items()} for pid, per in scenario.get("usage", {}).items()}
        parked = FakeCheckpoint.parked_pids()
        with FakeCheckpoint._lock:
            for pid in parked:  # a parked process's memory is on the host: what it holds comes back at resume
                if pid in usage:
                    FakeCheckpoint.host[pid] = usage.pop(pid)
            FakeCheckpoint.restore_failures = int(scenario.get("fail_restores", 0))
        with FakeNvml._lock:
            FakeNvml.usage = usage
            FakeNvml.other_used = {uuid: int(n) for uuid, n in scenario.get("other_used", {}).items()}
            FakeNvml.lost = set(scenario.get("lost", ()))
