"""Caps changed outside the kernel (the sidebar, the REST API) reach it after its next cell.

The server cannot push into a kernel without running code in it. Instead, after a cell, a daemon
thread asks the server for this kernel's grant (one loopback GET, off the cell's thread and only in
kernels the server started with a GPU) and puts a changed cap into force the way `%gpucap` does:
at once if torch has started CUDA, else at its first use; child processes started later inherit it.
The record changes through its one writer (KernelCapState.write_caps), as the magic's answer does.

At most one sync starts every SYNC_EVERY_S: a thread and a request cost an empty cell about 0.7 ms
(benchmarks/cell_room_check_bench.py), and a kernel that never uses CUDA (most kernels) would pay it on
every cell. A change made meanwhile arrives with the first cell after the interval; and where a cell
skipped its sync, the kernel's first CUDA use syncs first (catch_up), so the cap put in force then is
the server's latest. Standard library only.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Optional

from .torch_cap import put_caps_in_force

_in_flight = threading.Lock()
SYNC_EVERY_S = 2.0
_last_start: Optional[float] = None  # monotonic: when the last sync started
_skipped = False  # a cell ended without a sync since the last one started: catch_up has one to make


def due(now: float, last: Optional[float], every: float = SYNC_EVERY_S) -> bool:
    """Whether a cell ending at `now` starts a sync (the first one always does)."""
    return last is None or now - last >= every


def sync_caps(state, client) -> bool:
    """Take the server's caps for this kernel if they differ from ours; True when something changed."""
    grant = client.grant()
    if not grant:
        return False
    source = f"the server ({grant.get('source') or 'changed outside this kernel'})"
    changed = state.write_caps(grant.get("devices") or [], source, only_if_changed=True)
    if changed:
        put_caps_in_force(state)
    return changed


def after_cell(state) -> None:
    """Start one background sync unless one is still running (a slow server never piles threads up) or one
    started less than SYNC_EVERY_S ago."""
    global _last_start, _skipped
    if not (state.managed and state.devices):
        return
    now = time.monotonic()
    if not due(now, _last_start):
        _skipped = True
        return
    if not _in_flight.acquire(blocking=False):
        return
    if _last_start is None:  # from the first sync on, one a cell skipped is made at the first CUDA use
        state.before_cuda.append(functools.partial(catch_up, state))
    _last_start, _skipped = now, False

    def run() -> None:
        try:
            _sync(state)
        finally:
            _in_flight.release()

    try:
        threading.Thread(target=run, name="gpu-quota-cap-sync", daemon=True).start()
    except Exception:  # broad: a thread that cannot start (RuntimeError at exit): the next cell syncs
        _in_flight.release()


def catch_up(state) -> None:
    """At the kernel's first CUDA use, before its caps are put in force: the sync a cell skipped, made now
    (one loopback GET, bounded by the client's timeout), so that a change from the sidebar is not missed."""
    global _skipped
    if not (_skipped and state.managed and state.devices):
        return
    _skipped = False
    with _in_flight:  # after a sync under way, never beside it
        _sync(state)


def _sync(state) -> None:
    try:
        from .client import QuotaClient

        client = QuotaClient.from_environment()
        if client is not None:
            sync_caps(state, client)
    except Exception as error:  # a failed sync changes nothing; the next cell tries again
        state.problems[:] = [p for p in state.problems if not p.startswith("cap sync")] + [
            f"cap sync failed: {error!r}"
        ]
