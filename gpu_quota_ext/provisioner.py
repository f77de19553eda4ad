"""The kernel-launch hook: a jupyter_client kernel provisioner that the extension makes the default.

Every kernelspec without a provisioner stanza of its own is launched through it, so every kernel gets
its grant (and the environment that carries it) before its process exists, with no kernelspec edited.

Admission comes first, before jupyter_client takes anything for the kernel (five ports from its port
cache, the connection file): a refused start takes nothing. A kernel id a client chose that jupyter_server's
own routes (GET, DELETE /api/kernels/<id>) cannot name is refused before that: its kernel could never be
shut down, and its grant would hold budget until the server stops. A start that fails later (the launch itself,
or anything unexpected) gives back everything it took. A refusal is a normal event for a quota: it is
answered with a clear status and logged in one line, without a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from typing import Any, List, Optional, Union

from jupyter_client.connect import KernelConnectionInfo, LocalPortCache
from jupyter_client.provisioning import LocalProvisioner
from jupyter_client.provisioning.provisioner_base import KernelProvisionerBase
from tornado import web

from .launch_env import kernel_environment
from .ledger import AdmissionRefused
from .manager import SETTINGS_KEY, GpuQuotaManager, KernelIdTaken
from .shared.sizes import PolicyError, shown
from .usage import pending_kernels

log = logging.getLogger("gpu_quota_ext")

# The kernel id in jupyter_server's routes /api/kernels/<id>[/...] (services/kernels/handlers.py, 2.x):
# a client may choose any id at POST /api/kernels, but only these can be looked up, restarted or shut down.
ROUTABLE_KERNEL_ID = re.compile(r"\w+-\w+-\w+-\w+-\w+")
MAX_KERNEL_ID = 128  # characters: a UUID has 36; the id also names the connection file


class StartRefused(web.HTTPError):
    """A kernel start the quota turned down, with the HTTP status and message the client gets.

    Its text is the message alone: whoever wraps it (jupyter_server's POST /api/sessions answers any failed
    start as a 500 whose message is str() of the error) shows what the user must read, not "HTTP 503: ..."."""

    def __str__(self) -> str:
        return self.get_message() or super().__str__()


class _NoRefusalTracebacks(logging.Filter):
    """jupyter_client logs every failed start with its traceback, twice (the kernel manager's pending
    state and the multi-kernel manager's start task). For a refusal that is noise: our one line says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], StartRefused))


_NO_REFUSAL_TRACEBACKS = _NoRefusalTracebacks()


def _quiet_refusals(logger: Union[logging.Logger, logging.LoggerAdapter]) -> None:
    logger = getattr(logger, "logger", logger)  # a LoggerAdapter's logger
    if isinstance(logger, logging.Logger) and _NO_REFUSAL_TRACEBACKS not in logger.filters:
        logger.addFilter(_NO_REFUSAL_TRACEBACKS)


class GpuQuotaProvisioner(LocalProvisioner):
    """LocalProvisioner plus a grant: taken in pre_launch, kept on restart, released on shutdown."""

    _start_task: Optional[asyncio.Task] = None

    def _manager(self) -> Optional[GpuQuotaManager]:
        # provisioner -> KernelManager -> MappingKernelManager -> ServerApp, whose web app holds the manager
        node = self.parent
        while node is not None:
            web_app = getattr(node, "web_app", None)
            if web_app is not None:
                return web_app.settings.get(SETTINGS_KEY)
            node = getattr(node, "parent", None)
        return None

    def _kernelspec_name(self) -> str:
        return getattr(self.parent, "kernel_name", None) or "unknown"

    async def pre_launch(self, **kwargs: Any) -> dict:
        manager = self._manager()
        if manager is None:
            self.log.warning(
                "gpu-quota-ext: the server extension is not loaded; kernel %s starts without a cap", self.kernel_id
            )
            return await super().pre_launch(**kwargs)
        if self._start_task is None:
            self._start_task = asyncio.current_task()  # jupyter_client's pending entry for this start
        if len(self.kernel_id) > MAX_KERNEL_ID or not ROUTABLE_KERNEL_ID.fullmatch(self.kernel_id):
            raise self._refuse(
                manager,
                400,
                f"GPU quota: kernel not started: the kernel id {shown(self.kernel_id)} is not one jupyter_server's "
                "/api/kernels/<id> routes can reach (a UUID like 0b5e7c1a-5d1f-4c0e-9a57-3f1f0d6a2b11)",
                "Kernel id not usable",
            )
        # The environment the kernel will have before our additions (the kernelspec's env merged in), as
        # the base provisioner computes it: that step takes no ports and writes no file.
        spec_env = (await KernelProvisionerBase.pre_launch(self, env=kwargs.get("env", os.environ)))["env"]
        kernelspec = self._kernelspec_name()
        try:
            spec = self.kernel_spec
            updates = await manager.admit(
                self.kernel_id, kernelspec, spec.argv, spec_env, holder=self, language=spec.language
            )
        except AdmissionRefused as refusal:
            raise self._refuse(manager, 503, f"GPU quota: kernel not started: {refusal}", refusal.reason) from None
        except KernelIdTaken as taken:
            raise self._refuse(manager, 409, f"GPU quota: kernel not started: {taken}", "Kernel id in use") from None
        except PolicyError as error:
            raise self._refuse(
                manager, 500, f"GPU quota: kernel not started: {error}", "GPU quota policy error"
            ) from None
        except BaseException:
            self._give_back(manager)
            raise
        try:
            kwargs = await super().pre_launch(**kwargs)  # ports from jupyter_client's cache, the connection file
        except BaseException:
            self._give_back(manager)
            raise
        kwargs["env"] = kernel_environment(kwargs.get("env") or {}, updates)
        return kwargs

    async def launch_kernel(self, cmd: List[str], **kwargs: Any) -> KernelConnectionInfo:
        try:
            return await super().launch_kernel(cmd, **kwargs)
        except BaseException:
            # The process never started: nothing it was given may stay taken.
            self._give_back(self._manager())
            raise

    async def shutdown_requested(self, restart: bool = False) -> None:
        await super().shutdown_requested(restart=restart)
        manager = self._manager()
        if manager is not None and manager.holds_gpu_state(self.kernel_id):
            # A parked process cannot run its CUDA exit handlers: its state is being thrown away anyway.
            await self.kill(restart=restart)

    async def cleanup(self, restart: bool = False) -> None:
        await super().cleanup(restart=restart)
        manager = self._manager()
        if manager is not None:
            manager.forget_parking(self.kernel_id)  # its processes are gone: so is their parking
        if not restart and manager is not None and self.kernel_id:
            await manager.release(self.kernel_id, holder=self)  # the ledger's call in a thread

    def _refuse(self, manager: Optional[GpuQuotaManager], status: int, message: str, reason: str) -> StartRefused:
        self._give_back(manager)
        for logger in (
            self.log,
            getattr(self.parent, "log", None),
            getattr(getattr(self.parent, "parent", None), "log", None),
        ):
            if logger is not None:
                _quiet_refusals(logger)
        level = logging.WARNING if status >= 500 else logging.INFO
        log.log(level, "gpu-quota-ext: kernel %s (%s) refused: %s", self.kernel_id, self._kernelspec_name(), message)
        return StartRefused(status, message, reason=reason)

    def _give_back(self, manager: Optional[GpuQuotaManager]) -> None:
        """Everything a start that did not happen took: its grant, its ports, its connection file and
        jupyter_client's pending entry. Safe to call whatever was taken, and more than once."""
        self._release(manager)
        km = self.parent
        if km is not None:
            if self.ports_cached:
                # What LocalProvisioner.cleanup does at shutdown; it needs connection_info, which a start
                # that failed early may not have yet, while the kernel manager holds the ports from the start.
                cache = LocalPortCache.instance()
                for port in km.ports:
                    cache.return_port(port)
                self.ports_cached = False
            km.cleanup_connection_file()  # only if this start wrote it
            km.cleanup_ipc_files()
        self._forget_failed_start(manager)

    def _forget_failed_start(self, manager: Optional[GpuQuotaManager]) -> None:
        # jupyter_client (8.10) keeps the id of a kernel whose start failed in its pending table for
        # good; the server's shutdown_all then fails with "Kernel does not exist". We drop our own
        # entry. A start that lost the race for its kernel id had overwritten the winner's entry:
        # the winner's goes back while it is still starting.
        multi = getattr(self.parent, "parent", None)
        pending = pending_kernels(multi) if multi is not None else None
        if pending is None or self._start_task is None or pending.get(self.kernel_id) is not self._start_task:
            return
        winner = manager.holder(self.kernel_id) if manager is not None else None
        winner_task = getattr(winner, "_start_task", None)
        if winner is not self and winner_task is not None and not winner_task.done():
            pending[self.kernel_id] = winner_task
        else:
            pending.pop(self.kernel_id, None)

    def _release(self, manager: Optional[GpuQuotaManager]) -> None:
        # Sync (a failed start's give-back): the bookkeeping now, the ledger's call in a thread.
        if manager is not None and self.kernel_id:
            manager.release_soon(self.kernel_id, holder=self)
