"""The admin's page, built off the path that answers grants: in one worker thread of its own, from the book's and
the broker's data read under their locks there (as the sampler's thread reads them for the history), and kept
for `seconds` per view. Four admins reloading the page of 200 users and 200 kernels cost one build every
`seconds`, never a build per load on the event loop (issue 30: 415 ms per load on the loop held every user's
grant up to 1.2 s).

A view is (viewer, admin, user, page). Loads of a view while it is being built wait for that build; a build that
fails is not kept (the next load builds again). At most `max_views` views are kept: the oldest go first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Callable, Dict, Generic, Hashable, Tuple, TypeVar

View = TypeVar("View", bound=Hashable)  # what one build shows (the viewer, the page, ...)


class Snapshots(Generic[View]):
    def __init__(
        self,
        build: Callable[[View], str],
        seconds: float,
        max_views: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.build = build
        self.seconds = seconds
        self.max_views = max_views
        self.clock = clock
        self.builds = 0  # how many were built (tests and the benchmark read it)
        self._kept: Dict[View, Tuple[float, str]] = {}
        self._building: Dict[View, asyncio.Future] = {}
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpu-quota-page")
        # Its thread is made now, with the service, not at an admin's first load: the service's threads are then
        # a fixed set from its start, and one that appears later is a leak.
        self._worker.submit(lambda: None).result()

    async def get(self, view: View) -> str:
        kept = self._kept.get(view)
        if kept is not None and self.clock() - kept[0] < self.seconds:
            return kept[1]
        building = self._building.get(view)
        if building is None:
            building = asyncio.ensure_future(self._build(view))
            self._building[view] = building
        return await asyncio.shield(building)

    async def _build(self, view: View) -> str:
        try:
            started = self.clock()
            page = await asyncio.get_running_loop().run_in_executor(self._worker, self.build, view)
            self.builds += 1
            self._kept[view] = (started, page)
            while len(self._kept) > self.max_views:
                del self._kept[min(self._kept, key=lambda v: self._kept[v][0])]
            return page
        finally:
            self._building.pop(view, None)

    def close(self) -> None:
        self._worker.shutdown(wait=False)
