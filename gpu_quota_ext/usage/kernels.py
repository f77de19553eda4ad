"""The server's kernel manager as the usage side needs it: the kernels and their PIDs in, events and
actions out.

`KernelManagerView` adapts jupyter_server's MappingKernelManager (jupyter_client underneath): which
kernels exist and which are still starting (through the guarded `pending_kernels`), each
kernel's own process (the root of its tree, for attribution), its "dead" event and whether its process
still runs (for the lifecycle), its activity (for parking), the interrupt / restart / kill the
watchdog carries out, and every kernel's shutdown before the hard limit's MPS daemon stops.

The one private jupyter_client attribute the server side reads is here too: MultiKernelManager.
_pending_kernels (kernel id -> start task) keeps the kernels being started until they are listed; there is
no public accessor. The release of vanished grants must not release a kernel that is still starting, and
the provisioner puts a start that lost a race back in it. A new jupyter_client may rename or reshape it:
then `pending_kernels` says so once, clearly, and callers get None (no starting kernels are seen; the
provisioner skips its repair), not a silent change.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Set, Tuple

from tornado.web import HTTPError

if TYPE_CHECKING:  # jupyter_client's and jupyter_server's own classes, for the signatures only
    from jupyter_client.client import KernelClient
    from jupyter_client.manager import KernelManager
    from jupyter_client.multikernelmanager import MultiKernelManager
    from jupyter_server.services.kernels.kernelmanager import MappingKernelManager

log = logging.getLogger("gpu_quota_ext")


# What each part needs of the kernel manager. KernelManagerView has all of it; tests stand in for it with
# small fakes that have only what the part under test reads.


class KernelIds(Protocol):
    """Which kernels the server has (the status view, the manager)."""

    def kernel_ids(self) -> List[str]: ...


class KernelRoots(KernelIds, Protocol):
    """... and each one's own process, the root of its tree (the monitor's attribution)."""

    def roots(self) -> Dict[int, str]: ...


class KernelEnds(KernelIds, Protocol):
    """... and how each one ends, and which ones are still starting (the lifecycle)."""

    def starting_ids(self) -> Set[str]: ...

    def on_dead(self, kernel_id: str, callback: Callable[[], object]) -> None: ...

    async def dead_ids(self) -> List[str]: ...


class KernelActions(Protocol):
    """What the watchdog does to a kernel: "interrupt", "restart" or "kill"."""

    async def act(self, kernel_id: str, action: str) -> None: ...

_warned = False


def pending_kernels(multi_kernel_manager: MultiKernelManager) -> Optional[dict]:
    """The manager's table of kernels being started (kernel id -> start task), or None when this
    jupyter_client has no such dict (warned once per process)."""
    pending = getattr(multi_kernel_manager, "_pending_kernels", None)
    if isinstance(pending, dict):
        return pending
    global _warned
    if not _warned:
        _warned = True
        import jupyter_client

        log.warning(
            "gpu-quota-ext: jupyter_client %s has no MultiKernelManager._pending_kernels dict (found %s):"
            " kernels being started are not seen as such, so a grant may be released while its kernel starts;"
            " gpu-quota-ext needs an update for this jupyter_client",
            getattr(jupyter_client, "__version__", "?"),
            "nothing" if pending is None else type(pending).__name__,
        )
    return None


# What get_kernel raises for a kernel that is gone: jupyter_client's KeyError, jupyter_server's 404.
GONE = (KeyError, HTTPError)


def kernel_pid(kernel_manager: KernelManager) -> Optional[int]:
    """The kernel's own process id, from its provisioner (jupyter_client >= 7) or its Popen."""
    provisioner = getattr(kernel_manager, "provisioner", None)
    pid = getattr(provisioner, "pid", None)
    if pid is None:
        process = getattr(provisioner, "process", None) or getattr(kernel_manager, "kernel", None)
        pid = getattr(process, "pid", None)
    return pid if isinstance(pid, int) else None


async def maybe_await(value: Any) -> Any:
    """jupyter_client's methods are sync or async depending on the manager class: the value either way."""
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value


