"""What one user may ask of the service, and how often: the decisions that keep one user from slowing the others.
Pure: every clock is passed in (monotonic seconds), nothing here reads the time, logs or answers.

- `Buckets`: a token bucket per (route, who). A route's `Rate` refills `per_second` tokens a second up to `burst`;
  a call takes one, and a call that finds none is refused with the seconds until one is there (the answer's
  `Retry-After`). `who` is the token's owner for calls whose token the hub confirmed, and the caller's address
  for failed authentications (there is no user to charge those to).
- `OpenRequests`: how many requests of each user are open at once (long polls among them), bounded per user: a
  file descriptor is held for each, and the host has a fixed number of them.
- `Trusted`: digests of tokens the hub confirmed lately, and whose they are. A caller whose failed
  authentications ran out of tokens is refused before the hub is asked, except with a token that the hub
  confirmed lately: a flood of made-up tokens from one address (on a hub host, every local server's address)
  does not lock out its honest servers. And a call with a token whose owner has no token left on its route is
  refused before anything is asked at all: a flood's refusals cost the service next to nothing.
- `OncePer`: whether to say something about a key now, at most once a period: one log line per offender, not one
  per refused call.

Every table is bounded: a key whose bucket is full again (or whose period has passed) carries nothing a fresh
one would not, so it is dropped when the table grows past its bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, List, Mapping, Optional, Tuple

MAX_KEYS = 10_000  # per table: far more callers than a host has users, small in memory
WHOLE = 1.0 - 1e-9  # a token, to the float's rounding: a caller who waited as told is not refused for 1e-15


@dataclass(frozen=True)
class Rate:
    """`per_second` tokens a second, at most `burst` kept; per_second <= 0: no limit."""

    per_second: float
    burst: float

    @property
    def limited(self) -> bool:
        return self.per_second > 0

    @classmethod
    def of(cls, per_second: float, burst_seconds: float) -> "Rate":
        """A rate whose burst is `burst_seconds` of its refill, and at least one call."""
        return cls(float(per_second), max(1.0, float(per_second) * float(burst_seconds)))


class Buckets:
    """A token bucket per (route, who); `rates`: route -> Rate (a route not named is not limited)."""

    def __init__(self, rates: Mapping[str, Rate], max_keys: int = MAX_KEYS) -> None:
        self.rates = dict(rates)
        self.max_keys = max_keys
        self._buckets: Dict[Tuple[str, Hashable], Tuple[float, float]] = {}  # key -> (tokens, at)

    def _level(self, key: Tuple[str, Hashable], rate: Rate, now: float) -> float:
        tokens, at = self._buckets.get(key, (rate.burst, now))
        return min(rate.burst, tokens + max(0.0, now - at) * rate.per_second)

    def take(self, route: str, who: Hashable, now: float) -> float:
        """Take one token: 0.0 when the call may go on, else the seconds until a token is there (nothing taken)."""
        rate = self.rates.get(route)
        if rate is None or not rate.limited:
            return 0.0
        key = (route, who)
        tokens = self._level(key, rate, now)
        if tokens >= WHOLE:
            self._buckets[key] = (max(0.0, tokens - 1.0), now)
            if len(self._buckets) > self.max_keys:
                self._forget_full(now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1.0 - tokens) / rate.per_second

    def empty(self, route: str, who: Hashable, now: float) -> float:
        """Without taking: 0.0 while a token is there, else the seconds until one is."""
        rate = self.rates.get(route)
        if rate is None or not rate.limited:
            return 0.0
        tokens = self._level((route, who), rate, now)
        return 0.0 if tokens >= WHOLE else (1.0 - tokens) / rate.per_second

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that are full again; if none is, the least recently used half."""
        full = [k for k in self._buckets if self._level(k, self.rates[k[0]], now) >= self.rates[k[0]].burst]
        for key in full:
            del self._buckets[key]
        if len(self._buckets) > self.max_keys:
            oldest = sorted(self._buckets, key=lambda k: self._buckets[k][1])[: len(self._buckets) // 2]
            for key in oldest:
                del self._buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)


class OpenRequests:
    """Open requests per user, at most `limit` each (limit <= 0: no limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: Dict[str, int] = {}

    def enter(self, who: str) -> bool:
        """Count one more open request of `who`; False (nothing counted) when they have `limit` open already."""
        held = self._open.get(who, 0)
        if 0 < self.limit <= held:
            return False
        self._open[who] = held + 1
        return True

    def leave(self, who: str) -> None:
        held = self._open.get(who, 0) - 1
        if held > 0:
            self._open[who] = held
        else:
            self._open.pop(who, None)

    def held(self, who: str) -> int:
        return self._open.get(who, 0)

    def most(self, n: int = 5) -> List[Tuple[str, int]]:
        """The `n` users with the most open requests, most first."""
        return sorted(self._open.items(), key=lambda item: (-item[1], item[0]))[:n]

    def total(self) -> int:
        return sum(self._open.values())


class Trusted:
    """Token digests the hub confirmed, and their owners, each for `seconds` after its last confirmation."""

    def __init__(self, seconds: float, max_keys: int = MAX_KEYS) -> None:
        self.seconds = seconds
        self.max_keys = max_keys
        self._until: Dict[str, float] = {}
        self._owner: Dict[str, str] = {}

    def owner(self, digest: str, now: float) -> Optional[str]:
        """Whose the token is, as the hub said lately; None when it did not."""
        return self._owner.get(digest) if (digest, now) in self else None

    def confirm(self, digest: str, now: float, owner: str = "") -> None:
        self._until.pop(digest, None)  # re-inserted last: the dict's order is the order of confirmations
        self._until[digest] = now + self.seconds
        self._owner[digest] = owner
        if len(self._until) > self.max_keys:
            for key in [k for k, until in self._until.items() if until <= now]:
                del self._until[key]
            while len(self._until) > self.max_keys:
                del self._until[next(iter(self._until))]
            self._owner = {k: v for k, v in self._owner.items() if k in self._until}

    def __contains__(self, item: Tuple[str, float]) -> bool:
        digest, now = item
        until = self._until.get(digest)
        return until is not None and now < until


class OncePer:
    """At most once per `seconds` per key."""

    def __init__(self, seconds: float, max_keys: int = MAX_KEYS) -> None:
        self.seconds = seconds
        self.max_keys = max_keys
        self._said: Dict[Hashable, float] = {}

    def due(self, key: Hashable, now: float) -> bool:
        """True (and remembered) when nothing was said about `key` in the last `seconds`."""
        said = self._said.get(key)
        if said is not None and now - said < self.seconds:
            return False
        self._said[key] = now
        if len(self._said) > self.max_keys:
            for old in [k for k, at in self._said.items() if now - at >= self.seconds]:
                del self._said[old]
        return True


def retry_after(seconds: float) -> int:
    """The Retry-After header's whole seconds: never 0, which a client would read as "at once"."""
    whole = int(seconds)
    return max(1, whole if whole == seconds else whole + 1)


def refusal_words(route: str, rate: Optional[Rate]) -> str:
    """Why a call was refused, for the 429's message."""
    if rate is None:
        return f"too many {route} calls"
    return (
        f"too many {route} calls: this service takes {rate.per_second:g} a second from one user "
        f"(bursts of {rate.burst:g})"
    )
