"""The parker's word to a kernel, on the kernel's control channel: "empty your allocators' caches, you are about
to park". The kernel side (kernel/park_wait.py) answers with what it freed and remembers that it may be parked,
so that its next cell waits for the resume in Python (where it can say why and be interrupted) rather than in
the driver. With fast_park on it carries three more requests (kernel/fast_park.py answers them): "facts" (what
the choice of a park's path needs, path.py), and the fast path's "park" and "resume", which pages_driver.py asks
from the parker's driver threads (threadsafe_ask) with a timeout as long as a driver call's.

The control channel, not the shell: an idle kernel's control thread answers at once, and the request does not
count as the user's activity (the extension adds its type to jupyter_server's untracked message types). A
kernel without the bootstrap never gets it. A kernel that does not answer within the timeout parks as it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Optional, Protocol

from ..shared.contract import KERNEL_REPLY, KERNEL_REQUEST

if TYPE_CHECKING:  # jupyter_client's own class, for the signatures only
    from jupyter_client.client import KernelClient

log = logging.getLogger("gpu_quota_ext")


class KernelClients(Protocol):
    """What the channel needs of the server's kernels (usage.KernelManagerView has it)."""

    def client(self, kernel_id: str) -> KernelClient:
        """A new client of the kernel, its channels not started; raises for a kernel that is gone."""


class KernelChannel:
    """Asks a kernel of the server's kernel manager, through a client of its own for each request."""

    def __init__(self, kernels: KernelClients):
        self.kernels = kernels

    async def ask(self, kernel_id: str, content: dict, timeout: float) -> Optional[dict]:
        """The kernel's reply content, or None (no such kernel, no answer in time, a channel that fails)."""
        try:
            client = self.kernels.client(kernel_id)
        except Exception as error:  # broad: gone (KeyError, 404) or a kernel manager of another kind; None says it
            log.debug("gpu-quota-ext: kernel %s: no client: %r", kernel_id, error)
            return None
        try:
            # A session id of its own: every client of the kernel manager gets a clone of one session, whose message
            # ids count from 0 in each clone, so this request's id could be the same as a notebook client's (a
            # test's run_cell, say) and the kernel's busy/idle for one would be taken for the other's.
            client.session.session = uuid.uuid4().hex
            client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
        except Exception as error:  # a channel half started is stopped, not left open
            log.debug("gpu-quota-ext: kernel %s: no control channel: %r", kernel_id, error)
            try:
                client.stop_channels()
            except Exception as stop_error:  # broad: a half-started client's channels may fail any way to stop
                log.debug("gpu-quota-ext: kernel %s: stopping the control channel failed: %r", kernel_id, stop_error)
            return None
        try:
            request = client.session.msg(KERNEL_REQUEST, content)
            client.control_channel.send(request)
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                reply = await asyncio.wait_for(client.control_channel.get_msg(), left)
                parent = reply.get("parent_header") or {}
                if parent.get("msg_id") == request["header"]["msg_id"] and reply["msg_type"] == KERNEL_REPLY:
                    content = reply.get("content")
                    return content if isinstance(content, dict) else None
        except asyncio.TimeoutError:
            return None
        except Exception as error:  # broad: zmq, the session's (de)serialization, a reply of another shape
            log.debug("gpu-quota-ext: kernel %s: control request failed: %r", kernel_id, error)
            return None
        finally:
            try:
                client.stop_channels()
            except Exception as error:  # broad: the answer (or None) must reach the caller whatever the closing does
                log.debug("gpu-quota-ext: kernel %s: stopping the control channel failed: %r", kernel_id, error)
