"""The host watchdog's sampling: the servers' registered PIDs checked, and NVML for every process of every
device, off the event loop.

A thread of its own samples every `interval` seconds. First every PID the leases register is checked against
/proc (attribution.verify: its real uid must be the lease owner's Unix user, by `unix_user_template`); a
refused one is logged once per PID and lease and kept in the last actions. Then per device the memory in use
and the processes (devices.NvmlBackend: the real driver, or devices.FakeNvml in tests); per process its Unix
user (uid, name) and the verified kernel whose process tree holds it (usage.kernel_for_pid, by tree only: an
environment says nothing the service may believe about another user's process). Then attribution.py
decides, and a kill is done here, in this thread. `on_round` hears each round's verified PIDs per kernel
(the book keeps which grants a live process of their user holds). Without NVML the PIDs are still checked.

A driver call that does not return leaves this thread waiting, never the service: `state()` reads the
last finished sample and says "stalled" once a sample has been out longer than `stall_after`.
"""

from __future__ import annotations

import logging
import os
import pwd
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import psutil

from ...devices import NvmlBackend, NvmlFailure, NvmlUnavailable
from ...usage import ProcTable, kernel_for_pid
from .attribution import (
    Attributed,
    Decision,
    GpuProcess,
    RefusedPid,
    Registration,
    Verified,
    attribute,
    decide,
    verify,
)

log = logging.getLogger("gpu_quota_ext")


@dataclass(frozen=True)
class Sample:
    taken_at: float  # time.time() when it came back
    device_used: Mapping[str, Optional[int]]  # uuid -> bytes (None: that device's call failed)
    processes: Tuple[GpuProcess, ...]
    attributed: Attributed
    problem: Optional[str] = None
    verified: Verified = field(default_factory=Verified)  # the registered PIDs believed (per kernel) and those refused
    read_at: Optional[float] = None  # time.time() when its reading began (what "a sample taken after" means)


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


def unix_uid_of(user: str, template: str) -> Optional[int]:
    """The uid of hub user `user`'s Unix user by the spawner's naming (`template`, "{username}" or
    "jupyter-{username}"; one name without "{username}" for a hub whose servers all run as one Unix user; a
    number is a uid). None when this host has no such user."""
    name = template.replace("{username}", user)
    if name.isdigit():
        return int(name)
    try:
        return pwd.getpwnam(name).pw_uid
    except (KeyError, ValueError):  # no such user; a NUL in the name
        return None


class HostSampler:
    def __init__(
        self,
        backend: NvmlBackend,
        uuids: Sequence[str],
        registrations: Callable[[], Sequence[Registration]],
        granted: Callable[[], Mapping[str, Tuple[str, Tuple[str, ...]]]],
        interval: float,
        stall_after: float,
        policy: str,
        grace: float,
        template: str,
        proc: Optional[ProcTable] = None,
        uid_of_user: Optional[Callable[[str], Optional[int]]] = None,
        on_round: Optional[Callable[[Mapping[str, Tuple[int, ...]], float], None]] = None,
    ):
        self.backend, self.uuids, self.registrations, self.granted = backend, list(uuids), registrations, granted
        self.interval, self.stall_after, self.policy, self.grace, self.template = (
            interval,
            stall_after,
            policy,
            grace,
            template,
        )
        self.proc = proc or ProcTable()
        self.uid_of_user = uid_of_user or (lambda user: unix_uid_of(user, template))
        self.on_round = on_round
        self.protected = {0, os.geteuid()}
        self.last: Optional[Sample] = None
        self.actions: List[Action] = []  # newest last, the last 200
        self.unavailable: Optional[str] = None
        self._busy_since: Optional[float] = None
        self._first_seen: Dict[Tuple[int, str], float] = {}
        self._killed: set = set()
        self._refusals_told: set = set()  # (pid, user, server) already logged while their lease names them
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
            log.warning(
                "gpu-quota service: NVML unavailable (%s): no host watchdog; registered PIDs are still checked", error
            )
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
            if not self.unavailable:
                self.backend.close()

    def _real_uid(self, pid: int) -> Optional[int]:
        uids = self.proc.uids_of(pid)
        return uids[0] if uids else None

    def _verify(self) -> Tuple[Verified, Dict[str, Optional[int]]]:
        """This round's registrations checked against /proc, and every user's Unix uid the round needs."""
        registrations = list(self.registrations())
        granted = self.granted()
        users = {r.user for r in registrations} | {user for user, _ in granted.values()}
        user_uid = {user: self.uid_of_user(user) for user in users}
        real = {pid: self._real_uid(pid) for pid in {r.pid for r in registrations}}
        return verify(registrations, real, user_uid), user_uid

    def _tell_refusals(self, refused: Sequence[RefusedPid], now: float) -> None:
        """Each refused registration once while its lease names it: an attempt repeated at every renewal is
        one line, not one a sample."""
        current = {(r.registration.pid, r.registration.user, r.registration.server): r for r in refused}
        for key, item in current.items():
            if key not in self._refusals_told:
                reg = item.registration
                message = (
                    f"refused PID {reg.pid} that {reg.user}'s server {reg.server!r} registered for kernel "
                    f"{reg.kernel_id}: {item.why}; it counts for nobody and is never acted on"
                )
                log.warning("gpu-quota service: %s", message)
                self._record(Action(now, "refuse", reg.user, reg.pid, "", 0, message))
        self._refusals_told = set(current)

    def _tick(self) -> None:
        verified, user_uid = self._verify()
        read_at = time.time()
        used: Dict[str, Optional[int]] = {}
        listed: List[Tuple[int, str, int]] = []
        problems = []
        for uuid in [] if self.unavailable else self.uuids:
            try:
                used[uuid] = self.backend.device_used(uuid)
                listed += [(pid, uuid, nbytes) for pid, nbytes in self.backend.device_processes(uuid)]
            except NvmlFailure as error:
                used[uuid] = None
                problems.append(str(error))
        roots = verified.roots
        known = set(roots.values())
        processes = []
        for pid, uuid, nbytes in listed:
            uid = self._real_uid(pid)
            found = kernel_for_pid(pid, roots, self.proc.parent_of, lambda _: None, known, self.proc.uids_of, None)
            processes.append(GpuProcess(pid, uuid, nbytes, uid, unix_user(uid), found.kernel_id if found else None))
        attributed = attribute(processes, self.granted(), self.template, user_uid)
        now = time.time()
        self._tell_refusals(verified.refused, now)
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
        self.last = Sample(now, used, tuple(processes), attributed, "; ".join(problems) or None, verified, read_at)
        self.samples += 1
        if self.on_round is not None:
            self.on_round(verified.pids_of(), now)

    def _act(self, decision: Decision, now: float) -> None:
        item = decision.item
        message = decision.message
        if decision.action == "kill":
            try:
                psutil.Process(item.pid).kill()
            except psutil.Error as error:
                message = f"could not kill PID {item.pid} of {item.user}: {error.__class__.__name__}"
        log.warning("gpu-quota service: %s", message)
        self._record(Action(now, decision.action, item.user, item.pid, item.uuid, item.used, message))

    def _record(self, action: Action) -> None:
        self.actions = (self.actions + [action])[-200:]
