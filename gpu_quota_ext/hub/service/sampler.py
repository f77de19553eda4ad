"""The host watchdog's sampling: NVML for every process of every device, off the event loop.

A thread of its own samples every `interval` seconds: per device, the memory in use and the processes
(devices.NvmlBackend: the real driver, or devices.FakeNvml in tests); per process its Unix user (uid, name)
and the registered kernel whose process tree holds it (usage.kernel_for_pid, by tree only: an
environment says nothing the service may believe about another user's process). Then attribution.py
decides, and a kill is done here, in this thread.

A driver call that does not return leaves this thread waiting, never the service: `state()` reads the
last finished sample and says "stalled" once a sample has been out longer than `stall_after`.
"""

from __future__ import annotations

import logging
import os
import pwd
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import psutil

from ...devices import NvmlBackend, NvmlFailure, NvmlUnavailable
from ...usage import ProcTable, kernel_for_pid
from .attribution import Attributed, Decision, GpuProcess, attribute, decide

log = logging.getLogger("gpu_quota_ext")


@dataclass(frozen=True)
class Sample:
    taken_at: float  # time.time() when it came back
    device_used: Mapping[str, Optional[int]]  # uuid -> bytes (None: that device's call failed)
    processes: Tuple[GpuProcess, ...]
    attributed: Attributed
    problem: Optional[str] = None


@dataclass
class Action:
    at: float
    action: str
    user: str
    pid: int
    uuid: str
    used: int
    message: str


def unix_user(uid: Optional[int]) -> Optional[str]:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class HostSampler:
    def __init__(
        self,
        backend: NvmlBackend,
        uuids: Sequence[str],
        roots: Callable[[], Mapping[int, Tuple[str, str]]],
        granted: Callable[[], Mapping[str, Tuple[str, Tuple[str, ...]]]],
        interval: float,
        stall_after: float,
        policy: str,
        grace: float,
        template: str,
        proc: Optional[ProcTable] = None,
    ):
        self.backend, self.uuids, self.roots, self.granted = backend, list(uuids), roots, granted
        self.interval, self.stall_after, self.policy, self.grace, self.template = (
            interval,
            stall_after,
            policy,
            grace,
            template,
        )
        self.proc = proc or ProcTable()
        self.protected = {0, os.geteuid()}
        self.last: Optional[Sample] = None
        self.actions: List[Action] = []  # newest last, the last 200
        self.unavailable: Optional[str] = None
        self._busy_since: Optional[float] = None
        self._first_seen: Dict[Tuple[int, str], float] = {}
        self._killed: set = set()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-quota-host-sampler", daemon=True)
        self.samples = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        # A hung driver call keeps the thread: it is a daemon, the service exits without it.
        self._thread.join(timeout=2)

    def sample_now(self) -> None:
        """Take the next sample now instead of at the next interval (tests, the admin's refresh)."""
        self._wake.set()

    def state(self) -> str:
        """ "ok", "no GPU", "stalled" (a sample out too long), "error" (the last sample had a failure), "starting"."""
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > self.stall_after:
            return "stalled"
        if self.unavailable:
            return "no GPU"
        if self.last is None:
            return "starting"
        return "error" if self.last.problem else "ok"

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.backend.open()
        except NvmlUnavailable as error:
            self.unavailable = str(error)
            log.warning("gpu-quota service: NVML unavailable (%s): no host watchdog", error)
            return
        try:
            while not self._stop.is_set():
                self._busy_since = time.monotonic()
                try:
                    self._tick()
                except Exception:  # a bug must not end the watchdog for good
                    log.exception("gpu-quota service: host sample failed")
                finally:
                    self._busy_since = None
                self._wake.wait(self.interval)
                self._wake.clear()
        finally:
            self.backend.close()

    def _tick(self) -> None:
        used: Dict[str, Optional[int]] = {}
        listed: List[Tuple[int, str, int]] = []
        problems = []
        for uuid in self.uuids:
            try:
                used[uuid] = self.backend.device_used(uuid)
                listed += [(pid, uuid, nbytes) for pid, nbytes in self.backend.device_processes(uuid)]
            except NvmlFailure as error:
                used[uuid] = None
                problems.append(str(error))
        roots = {pid: kid for pid, (_, kid) in self.roots().items()}
        known = set(roots.values())
        processes = []
        for pid, uuid, nbytes in listed:
            uids = self.proc.uids_of(pid)
            uid = uids[0] if uids else None
            found = kernel_for_pid(pid, roots, self.proc.parent_of, lambda _: None, known, self.proc.uids_of, None)
            processes.append(GpuProcess(pid, uuid, nbytes, uid, unix_user(uid), found.kernel_id if found else None))
        attributed = attribute(processes, self.granted(), self.template)
        now = time.time()
        decisions, self._first_seen = decide(
            attributed.unmanaged, self._first_seen, now, self.policy, self.grace, tuple(self.protected)
        )
        # A killed process may still be listed until its parent reaps it (or NVML notices): once is enough.
        self._killed &= {item.pid for item in attributed.unmanaged}
        for decision in decisions:
            if decision.action == "kill" and decision.item.pid in self._killed:
                continue
            self._act(decision, now)
            if decision.action == "kill":
                self._killed.add(decision.item.pid)
        self.last = Sample(now, used, tuple(processes), attributed, "; ".join(problems) or None)
        self.samples += 1

    def _act(self, decision: Decision, now: float) -> None:
        item = decision.item
        message = decision.message
        if decision.action == "kill":
            try:
                psutil.Process(item.pid).kill()
            except psutil.Error as error:
                message = f"could not kill PID {item.pid} of {item.user}: {error.__class__.__name__}"
        log.warning("gpu-quota service: %s", message)
        self.actions = (
            self.actions + [Action(now, decision.action, item.user, item.pid, item.uuid, item.used, message)]
        )[-200:]
