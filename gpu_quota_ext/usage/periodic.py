"""Rounds on the event loop: one every interval, whatever one round does.

The monitor samples and the lifecycle polls this way: a round that raises is reported and the next one
comes on time; a round that takes longer than the interval is followed by the next at once.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Optional


async def every(
    interval: Callable[[], float],
    one_round: Callable[[], Awaitable[None]],
    failed: Callable[[Exception], None],
    wake: Optional[asyncio.Event] = None,
) -> None:
    """Run `one_round` every `interval()` seconds until cancelled; `failed(error)` hears of a round that raised.
    Setting `wake` starts the next round at once (someone needs a fresh one) instead of at the interval."""
    loop = asyncio.get_running_loop()
    while True:
        began = loop.time()
        if wake is not None:
            wake.clear()  # a wish made before this round began is served by it
        try:
            await one_round()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the rounds must outlive anything one of them does
            failed(error)
        pause = max(0.0, interval() - (loop.time() - began))
        if wake is None:
            await asyncio.sleep(pause)
        else:
            try:
                await asyncio.wait_for(wake.wait(), pause)
            except asyncio.TimeoutError:
                pass
