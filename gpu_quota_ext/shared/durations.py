"""Durations as people write them ("30min", "90s", "1.5h", 300) turned into seconds.

Shared by the server and the kernel (see `gpu_quota_ext.shared`): standard library only, no I/O.
Seconds are `float` inside the code; these strings exist only at the edges (config, environment).
"""

from __future__ import annotations

import math
import re
from typing import Optional

from .sizes import PolicyError, shown

_UNITS = {
    "": 1.0, "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
}
_DURATION_RE = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)$")
OFF_WORDS = ("", "off", "none", "never", "0")
MAX_DURATION = 366 * 86400.0  # a year: longer is a typo, not a setting


def parse_duration(value: object, allow_off: bool = True) -> Optional[float]:
    """Seconds from 300, 300.0, "300", "90s", "30min", "1.5h", "2d"; None for off ("off", "", None, 0)
    when `allow_off`. Raises PolicyError saying what is accepted, never anything else."""
    accepted = 'use seconds (300) or a number with a unit: "90s", "30min", "2h", "1d"' + (
        ', or "off"' if allow_off else ""
    )
    if value is None or (isinstance(value, str) and value.strip().lower() in OFF_WORDS):
        if allow_off:
            return None
        raise PolicyError(f"{shown(value)} is not a duration; {accepted}")
    if isinstance(value, bool):
        raise PolicyError(f"{value!r} is not a duration; {accepted}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION_RE.match(value.strip().lower())
        if not match or match.group(2) not in _UNITS:
            raise PolicyError(f"{shown(value)} is not a duration; {accepted}")
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise PolicyError(f"{shown(value)} is not a duration; {accepted}")
    if not math.isfinite(seconds) or seconds < 0 or seconds > MAX_DURATION:
        raise PolicyError(f"{shown(value)}: a duration must be from 0 to a year")
    if seconds == 0:
        if allow_off:
            return None
        raise PolicyError(f"{shown(value)}: a duration must be above 0")
    return seconds

