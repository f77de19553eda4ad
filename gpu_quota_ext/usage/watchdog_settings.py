"""WatchdogSettings: the admin's settings for the watchdog (what to do about a kernel whose measured
usage stays over its cap), validated by `build_watchdog_settings` from the settings table's WATCHDOG rows.

The watchdog itself, deciding and carrying out its actions, is usage/watchdog.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..settings import WATCHDOG, default_of, validated
from ..shared.sizes import CapSpec


@dataclass(frozen=True)
class WatchdogSettings:
    """The admin's enforcement settings, validated (build_watchdog_settings builds them)."""

    enforce: str = default_of("enforce")
    slack: CapSpec = default_of("slack")
    grace: float = default_of("grace")  # seconds over the limit before acting
    poll_interval: float = default_of("poll_interval")

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


def build_watchdog_settings(*args: Any, **given: Any) -> WatchdogSettings:
    """The watchdog's settings (the table's WATCHDOG rows: in its order, or by name), validated; a SettingError
    names the first bad one and its value."""
    return WatchdogSettings(**validated(WATCHDOG, args, given))
