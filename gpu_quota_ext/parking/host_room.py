"""How much host memory a park may use: the host's available memory, and what the server's memory cgroup
still allows. A parked kernel's GPU state goes to its own processes' host memory, so both must hold it."""

from __future__ import annotations

import logging
from typing import Optional, Tuple

import psutil

log = logging.getLogger("gpu_quota_ext")


def host_room() -> Tuple[Optional[int], Optional[int]]:
    """(host memory available, room left under this server's memory cgroup limit or None without one)."""
    try:
        available = int(psutil.virtual_memory().available)
    except Exception as error:  # broad: psutil parses /proc; an unknown room is None, never a failed round
        log.debug("gpu-quota-ext: host memory available not read: %r", error)
        available = None
    return available, cgroup_room()


def cgroup_room() -> Optional[int]:
    try:
        with open("/proc/self/cgroup") as lines:
            entries = [line.strip().split(":", 2) for line in lines if line.strip()]
    except OSError:
        return None
    for _, controllers, path in entries:
        if controllers == "":  # cgroup v2
            base = "/sys/fs/cgroup" + path.rstrip("/")
            limit, used = _read(base + "/memory.max"), _read(base + "/memory.current")
            break
        if "memory" in controllers.split(","):  # cgroup v1
            base = "/sys/fs/cgroup/memory" + path.rstrip("/")
            limit, used = _read(base + "/memory.limit_in_bytes"), _read(base + "/memory.usage_in_bytes")
            break
    else:
        return None
    if limit is None or limit >= 1 << 60:  # "max", or v1's "no limit" (a page-rounded 2**63)
        return None
    return max(0, limit - (used or 0))


def _read(path: str) -> Optional[int]:
    try:
        with open(path) as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
