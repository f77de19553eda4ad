"""Waiting for an event in a test: a check polled with a deadline, so that no sleep stands for the event."""

from __future__ import annotations

import asyncio
import inspect
import time


async def wait_for(check, what: str = "the condition", timeout: float = 10.0, step: float = 0.05):
    """Poll `check` (sync, or returning an awaitable) until it returns a true value; return that value. Past
    `timeout` seconds, fail naming `what` and the check's last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}; last: {str(value)[:3000]}")
        await asyncio.sleep(step)
