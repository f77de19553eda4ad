"""The leases' long polls: a server's lease renewal may wait (its "wait") until the host's broker has idle kernels
of that server to park for another kernel (room.py), so that a park for another user's resume reaches its server
in well under a second instead of at its next renewal. Event loop only.

Each waiting renewal is one entry under its (user, server) until it answers: woken (park requests for it), at the
end of its wait, or when its caller has gone. `count()` is how many wait now (the admin's status shows it: a
number that only grows would be a leak); it may be read from another thread (the sampler's, for the history).
"""

from __future__ import annotations

import asyncio
from typing import Dict, Set, Tuple

Key = Tuple[str, str]  # (user, server)


class LongPolls:
    def __init__(self) -> None:
        self._waiting: Dict[Key, Set[asyncio.Event]] = {}
        self._count = 0  # an int: read whole from any thread

    def count(self) -> int:
        return self._count

    async def wait(self, key: Key, seconds: float, event: asyncio.Event) -> bool:
        """Wait up to `seconds` for `event`: set by wake(key), or by the caller (its connection closed). True when
        it was set."""
        self._waiting.setdefault(key, set()).add(event)
        self._count += 1
        try:
            await asyncio.wait_for(event.wait(), seconds)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self._count -= 1
            events = self._waiting.get(key)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiting[key]

    def wake(self, key: Key) -> None:
        for event in self._waiting.get(key, ()):
            event.set()
