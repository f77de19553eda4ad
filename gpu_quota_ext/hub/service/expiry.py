"""Leases that ran out and grants nobody holds, released: checked every few seconds on the service's loop.

A lease ends for its server's silence, never for the service's own: after a pause of the service (stopped, its
loop blocked) every lease gets a full period from now, as after a restart. With idle_held = "release", a grant no
live process of its user held for a lease period is released too (book.release_idle).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from .book import HostBook
from .broker import HostBroker

log = logging.getLogger("gpu_quota_ext")


class Expiry:
    def __init__(
        self,
        book: HostBook,
        broker: HostBroker,
        lease_seconds: float,
        release_idle: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.book, self.broker, self.lease_seconds, self.release_idle = book, broker, lease_seconds, release_idle
        self.clock = clock
        self.every = max(0.5, min(5.0, lease_seconds / 4))  # seconds between two checks
        self.last = clock()  # when the last check ran (the service's clock: a pause shows as a gap)

    def tick(self) -> None:
        """One check (a PeriodicCallback's, every `every` seconds)."""
        now, ran = time.time(), self.clock()
        silent, self.last = ran - self.last, ran
        if silent > 2 * self.every:
            # The service did not run (stopped, its loop blocked): no server could renew meanwhile, and their
            # renewals may still wait in its socket's backlog. As after a restart, each lease gets a full period
            # from now: a lease ends for a server's silence, never for the service's own.
            self.book.restore((), self.book.leases(), now)
            log.warning(
                "gpu-quota service: it did not run for %.0f s (stopped or blocked): every server's lease runs a "
                "full period from now",
                silent,
            )
        gone = self.book.expire(now)
        self.broker.expire(now, (o.grant.kernel_id for o in self.book.owned()))
        if gone:
            log.info(
                "gpu-quota service: released %d grant(s) of servers whose lease ran out: %s", len(gone), ", ".join(gone)
            )
        if self.release_idle:
            idle = self.book.release_idle(now)
            if idle:
                log.info(
                    "gpu-quota service: released %d grant(s) no live process of their user held for %g s: %s",
                    len(idle),
                    self.lease_seconds,
                    ", ".join(idle),
                )
