"""The kernels' lifecycle for the ledger: a kernel that is gone gives its grant back.

Grants are normally released by the launch hook's cleanup when a kernel shuts down. Three ends of a
kernel pass by that cleanup, and each is caught here:

- the kernel's restarter gives up on it (jupyter_client's "dead" restart callback, listened to for
  every kernel from the first poll that sees it): jupyter_server then drops the kernel without the
  provisioner's cleanup, so its budget would stay taken until the server restarts;
- the kernel is gone from the server by any other route (the poll's safety net);
- its process has ended and nothing restarts it (autorestart off). With autorestart off jupyter_server
  keeps listing such a kernel, and so do we: the user may still restart it, which asks the ledger for
  a grant again like a new kernel.

The poll runs every poll interval in a task of its own, so it goes on while a GPU sample is stalled.
A kernel that is still starting (not listed yet) is never taken for gone. Releasing is the manager's:
its bookkeeping is done at once and the ledger's call in a thread, so a remote ledger never blocks the loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Callable, Optional, Set

from ..ledger import GrantReads
from .kernels import KernelEnds
from .periodic import every

log = logging.getLogger("gpu_quota_ext")


class KernelLifecycle:
    """Follows the kernels of `kernels` (KernelManagerView) and calls `release(kernel_id)` for each one
    that is gone and still holds a grant in `ledger`. `release` answers False when a release of that
    kernel is already under way (nothing is logged twice)."""

    def __init__(self, kernels: KernelEnds, ledger: GrantReads, release: Callable[[str], bool], poll_interval: float):
        self.kernels = kernels
        self.ledger = ledger
        self.release = release
        self.poll_interval = poll_interval
        self._watched: Set[str] = set()  # kernels whose "dead" event we listen to
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        """Poll on the running event loop. Idempotent."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass  # what cancel() asked for
            except Exception as error:  # broad: the server stops all the same; the rounds logged their own failures
                log.debug("gpu-quota-ext: following the kernels' lifecycle ended with %r", error)

    async def _run(self) -> None:
        await every(lambda: self.poll_interval, self.poll, self._failed)

    def _failed(self, error: Exception) -> None:
        log.warning("gpu-quota-ext: following the kernels' lifecycle failed one round: %r", error)

    async def poll(self) -> None:
        """One round: listen to new kernels' deaths, release the grants of kernels that are gone."""
        self._watch_deaths()
        self._release_vanished()
        for kernel_id in await self.kernels.dead_ids():
            self._give_back(
                kernel_id,
                "kernel %s's process has ended and nothing restarts it (autorestart is off);"
                " its grant is released, and a restart asks for a new one",
            )

    def _watch_deaths(self) -> None:
        """Listen to jupyter_client's "dead" event of every kernel, once each, from the first round that sees it."""
        listed = set(self.kernels.kernel_ids())
        for kernel_id in listed - self._watched:
            self.kernels.on_dead(kernel_id, functools.partial(self._died, kernel_id))
        self._watched = listed

    def _died(self, kernel_id: str) -> None:
        # The restarter gave up; jupyter_server drops the kernel without the provisioner's cleanup.
        self._give_back(kernel_id, "kernel %s died for good; its grant is released")

    def _release_vanished(self) -> None:
        """Give back the grants of kernels the server no longer has (and is not starting)."""
        live = set(self.kernels.kernel_ids()) | self.kernels.starting_ids()
        for grant in self.ledger.grants():
            if grant.kernel_id not in live:
                self._give_back(grant.kernel_id, "kernel %s is gone; its grant is released")

    def _give_back(self, kernel_id: str, why: str) -> None:
        if self.ledger.get(kernel_id) is not None and self.release(kernel_id):
            log.info("gpu-quota-ext: " + why, kernel_id)
