"""The live process table and what reads it for attribution (attribution.py holds the pure mapping).

`ProcTable` reads the live table: psutil where that costs the same as reading
/proc, /proc by hand where psutil is several times slower for a fact read for many PIDs every sample, or
lacks what the check needs (benchmarks/proc_read_bench.py, per process, median of 31 rounds over 82
processes, 2026-11-29, 2-core VM, psutil 7.2.2): parent PID 24 us by hand vs 137 us; existence 2.5 vs
21 us; environment 8 vs 133 us; uids 56 vs 60 us, but psutil gives three of the four (no filesystem
uid, which the environment check compares too). So /proc for all four on Linux; psutil elsewhere.
The NSpid mapping has no psutil counterpart and stays on /proc. `PidResolver` puts the two together
for the monitor's samples, with a short cache; `processes_by_kernel` finds a server's own processes of
each kernel, for the host service's lease.
"""

from __future__ import annotations

import os
from typing import Collection, Dict, Iterable, List, Mapping, Optional, Tuple

import psutil

from ..shared.env_vars import KERNEL_ID
from .attribution import (
    Attribution,
    alias_map,
    kernel_for_pid,
    parse_environ_kernel_id,
    parse_nspid,
    parse_ppid,
    parse_uids,
)

RECHECK_AFTER = 5.0  # seconds a PID's kernel (or "none") is trusted before it is looked up again
ALIASES_AFTER = 30.0  # seconds between full /proc scans for NSpid aliases


def processes_by_kernel(
    kernel_ids: Collection[str],
    roots: Mapping[int, str],
    table: Optional["ProcTable"] = None,
    own_uid: Optional[int] = None,
) -> Dict[str, List[int]]:
    """This server's processes (every descendant of this one) that belong to each of `kernel_ids`, by
    kernel_for_pid: what a user server's lease tells the host service about its kernels."""
    found: Dict[str, List[int]] = {}
    if not kernel_ids:
        return found
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return found
    table = table or ProcTable()
    uid = own_uid if own_uid is not None else (os.getuid() if hasattr(os, "getuid") else None)
    for child in children:
        pid = child.pid
        owner = kernel_for_pid(pid, roots, table.parent_of, table.kernel_in_environ, kernel_ids, table.uids_of, uid)
        if owner is not None and owner.kernel_id in kernel_ids:
            found.setdefault(owner.kernel_id, []).append(pid)
    return found


class ProcTable:
    """The live process table. Every read may fail (the process ended, or is another user's): None then."""

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        self.has_proc = os.path.isdir(os.path.join(proc, "self"))

    def _read(self, pid: int, name: str, binary: bool = False):
        try:
            with open(os.path.join(self.proc, str(pid), name), "rb" if binary else "r") as handle:
                return handle.read()
        except (OSError, ValueError):
            return None

    def parent_of(self, pid: int) -> Optional[int]:
        if self.has_proc:
            text = self._read(pid, "stat")
            return parse_ppid(text) if text else None
        try:  # macOS and other systems without /proc
            return psutil.Process(pid).ppid()
        except (psutil.Error, OSError, ValueError):
            return None

    def kernel_in_environ(self, pid: int) -> Optional[str]:
        if self.has_proc:
            data = self._read(pid, "environ", binary=True)
            return parse_environ_kernel_id(data) if data else None
        try:
            return psutil.Process(pid).environ().get(KERNEL_ID) or None
        except (psutil.Error, OSError, ValueError):
            return None

    def uids_of(self, pid: int) -> Tuple[int, ...]:
        if self.has_proc:
            text = self._read(pid, "status")
            return parse_uids(text) if text else ()
        try:
            return tuple(psutil.Process(pid).uids())  # real, effective, saved: all the system tells
        except (psutil.Error, OSError, ValueError):
            return ()

    def exists(self, pid: int) -> bool:
        return os.path.exists(os.path.join(self.proc, str(pid))) if self.has_proc else psutil.pid_exists(pid)

    def namespace_aliases(self) -> Dict[int, int]:
        """Every process's NSpid list, as alias_map. A full /proc scan: called only for PIDs we cannot place."""
        if not self.has_proc:
            return {}
        pairs = []
        for name in os.listdir(self.proc):
            if name.isdigit():
                text = self._read(int(name), "status")
                if text:
                    pairs.append((int(name), parse_nspid(text)))
        return alias_map(pairs)


class PidResolver:
    """kernel_for_pid over the live process table, with a short cache: most PIDs on a GPU stay there for
    many ticks, and walking their ancestry every second for 200 kernels would be most of our cost."""

    def __init__(self, table: Optional[ProcTable] = None, own_uid: Optional[int] = None):
        self.table = table or ProcTable()
        # The server's own user: the only one whose processes may name a kernel by environment.
        self.own_uid = own_uid if own_uid is not None else (os.getuid() if hasattr(os, "getuid") else None)
        # pid -> (owner, local pid, until)
        self._cache: Dict[int, Tuple[Optional[Attribution], Optional[int], float]] = {}
        self._aliases: Dict[int, int] = {}
        self._aliases_until = 0.0

    def resolve(
        self, pids: Iterable[int], roots: Mapping[int, str], known: Collection[str], now: float
    ) -> Dict[int, Tuple[Attribution, int]]:
        """{NVML pid: (whose and how, pid as our /proc numbers it)} for the PIDs that belong to a kernel."""
        found: Dict[int, Tuple[Attribution, int]] = {}
        cache: Dict[int, Tuple[Optional[Attribution], Optional[int], float]] = {}
        for pid in set(pids):
            hit = self._cache.get(pid)
            if hit is None or hit[2] <= now or (hit[0] is not None and hit[0].kernel_id not in known):
                owner, local = self._lookup(pid, roots, known, now)
                # Staggered by PID so 200 kernels' entries do not all expire on the same tick.
                hit = (owner, local, now + RECHECK_AFTER * (1 + (pid % 16) / 16))
            cache[pid] = hit
            if hit[0] is not None and hit[1] is not None:
                found[pid] = (hit[0], hit[1])
        self._cache = cache  # PIDs no longer on any GPU drop out here
        return found

    def _owner(self, pid: int, roots: Mapping[int, str], known: Collection[str]) -> Optional[Attribution]:
        table = self.table
        return kernel_for_pid(pid, roots, table.parent_of, table.kernel_in_environ, known, table.uids_of, self.own_uid)

    def _lookup(
        self, pid: int, roots: Mapping[int, str], known: Collection[str], now: float
    ) -> Tuple[Optional[Attribution], Optional[int]]:
        owner = self._owner(pid, roots, known)
        if owner is not None:
            return owner, pid
        # Not ours under this number: maybe NVML numbered it in another PID namespace (containers).
        if now >= self._aliases_until:
            self._aliases = self.table.namespace_aliases()
            self._aliases_until = now + ALIASES_AFTER
        local = self._aliases.get(pid)
        if local is not None:
            owner = self._owner(local, roots, known)
            if owner is not None:
                return owner, local
        return None, None
