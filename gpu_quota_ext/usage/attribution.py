"""Process -> kernel attribution: which kernel a process on a GPU belongs to, and how we know.

- By its **process tree**: the kernel's own process or any of its descendants. This is proof: nothing
  outside the kernel can put a process under it.
- By its **environment**: a process outside every tree (a daemon that escaped by double fork, nohup,
  setsid) whose environment carries the kernel id the launch hook set. That is only a claim: any
  process can write any kernel's id into its environment. So it is believed only for processes of the
  server's own Unix user (every uid of the process equal to the server's), and the watchdog never
  interrupts, restarts or kills on it (see watchdog.py). A process of another user is never
  attributed by its environment: a server running as root can read everyone's.

The mapping itself (`kernel_for_pid`) is pure: it is given the process table as functions, so tests
can hand it a snapshot. `ProcTable` reads the live table: psutil where that costs the same as reading
/proc, /proc by hand where psutil is several times slower for a fact read for many PIDs every sample, or
lacks what the check needs (benchmarks/proc_read_bench.py, per process, median of 31 rounds over 82
processes, 2026-11-29, 2-core VM, psutil 7.2.2): parent PID 24 us by hand vs 137 us; existence 2.5 vs
21 us; environment 8 vs 133 us; uids 56 vs 60 us, but psutil gives three of the four (no filesystem
uid, which the environment check compares too). So /proc for all four on Linux; psutil elsewhere.
The NSpid mapping has no psutil counterpart and stays on /proc. `PidResolver` puts the two together
for the monitor's samples, with a short cache.
"""

from __future__ import annotations

import os
from typing import (
    Callable,
    Collection,
    Dict,
    Iterable,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Tuple,
)

import psutil

from ..shared.env_vars import KERNEL_ID

_KERNEL_ID_PREFIX = (KERNEL_ID + "=").encode()

RECHECK_AFTER = 5.0  # seconds a PID's kernel (or "none") is trusted before it is looked up again
ALIASES_AFTER = 30.0  # seconds between full /proc scans for NSpid aliases

TREE = "tree"  # the process is the kernel's or a descendant of it
ENVIRONMENT = "environment"  # outside every tree; its environment names the kernel


class Attribution(NamedTuple):
    kernel_id: str
    by: str  # TREE or ENVIRONMENT


def parse_ppid(stat_text: str) -> Optional[int]:
    """The parent PID from /proc/PID/stat. The command name (field 2) may hold spaces and ')' itself,
    so the fields are counted after the last ')'."""
    _, sep, rest = stat_text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 2:
        return None
    try:
        return int(fields[1])
    except ValueError:
        return None


def parse_nspid(status_text: str) -> List[int]:
    """The `NSpid:` line of /proc/PID/status: the process's PID in each PID namespace it belongs to,
    from the namespace of this /proc outwards-in (ours first, the innermost container's last). [] if absent."""
    for line in status_text.splitlines():
        if line.startswith("NSpid:"):
            try:
                return [int(part) for part in line[len("NSpid:"):].split()]
            except ValueError:
                return []
    return []


def parse_uids(status_text: str) -> Tuple[int, ...]:
    """The `Uid:` line of /proc/PID/status: real, effective, saved and filesystem uid. () if absent."""
    for line in status_text.splitlines():
        if line.startswith("Uid:"):
            try:
                return tuple(int(part) for part in line[len("Uid:"):].split())
            except ValueError:
                return ()
    return ()


def parse_environ_kernel_id(environ: bytes) -> Optional[str]:
    """GPU_QUOTA_KERNEL_ID from the NUL-separated bytes of /proc/PID/environ, or None."""
    for entry in environ.split(b"\0"):
        if entry.startswith(_KERNEL_ID_PREFIX):
            return entry[len(_KERNEL_ID_PREFIX):].decode("utf-8", "replace") or None
    return None


def alias_map(nspids: Iterable[Tuple[int, List[int]]]) -> Dict[int, int]:
    """{PID as another namespace numbers it: PID as ours does}, from (our pid, NSpid list) pairs.

    NVML may report a PID from another namespace than the server's (old drivers gave host PIDs to
    containers; a server on the host sees container-local ones from nested kernels). Our own number wins
    a collision: it is tried first by the caller anyway."""
    aliases: Dict[int, int] = {}
    for local, entries in nspids:
        for other in entries:
            if other != local:
                aliases.setdefault(other, local)
    return aliases


def kernel_for_pid(
    pid: int,
    roots: Mapping[int, str],
    parent_of: Callable[[int], Optional[int]],
    kernel_in_environ: Callable[[int], Optional[str]],
    known_kernels: Collection[str],
    uids_of: Callable[[int], Tuple[int, ...]],
    own_uid: Optional[int],
    max_depth: int = 128,
) -> Optional[Attribution]:
    """The kernel `pid` belongs to and how that is known, or None.

    `roots` maps each kernel's own process id to its kernel id. A process belongs to a kernel by TREE when
    it is that process or a descendant of it. Failing that, by ENVIRONMENT when its environment names a
    kernel we know and every uid of the process (`uids_of`: real, effective, saved, filesystem) is
    `own_uid`, the server's: another user's process never speaks for one of our kernels."""
    current: Optional[int] = pid
    seen = set()
    for _ in range(max_depth):
        if current is None or current <= 1 or current in seen:
            break
        if current in roots:
            return Attribution(roots[current], TREE)
        seen.add(current)
        current = parent_of(current)
    uids = uids_of(pid)
    if own_uid is None or not uids or any(uid != own_uid for uid in uids):
        return None  # not ours to believe (or gone): its environment is not even read
    named = kernel_in_environ(pid)
    if named is not None and named in known_kernels:
        return Attribution(named, ENVIRONMENT)
    return None


def foreign_pids(
    pids: Iterable[int], own_uid: Optional[int], uids_of: Callable[[int], Tuple[int, ...]]
) -> Tuple[int, ...]:
    """The PIDs whose real uid is not `own_uid`: processes a server of that uid cannot checkpoint (none when it
    is root, which may). A process that has gone, or cannot be read, is not counted: the driver answers for it."""
    if own_uid is None or own_uid == 0:
        return ()
    return tuple(sorted(pid for pid in pids if (uids_of(pid) or (own_uid,))[0] != own_uid))


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
