"""The parker's word to each running kernel on whether it is short of room (headroom.py), on the kernel's control
channel, only when the word changes: {"action": "room_flag", "short": bool, "device": index or None,
"holding": bool}. The kernel (kernel/room_check.py) asks for room at its next cell's start while it is short.

A push that gets no answer (the kernel is busy in a way its control thread cannot answer, or gone) is not
remembered, so the next sample sends it again; one push per kernel is out at a time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Dict, Hashable, Optional, Set, Tuple

from .kernel_channel import KernelChannel

log = logging.getLogger("gpu_quota_ext")
ACTION = "room_flag"
PUSH_TIMEOUT_S = 2.0  # an idle kernel's control thread answers in milliseconds


def flag_content(device: Optional[Hashable], holding: bool) -> dict:
    """The request's content: short on `device`, or not short (None)."""
    short = device is not None
    return {"action": ACTION, "short": short, "device": device, "holding": bool(holding and short)}


class RoomFlags:
    def __init__(self, channel: KernelChannel):
        self.channel = channel
        # kernel -> what it was last told: the device it is short on (or None) and whether it holds memory there
        self.told: Dict[str, Tuple[Optional[Hashable], bool]] = {}
        self._out: Set[str] = set()

    def needs_telling(self, kernel_id: str, device: Optional[Hashable], holding: bool) -> bool:
        """A change since the kernel was last told (a kernel never told is not short, as it starts)."""
        word = (device, bool(holding and device is not None))
        return kernel_id not in self._out and self.told.get(kernel_id, (None, False)) != word

    async def tell(self, kernel_id: str, device: Optional[Hashable], holding: bool) -> None:
        self._out.add(kernel_id)
        try:
            answer = await self.channel.ask(kernel_id, flag_content(device, holding), PUSH_TIMEOUT_S)
            if answer is not None and "error" not in answer:
                self.told[kernel_id] = (device, bool(holding and device is not None))
                log.debug("gpu-quota-ext: kernel %s: short of room on %s", kernel_id, device)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # never break the parker's sample
            log.debug("gpu-quota-ext: kernel %s: room flag not sent: %r", kernel_id, error)
        finally:
            self._out.discard(kernel_id)

    def forget(self, kernel_id: str) -> None:
        """Its processes ended (restart, shutdown): a new kernel process starts not short."""
        self.told.pop(kernel_id, None)
