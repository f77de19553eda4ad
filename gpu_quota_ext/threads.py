"""Blocking work off the event loop, the one way the server does it: daemon threads, never an executor.

Driver calls (NVML, the checkpoint API, the MPS control program), ledger calls that may wait for the host
service, and an admin's caps callable can block for seconds or never return. concurrent.futures joins its
worker threads at interpreter exit (even after shutdown(wait=False)), so a call that hangs would hold the
server's exit for as long as it hangs, and an executor keeps its idle threads for good. Daemon threads that
nothing joins do neither.

- `off_loop(fn, *args)`: one call in a thread of its own; its result (or exception) as a future of the
  running loop. A caller that stops waiting (a timeout) cancels the future; the thread finishes unwatched.
- `SerialThread`: one long-lived thread that runs the calls given to it in order (the monitor's samples,
  the MPS probes): a call that hangs delays the ones after it instead of piling up threads.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable, Optional, Tuple, TypeVar

log = logging.getLogger("gpu_quota_ext")

Result = TypeVar("Result")  # what the call in the thread returns


def _settle(future: asyncio.Future, result: Any, error: Optional[BaseException]) -> None:
    if future.done():  # cancelled: the caller gave up on it
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _hand_back(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future, fn: Callable[..., Any], args: Tuple[Any, ...]
) -> None:
    try:
        result, error = fn(*args), None
    except BaseException as exc:  # handed to the loop, where the caller decides what it means
        result, error = None, exc
    try:
        loop.call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:
        pass  # the loop has closed: nobody is waiting any more


def off_loop(
    fn: Callable[..., Result],
    *args: object,
    name: str = "gpu-quota-call",
    finished: Optional[Callable[[], object]] = None,
) -> asyncio.Future[Result]:
    """Run `fn(*args)` in a daemon thread of its own; its outcome as a future of the running loop.
    `finished()` runs in that thread once `fn` has returned or raised (a slot given back)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            _hand_back(loop, future, fn, args)
        finally:
            if finished is not None:
                finished()

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class SerialThread:
    """One daemon thread running the calls submitted to it, in order; each outcome comes back as a future."""

    def __init__(self, name: str):
        self._jobs: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Result], *args: object
    ) -> asyncio.Future[Result]:
        future = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def finish(self, last: Optional[Callable[[], object]] = None) -> None:
        """Run `last` after the call in progress (if it ever returns), then end. Nothing waits for it."""
        if last is not None:
            self._jobs.put((None, None, last, ()))
        self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, future, fn, args = job
            if future is None:
                try:
                    fn(*args)
                except Exception as error:  # broad: a closing call's failure has no one to tell but the log
                    log.debug("gpu-quota-ext: %r failed in %s: %r", fn, self._thread.name, error)
                continue
            _hand_back(loop, future, fn, args)