class KernelManagerView:
    """The server's kernel manager, as the monitor, the lifecycle, the watchdog and parking need it."""

    def __init__(self, multi_kernel_manager: MultiKernelManager):
        self.manager = multi_kernel_manager

    def kernel_ids(self) -> List[str]:
        return list(self.manager.list_kernel_ids())

    def starting_ids(self) -> Set[str]:
        # A kernel being started is not listed yet; jupyter_client keeps it in this table meanwhile.
        return set(pending_kernels(self.manager) or {})

    def roots(self) -> Dict[int, str]:
        roots = {}
        for kernel_id in self.kernel_ids():
            kernel = self._kernel(kernel_id)
            pid = kernel_pid(kernel) if kernel is not None else None
            if pid is not None:
                roots[pid] = kernel_id
        return roots

    def _kernel(self, kernel_id: str) -> Optional[KernelManager]:
        """The kernel's own manager, or None once it is gone (shut down since it was listed)."""
        try:
            return self.manager.get_kernel(kernel_id)
        except GONE:
            return None

    def activity(self, kernel_id: str) -> Tuple[Optional[str], Optional[datetime.datetime]]:
        """(execution_state, last_activity) as jupyter_server keeps them for the kernel ("idle", "busy",
        "starting", ...; a UTC datetime); (None, None) for a kernel the server does not have."""
        kernel = self._kernel(kernel_id)
        if kernel is None:
            return None, None
        return getattr(kernel, "execution_state", None), getattr(kernel, "last_activity", None)

    def on_dead(self, kernel_id: str, callback: Callable[[], object]) -> None:
        """Call `callback` when the kernel's restarter gives up on it (jupyter_client's "dead" event).
        A kernel without a restarter (autorestart off) never fires it: see dead_ids."""
        try:
            self.manager.add_restart_callback(kernel_id, callback, "dead")
        except GONE:
            pass  # shut down meanwhile

    def on_restart(self, kernel_id: str, callback: Callable[[], object]) -> Optional[Callable[[], None]]:
        """Call `callback` when the kernel's restarter has found its process dead and is about to start it again
        (jupyter_client's "restart" event: fired before the restart, so the caller still sees what the kernel was).
        The callable returned stops it; None for a kernel that is gone."""
        try:
            self.manager.add_restart_callback(kernel_id, callback, "restart")
        except GONE:
            return None  # gone (without a restarter, jupyter_client takes the callback and never fires it)

        def stop() -> None:
            try:
                self.manager.remove_restart_callback(kernel_id, callback, "restart")
            except GONE:
                pass  # gone meanwhile

        return stop

    def exit_code(self, kernel_id: str) -> Optional[int]:
        """The kernel's ended process's exit status as Popen has it (-N: killed by signal N), or None."""
        kernel = self._kernel(kernel_id)
        process = getattr(getattr(kernel, "provisioner", None), "process", None)
        code = getattr(process, "returncode", None)
        return code if isinstance(code, int) else None

    async def dead_ids(self) -> List[str]:
        """Kernels whose process has ended and that nothing will start again: no restarter (autorestart
        off), and no start, restart or shutdown in progress (those leave `ready` pending or set
        `shutting_down` while the process is briefly gone)."""
        dead = []
        for kernel_id in self.kernel_ids():
            manager = self._kernel(kernel_id)
            if manager is None:
                continue
            if getattr(manager, "autorestart", True) or getattr(manager, "shutting_down", False):
                continue
            ready = getattr(manager, "ready", None)
            if ready is not None and not ready.done():
                continue
            try:
                alive = await maybe_await(manager.is_alive())
            except Exception as error:  # broad: a provisioner's is_alive may raise anything; cannot tell is not dead
                log.debug("gpu-quota-ext: kernel %s: is_alive failed: %r", kernel_id, error)
                continue
            if not alive:
                dead.append(kernel_id)
        return dead

    async def act(self, kernel_id: str, action: str) -> None:
        manager = self.manager
        # `now=True`: a kernel over its cap may be stuck inside a CUDA call and never answer a polite request.
        if action == "interrupt":
            await maybe_await(manager.interrupt_kernel(kernel_id))
        elif action == "restart":
            await maybe_await(manager.restart_kernel(kernel_id, now=True))
        elif action == "kill":
            await maybe_await(manager.shutdown_kernel(kernel_id, now=True))
        else:  # pragma: no cover - the watchdog's settings allow no other value
            raise ValueError(action)

    async def shutdown_all(self) -> None:
        """Every kernel shut down (the server is stopping: before the MPS daemon they are clients of)."""
        await maybe_await(self.manager.shutdown_all())

    def watch_status(self, kernel_id: str, on_state: Callable[[str], object]) -> Optional[Callable[[], None]]:
        """Call `on_state("busy" | "idle")` as the kernel's iopub status messages come, for the message types
        jupyter_server's own activity monitor tracks (so the server's control requests to the kernel never
        count); the callable returned stops it. None when the kernel has no iopub channel (going away)."""
        from jupyter_client.session import Session

        try:
            kernel = self.manager.get_kernel(kernel_id)
            stream = kernel.connect_iopub()
        except Exception as error:  # broad: gone (GONE), or its connection half torn down (zmq, its info cleared)
            log.debug("gpu-quota-ext: kernel %s: no iopub stream: %r", kernel_id, error)
            return None
        session = Session(config=kernel.session.config, key=kernel.session.key)
        track = getattr(self.manager, "track_message_type", lambda kind: True)

        def on_message(parts) -> None:
            try:
                _, fed = session.feed_identities(parts)
                message = session.deserialize(fed)
            except Exception as error:  # broad: a bad message (ValueError, KeyError, json) must not reach the loop
                log.debug("gpu-quota-ext: kernel %s: an iopub message not read: %r", kernel_id, error)
                return
            if message["header"].get("msg_type") != "status":
                return
            parent = (message.get("parent_header") or {}).get("msg_type")
            if parent and track(parent):
                state = message["content"].get("execution_state")
                if state in ("busy", "idle"):
                    on_state(state)

        stream.on_recv(on_message)

        def stop() -> None:
            try:
                stream.close()
            except Exception as error:  # broad: called while the kernel goes away; the stop must not fail
                log.debug("gpu-quota-ext: kernel %s: closing its iopub stream failed: %r", kernel_id, error)

        return stop

    def client(self, kernel_id: str) -> KernelClient:
        """A new client of the kernel (jupyter_client's, with the kernel's connection and session key): the
        caller starts the channels it needs and stops them. Raises for a kernel that is gone."""
        return self.manager.get_kernel(kernel_id).client()


def untrack_kernel_requests(manager: MappingKernelManager) -> None:
    """Add the server's own control-channel requests to a kernel (shared.contract KERNEL_REQUEST, KERNEL_REPLY)
    to jupyter_server's untracked message types: they are not the user's activity, and the kernel's status
    around them must not make it look busy (jupyter_server's own trait, meant for this)."""
    from ..shared.contract import KERNEL_REPLY, KERNEL_REQUEST

    untracked = getattr(manager, "untracked_message_types", None)
    if untracked is None:
        return
    missing = [kind for kind in (KERNEL_REQUEST, KERNEL_REPLY) if kind not in untracked]
    if missing:
        manager.untracked_message_types = list(untracked) + missing
