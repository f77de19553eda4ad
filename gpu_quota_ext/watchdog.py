"""WatchdogSettings: the admin's settings for the watchdog (what to do about a kernel whose measured
usage stays over its cap), and their validation (`build_enforcement`, pure).

The watchdog itself, deciding and carrying out its actions, is usage/watchdog.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .shared.sizes import CapSpec, PolicyError, parse_cap

ACTIONS = ("off", "warn", "interrupt", "restart", "kill")


@dataclass(frozen=True)
class WatchdogSettings:
    """The admin's enforcement settings, validated."""

    enforce: str = "warn"
    slack: CapSpec = CapSpec(nbytes=1 << 30, text="1GiB")
    grace: float = 0.0  # seconds over the limit before acting
    poll_interval: float = 1.0

    @property
    def cooldown(self) -> float:
        """After a strong action, how long before the next one: a restart takes a moment to free memory,
        and NVML may still list the old process on the next tick."""
        return max(self.grace, 5 * self.poll_interval, 2.0)

    def limit(self, cap: int) -> int:
        """The most a kernel with this cap may use before it is over."""
        if self.slack.fraction is not None:
            return cap + int(self.slack.fraction * cap)
        return cap + (self.slack.nbytes or 0)

    def describe(self) -> dict:
        return {
            "enforce": self.enforce,
            "slack": str(self.slack),
            "grace": self.grace,
            "poll_interval": self.poll_interval,
        }


def parse_slack(value: Any) -> CapSpec:
    """Slack over the cap: bytes ("1GiB", 1073741824), a fraction of the kernel's cap ("0.1", "10%") or 0."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return CapSpec(nbytes=0, text="0")
    if isinstance(value, str) and value.strip() in ("0", "0B", "0b", "0%"):
        return CapSpec(nbytes=0, text=value.strip())
    return parse_cap(value)


def parse_seconds(value: Any, low: float, high: float) -> float:
    if isinstance(value, bool):
        raise PolicyError(f"must be a number of seconds from {low} to {high}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise PolicyError(f"must be a number of seconds from {low} to {high}") from None
    if not math.isfinite(seconds) or not low <= seconds <= high:
        raise PolicyError(f"must be a number of seconds from {low} to {high}")
    return seconds


def build_enforcement(enforce: Any, slack: Any, grace: Any, poll_interval: Any) -> WatchdogSettings:
    """Validate the watchdog's settings; PolicyError names the first bad one and its value."""

    def setting(name, parse, value):
        try:
            return parse(value)
        except PolicyError as error:
            raise PolicyError(f"c.GpuQuota.{name} = {value!r}: {error}") from None

    def choice(value):
        if not isinstance(value, str) or value.strip().lower() not in ACTIONS:
            raise PolicyError(f"must be one of {', '.join(repr(a) for a in ACTIONS)}")
        return value.strip().lower()

    return WatchdogSettings(
        enforce=setting("enforce", choice, enforce),
        slack=setting("slack", parse_slack, slack),
        grace=setting("grace", lambda v: parse_seconds(v, 0, 3600), grace),
        poll_interval=setting("poll_interval", lambda v: parse_seconds(v, 0.05, 60), poll_interval),
    )
