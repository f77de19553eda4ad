"""Caps changed outside the kernel (the sidebar, the REST API) reach it after its next cell.

The server cannot push into a kernel without running code in it. Instead, after each cell, a daemon
thread asks the server for this kernel's grant (one loopback GET, off the cell's thread and only in
kernels the server started with a GPU) and puts a changed cap into force the way `%gpucap` does:
at once if torch has started CUDA, else at its first use; child processes started later inherit it.
The record changes through its one writer (KernelCapState.write_caps), as the magic's answer does.
Standard library only.
"""

from __future__ import annotations

import threading

from .torch_cap import put_caps_in_force

_in_flight = threading.Lock()


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
    """Start one background sync unless one is still running (a slow server never piles threads up)."""
    if not (state.managed and state.devices) or not _in_flight.acquire(blocking=False):
        return

    def run() -> None:
        try:
            from .client import QuotaClient

            client = QuotaClient.from_environment()
            if client is not None:
                sync_caps(state, client)
        except Exception as error:  # a failed sync changes nothing; the next cell tries again
            state.problems[:] = [p for p in state.problems if not p.startswith("cap sync")] + [
                f"cap sync failed: {error!r}"
            ]
        finally:
            _in_flight.release()

    try:
        threading.Thread(target=run, name="gpu-quota-cap-sync", daemon=True).start()
    except Exception:
        _in_flight.release()
