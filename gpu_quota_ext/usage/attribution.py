"""Process -> kernel attribution: which kernel a process on a GPU belongs to, and how we know.

- By its **process tree**: the kernel's own process or any of its descendants. This is proof: nothing
  outside the kernel can put a process under it.
- By its **environment**: a process outside every tree (a daemon that escaped by double fork, nohup,
  setsid) whose environment carries the kernel id the launch hook set. That is only a claim: any
  process can write any kernel's id into its environment. So it is believed only for processes of the
  server's own Unix user (every uid of the process equal to the server's), and the watchdog never
  interrupts, restarts or kills on it (see watchdog.py). A process of another user is never
  attributed by its environment: a server running as root can read everyone's.

The mapping is pure: it is given the process table as functions, so tests can hand it a snapshot. The
live table (`ProcTable`), the cached resolver the monitor uses (`PidResolver`) and a server's own
processes by kernel (`processes_by_kernel`) are in processes.py.
"""

from __future__ import annotations

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

from ..shared.env_vars import KERNEL_ID

_KERNEL_ID_PREFIX = (KERNEL_ID + "=").encode()

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

