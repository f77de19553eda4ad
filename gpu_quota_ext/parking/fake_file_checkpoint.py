"""A fake CUDA checkpoint driver whose state lives in files, for servers in processes of their own (a real hub's user
servers, each its own Unix user) that share one fake GPU with the host service. It moves usage in the JSON file that
devices.FileFakeNvml reads ($GPU_QUOTA_FAKE_NVML_FILE: {"PID": {"UUID": bytes}}), as FakeCheckpoint moves
FakeNvml's, and keeps its own state beside it, in `<that file>.checkpoint`:

    {"totals": {uuid: bytes}, "host": {pid: {uuid: bytes}}, "states": {pid: state}, "broken": [pid, ...],
     "calls": [[call, pid, time], ...], "restores": [{"pid", "at", "need": {uuid: bytes}, "free": {...}, "ok"}, ...]}

`totals` is the test's (`write_totals`): a device without one never fills. A restore into a full device (the
process's bytes do not fit in what is free) fails with out of memory and leaves the process broken for good, as
FakeCheckpoint does and NVIDIA's driver 580 does (cuda-checkpoint issue #44): every later restore 304, unlock 401.
`restores` says what each restore found free, so a test can show that none ran into a full device (`read_state`).

Every change is one read-modify-write of both files under an exclusive flock of `<that file>.lock`; each file is
replaced whole (written beside it, then renamed), so a reader without the lock (FileFakeNvml in the service and the
servers) never reads half of one. The folder must let every server's user create files (a test's own, mode 0777).

    c.GpuQuota.checkpoint_class = "gpu_quota_ext.parking.fake_file_checkpoint.FileFakeCheckpoint"
    c.GpuQuota.nvml_class = "gpu_quota_ext.devices.fake_nvml.FileFakeNvml"
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from typing import Any, Dict, Iterator, Optional, Tuple

import psutil

from .checkpoint import (
    CHECKPOINTED,
    CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_OPERATING_SYSTEM,
    CUDA_ERROR_OUT_OF_MEMORY,
    DRIVER_RUNNING,
    LOCKED,
    CheckpointDriver,
    CheckpointError,
    CheckpointUnavailable,
)

VARIABLE = "GPU_QUOTA_FAKE_NVML_FILE"  # devices.FileFakeNvml's
CALLS_KEPT = 1000


def usage_path(path: Optional[str] = None) -> str:
    """The fake NVML's file: `path`, else $GPU_QUOTA_FAKE_NVML_FILE."""
    found = path or os.environ.get(VARIABLE)
    if not found:
        raise CheckpointUnavailable(f"${VARIABLE} is not set: the file-backed fake driver has no fake GPU to use")
    return found


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    descriptor = os.open(path + ".lock", os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # and the lock with it


def _read(path: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: str, data: Dict[str, Any]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".fake-", suffix=".json", delete=False) as handle:
        json.dump(data, handle)
    os.chmod(handle.name, 0o644)  # every server's user and the service read it
    os.replace(handle.name, path)


@contextlib.contextmanager
def _files(path: Optional[str] = None) -> Iterator[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """(usage, state) to change in place, written back whole when the block ends, a failed call's too (under the
    lock throughout)."""
    usage_file = usage_path(path)
    state_file = usage_file + ".checkpoint"
    with _locked(usage_file):
        usage, state = _read(usage_file), _read(state_file)
        for key in ("totals", "host", "states"):
            state.setdefault(key, {})
        for key in ("broken", "calls", "restores"):
            state.setdefault(key, [])
        before = json.dumps(usage, sort_keys=True)
        try:
            yield usage, state
        finally:
            if json.dumps(usage, sort_keys=True) != before:
                _write(usage_file, usage)
            _write(state_file, state)


def set_usage(pid: int, uuid: str, nbytes: int, path: Optional[str] = None) -> None:
    """PID `pid` uses `nbytes` of device `uuid` (0: none), as the fake NVML will report it."""
    with _files(path) as (usage, _):
        per = usage.setdefault(str(pid), {})
        if nbytes:
            per[uuid] = int(nbytes)
        else:
            per.pop(uuid, None)
        if not per:
            usage.pop(str(pid), None)


def write_totals(totals: Dict[str, int], path: Optional[str] = None) -> None:
    """Each device's memory, so that a restore can find it full."""
    with _files(path) as (_, state):
        state["totals"] = {uuid: int(n) for uuid, n in totals.items()}


def read_state(path: Optional[str] = None) -> Dict[str, Any]:
    """The driver's state and the usage, as one dict: {"usage", "totals", "host", "states", "broken", "calls",
    "restores"}."""
    with _files(path) as (usage, state):
        return {"usage": dict(usage), **json.loads(json.dumps(state))}


class FileFakeCheckpoint(CheckpointDriver):
    """The driver's calls on the files of $GPU_QUOTA_FAKE_NVML_FILE (or `path`)."""

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path

    def open(self) -> None:
        usage_path(self.path)

    @contextlib.contextmanager
    def _call(self, call: str, pid: int) -> Iterator[Tuple[Dict[str, Any], Dict[str, Any], int]]:
        """(usage, state, the process's state) of one call, logged; NOT_FOUND for a process that has exited (its
        host state goes with it, as the real one's host memory does)."""
        with _files(self.path) as (usage, state):
            state["calls"] = (state["calls"] + [[call, pid, time.time()]])[-CALLS_KEPT:]
            if not psutil.pid_exists(pid):
                state["host"].pop(str(pid), None)
                state["states"].pop(str(pid), None)
                raise CheckpointError(call, pid, CUDA_ERROR_NOT_FOUND)
            yield usage, state, int(state["states"].get(str(pid), DRIVER_RUNNING))

    @staticmethod
    def _expect(call: str, pid: int, now: int, wanted: int) -> None:
        if now != wanted:
            raise CheckpointError(call, pid, CUDA_ERROR_ILLEGAL_STATE)

    def lock(self, pid: int, timeout_ms: int) -> None:
        call = "cuCheckpointProcessLock"
        with self._call(call, pid) as (_, state, now):
            self._expect(call, pid, now, DRIVER_RUNNING)
            state["states"][str(pid)] = LOCKED

    def checkpoint(self, pid: int) -> None:
        call = "cuCheckpointProcessCheckpoint"
        with self._call(call, pid) as (usage, state, now):
            self._expect(call, pid, now, LOCKED)
            state["host"][str(pid)] = usage.pop(str(pid), {})
            state["states"][str(pid)] = CHECKPOINTED

    def restore(self, pid: int) -> None:
        call = "cuCheckpointProcessRestore"
        with self._call(call, pid) as (usage, state, now):
            self._expect(call, pid, now, CHECKPOINTED)
            if pid in state["broken"]:
                raise CheckpointError(call, pid, CUDA_ERROR_OPERATING_SYSTEM)
            need = {uuid: int(n) for uuid, n in state["host"].get(str(pid), {}).items()}
            free = {
                uuid: int(state["totals"][uuid]) - sum(int(per.get(uuid, 0)) for per in usage.values())
                for uuid in need
                if uuid in state["totals"]
            }
            fits = all(need[uuid] <= left for uuid, left in free.items())
            state["restores"].append({"pid": pid, "at": time.time(), "need": need, "free": free, "ok": fits})
            if not fits:
                state["broken"].append(pid)
                raise CheckpointError(call, pid, CUDA_ERROR_OUT_OF_MEMORY)
            if need:
                usage[str(pid)] = need
            state["host"].pop(str(pid), None)
            state["states"][str(pid)] = LOCKED

    def unlock(self, pid: int) -> None:
        call = "cuCheckpointProcessUnlock"
        with self._call(call, pid) as (_, state, now):
            if pid in state["broken"]:
                raise CheckpointError(call, pid, CUDA_ERROR_ILLEGAL_STATE)
            self._expect(call, pid, now, LOCKED)
            state["states"].pop(str(pid), None)

    def state(self, pid: int) -> int:
        with self._call("cuCheckpointProcessGetState", pid) as (_, _, now):
            return now
