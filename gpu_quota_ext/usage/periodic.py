"""Rounds on the event loop: one every interval, whatever one round does.

The monitor samples and the lifecycle polls this way: a round that raises is reported and the next one
comes on time; a round that takes longer than the interval is followed by the next at once.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable


async def every(interval: Callable[[], float], one_round: Callable[[], Awaitable[None]], failed: Callable[[Exception], None]) -> None:
    """Run `one_round` every `interval()` seconds until cancelled; `failed(error)` hears of a round that raised."""
    loop = asyncio.get_running_loop()
    while True:
        began = loop.time()
        try:
            await one_round()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the rounds must outlive anything one of them does
            failed(error)
        await asyncio.sleep(max(0.0, interval() - (loop.time() - began)))
