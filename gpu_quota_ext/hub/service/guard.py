"""The service's per-user limits at work: the decisions of rate.py with the clock read and the offenders logged, once
a minute each. The handlers ask it in one place (handlers.ApiHandler.prepare) and raise what it answers: a
`TooMany` is a 429 with `Retry-After`.

Routes: "grants" (every grant call), "lease", "room", "status" (status and metrics), "page" (the admin's page);
"auth" counts failed authentications per caller address. A refused call is refused before its body is parsed
and before the book, the broker or the hub is asked.

Its answer is held a while (`hold`: the time it was told to wait, plus, for a rate, one call's spacing for each
of the caller's answers held already, as in a queue; at most `hold_max`; a little less at random so that held
answers do not all leave at once): a caller that calls again as soon as it is answered (a flood, on one
connection or five hundred) then makes about as many calls as its rate, instead of keeping the event loop busy
refusing it, and a held connection costs only its file descriptor. At most `HELD_PER_CALLER` answers of one
caller are held; past that, the 429 goes at once and the connection is closed after it (the caller must connect
again).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from tornado import web

from .rate import Buckets, OncePer, OpenRequests, Rate, Trusted, refusal_words, retry_after

log = logging.getLogger("gpu_quota_ext")

ROUTES = ("grants", "lease", "room", "status", "page")
AUTH = "auth"
SAY_EVERY = 60.0  # seconds: one log line per offender and kind of refusal at most this often
TRUST_SECONDS = 3600.0  # a token the hub confirmed passes the failed-authentication limit this long
HELD_PER_CALLER = 1024  # refused answers of one caller held at once; past it, answered at once and disconnected
LONG_POLL_RETRY = 15.0  # seconds a server over its long polls is told to wait: a server renews this often


class TooMany(web.HTTPError):
    """429, and after how many seconds to call again (the answer's Retry-After header)."""

    def __init__(self, seconds: float, message: str, who: str = "", spacing: float = 0.0) -> None:
        super().__init__(429, "%s", message, reason="Too Many Requests")
        self.seconds = seconds
        self.spacing = spacing  # seconds between two calls the caller's rate lets through (0: not a rate)
        self.retry_after = retry_after(seconds)
        self.who = who  # whose calls (a user, or an address for failed authentications)
        self.disconnect = False  # set by Guard.hold when too many of this caller's answers are held already


@dataclass(frozen=True)
class GuardSettings:
    rates: Mapping[str, Rate]  # route -> Rate, AUTH included
    max_open_requests: int  # per user, long polls included; <= 0: no limit
    max_long_polls: int  # per user; <= 0: no limit
    hold_max: float = 15.0  # seconds a refused call's answer is held at most (0: answered at once)


def token_digest(token: str) -> str:
    """What is kept of a confirmed token: never the token."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


class Guard:
    def __init__(self, settings: GuardSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.buckets = Buckets(settings.rates)
        self.open = OpenRequests(settings.max_open_requests)
        self.long_polls = OpenRequests(settings.max_long_polls)
        self.trusted = Trusted(TRUST_SECONDS)
        self.said = OncePer(SAY_EVERY)
        self.refused = 0  # calls answered 429 since the start (the admin's status shows it)
        self.held = OpenRequests(HELD_PER_CALLER)  # refused answers held now, per caller

    def _refuse(self, seconds: float, who: str, kind: str, message: str, spacing: float = 0.0) -> TooMany:
        self.refused += 1
        if self.said.due((who, kind), self.clock()):
            log.warning("gpu-quota service: %s: answered 429 (said once a minute at most)", message)
        return TooMany(seconds, message, who, spacing)

    async def hold(self, refusal: TooMany) -> None:
        """Hold `refusal`'s answer (see the module's words), or mark it to disconnect when its caller has too many
        held already."""
        queued = refusal.seconds + self.held.held(refusal.who) * refusal.spacing
        hold = min(queued, self.settings.hold_max) * random.uniform(0.7, 1.0)
        if hold <= 0:
            return
        if not self.held.enter(refusal.who):
            refusal.disconnect = True
            return
        try:
            await asyncio.sleep(hold)
        finally:
            self.held.leave(refusal.who)

    def _over_rate(self, wait: float, who: str, route: str, words: str = "") -> TooMany:
        rate = self.settings.rates.get(route)
        spacing = 1.0 / rate.per_second if rate is not None and rate.limited else 0.0
        return self._refuse(wait, who, route, words or f"{who}: " + refusal_words(route, rate), spacing)

    # --- failed authentications, per caller address ----------------------------------------------

    def before_hub(self, token: Optional[str], address: str, route: str) -> None:
        """Raise TooMany, before the hub is asked: when `token`'s owner (as the hub said lately) has no call left on
        `route` (a flood's refusals then cost no token check), or when `address` has run out of failed
        authentications and `token` is not one the hub confirmed lately (a flood of made-up tokens costs the hub
        nothing)."""
        now = self.clock()
        owner = self.trusted.owner(token_digest(token), now) if token else None
        if owner is not None:
            wait = self.buckets.empty(route, owner, now)
            if wait:
                raise self._over_rate(wait, owner, route)
            return
        wait = self.buckets.empty(AUTH, address, now)
        if wait:
            raise self._over_rate(
                wait, address, AUTH,
                f"too many failed authentications from {address}: tokens the hub has not confirmed lately wait",
            )

    def failed(self, address: str) -> None:
        self.buckets.take(AUTH, address, self.clock())

    def confirmed(self, token: str, owner: str) -> None:
        self.trusted.confirm(token_digest(token), self.clock(), owner)

    # --- a confirmed user's calls ----------------------------------------------------------------

    def admit(self, route: str, who: str) -> None:
        """Take one of `who`'s calls on `route` (TooMany when over the rate) and count it open (TooMany when they
        have as many open as they may): the caller then owes one `leave(who)`."""
        wait = self.buckets.take(route, who, self.clock())
        if wait:
            raise self._over_rate(wait, who, route)
        if not self.open.enter(who):
            raise self._refuse(
                1.0, who, "open",
                f"{who} has {self.open.held(who)} requests open, the most this service keeps for one user",
            )

    def leave(self, who: str) -> None:
        self.open.leave(who)

    def enter_long_poll(self, who: str) -> None:
        """Count one more long poll of `who`'s (TooMany when they wait in as many as they may); then one
        `leave_long_poll(who)` is owed."""
        if not self.long_polls.enter(who):
            raise self._refuse(
                LONG_POLL_RETRY, who, "long poll",
                f"{who} has {self.long_polls.held(who)} lease renewals waiting, the most this service keeps for "
                "one user",
            )

    def leave_long_poll(self, who: str) -> None:
        self.long_polls.leave(who)

    def out_of_descriptors(self, limit: Optional[int]) -> None:
        """The service could not accept a connection (no file descriptor left): one line, and one per user who
        holds their most open requests, at most once a minute each."""
        now = self.clock()
        if self.said.due(("", "descriptors"), now):
            most = ", ".join(f"{who} {n}" for who, n in self.open.most())
            log.warning(
                "gpu-quota service: out of file descriptors (limit %s): new connections wait; open requests: %d "
                "(most: %s)",
                limit if limit is not None else "unknown",
                self.open.total(),
                most or "none",
            )
        for who, n in self.open.most():
            if 0 < self.open.limit <= n and self.said.due((who, "descriptors"), now):
                log.warning("gpu-quota service: %s holds %d open requests while descriptors ran out", who, n)
