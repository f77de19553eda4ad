"""WatchdogSettings: the admin's settings for the watchdog (what to do about a kernel whose measured
usage stays over its cap), validated by `build_watchdog_settings` from the settings table's WATCHDOG rows.

The watchdog itself, deciding and carrying out its actions, is usage/watchdog.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..policy import parse_setting
from ..settings import DEFAULTS
from ..shared.sizes import CapSpec, parse_cap


@dataclass(frozen=True)
class WatchdogSettings:
    """The admin's enforcement settings, validated (build_watchdog_settings builds them)."""

    enforce: str = DEFAULTS["enforce"]
    slack: CapSpec = parse_cap(DEFAULTS["slack"])
    grace: float = float(DEFAULTS["grace"])  # seconds over the limit before acting
    poll_interval: float = float(DEFAULTS["poll_interval"])

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


def build_watchdog_settings(
    enforce: Any = DEFAULTS["enforce"],
    slack: Any = DEFAULTS["slack"],
    grace: Any = DEFAULTS["grace"],
    poll_interval: Any = DEFAULTS["poll_interval"],
) -> WatchdogSettings:
    """The watchdog's settings, validated; a SettingError names the first bad one and its value."""
    return WatchdogSettings(
        enforce=parse_setting("enforce", enforce),
        slack=parse_setting("slack", slack),
        grace=parse_setting("grace", grace),
        poll_interval=parse_setting("poll_interval", poll_interval),
    )
