"""Sizes: the byte units, a cap as a person writes it (`CapSpec`, `parse_cap`), and sizes shown to people.

Shared by the server and the kernel (see `gpu_quota_ext.shared`): standard library only, no I/O.
Sizes are `int` bytes everywhere in the code. The strings users write ("0.25", "25%", "12GiB",
"12GB", "1073741824") exist only at the edges and become a `CapSpec` here.
"""

from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass
from typing import Optional, Union

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB, "ki": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB, "mi": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB, "gi": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": TiB, "ti": TiB,
}
_SIZE_RE = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)$")

MIN_CAP = MiB  # the smallest cap: below it no framework can work, and CuPy reads 0 as "no limit"
MIN_CAP_TEXT = "1 MiB"
MAX_DEVICE = 64 * TiB  # larger than any GPU: sizes above it are garbage
# A fraction below this is less than MIN_CAP on every device up to MAX_DEVICE: refused when parsed.
MIN_FRACTION = MIN_CAP / MAX_DEVICE
SHOWN_CHARS = 60  # how much of a value a person wrote an error message echoes back


class PolicyError(ValueError):
    """A value a person wrote (config, magic argument, API body) that cannot be used, and why."""


_shortener = reprlib.Repr()
_shortener.maxstring = _shortener.maxother = _shortener.maxlong = SHOWN_CHARS
_shortener.maxlevel = 2


def shown(value: object) -> str:
    """`repr(value)` cut to about SHOWN_CHARS characters (with "..."): messages echo what a person wrote,
    but a 1 MB cap string must not become a 1 MB answer and 3 MB of log."""
    try:
        return _shortener.repr(value)
    except Exception:  # e.g. an int too long for str() (Python's digit limit)
        return f"<{type(value).__name__}>"


@dataclass(frozen=True)
class CapSpec:
    """A cap as written: a fraction of each device's memory, or a fixed number of bytes."""

    fraction: Optional[float] = None
    nbytes: Optional[int] = None
    text: str = ""

    def to_bytes(self, device_total: int, device: str = "the device") -> int:
        """The cap in bytes on a device of `device_total` bytes (never more than the device).

        A fraction is checked here, where it becomes bytes: PolicyError when it is below MIN_CAP on
        this device (`device` names it in the message)."""
        if self.fraction is not None:
            nbytes = int(self.fraction * device_total)
            if nbytes < MIN_CAP:
                raise PolicyError(
                    f"{shown(self.text)} of {device} ({format_bytes(device_total)}) is {format_bytes(nbytes)}: "
                    f"a cap must be at least {MIN_CAP_TEXT}"
                )
            return nbytes
        assert self.nbytes is not None
        return min(self.nbytes, device_total)

    def __str__(self) -> str:
        # What messages and the status API show: the text as written, cut if someone wrote a novel.
        return self.text if len(self.text) <= SHOWN_CHARS else self.text[: SHOWN_CHARS - 3] + "..."


def parse_cap(value: Union[str, int, float, CapSpec]) -> CapSpec:
    """Parse a cap: "0.25" or 0.25 (fraction, 0 < f <= 1), "25%", "12GiB", "12GB", or bytes (int >= 2).

    Raises PolicyError with a message that says what is accepted. Never anything else.
    """
    if isinstance(value, CapSpec):
        return value
    if isinstance(value, bool):
        raise PolicyError(f"{value!r} is not a cap; use a fraction like 0.25, 25%, 12GiB or bytes")
    if isinstance(value, int):
        if value > MAX_DEVICE:
            raise PolicyError(f"{shown(value)} is larger than any GPU")
        return _bytes_spec(value, str(value))
    if isinstance(value, float):
        return _fraction_spec(value, repr(value))
    if not isinstance(value, str):
        raise PolicyError(f"{shown(value)} is not a cap; use a fraction like 0.25, 25%, 12GiB or bytes")
    text = value.strip()
    low = text.lower().replace("_", "")
    if low.endswith("%"):
        number = _number(low[:-1].strip(), text)
        return _fraction_spec(number / 100.0, text)
    match = _SIZE_RE.match(low)
    if not match:
        raise PolicyError(
            f"{shown(text)} is not a cap; use a fraction like 0.25, a percentage like 25%, "
            "a size like 12GiB or 12GB, or a number of bytes"
        )
    number_text, unit = match.groups()
    if unit not in _UNITS:
        raise PolicyError(f"{shown(text)}: unknown unit {shown(unit)}; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB")
    number = _number(number_text, text)
    if unit == "" and "." not in number_text and number > 1:
        return _bytes_spec(int(number_text), text)
    if unit == "":
        return _fraction_spec(number, text)
    nbytes = number * _UNITS[unit]
    if not math.isfinite(nbytes) or nbytes > MAX_DEVICE:
        raise PolicyError(f"{shown(text)} is larger than any GPU")
    return _bytes_spec(int(nbytes), text)


def _number(text: str, original: str) -> float:
    try:
        number = float(text)
    except ValueError:
        raise PolicyError(f"{shown(original)} is not a number") from None
    if not math.isfinite(number):
        raise PolicyError(f"{shown(original)} is not a finite number")
    return number


def _fraction_spec(fraction: float, text: str) -> CapSpec:
    if not math.isfinite(fraction) or not 0.0 < fraction <= 1.0:
        raise PolicyError(f"{shown(text)}: a fraction of the device must be above 0 and at most 1 (100%)")
    if fraction < MIN_FRACTION:
        raise PolicyError(
            f"{shown(text)}: a fraction this small is less than {MIN_CAP_TEXT} of any GPU; a cap must be at least "
            f"{MIN_CAP_TEXT}"
        )
    return CapSpec(fraction=fraction, text=text)


def _bytes_spec(nbytes: int, text: str) -> CapSpec:
    if nbytes < MIN_CAP:
        raise PolicyError(
            f"{shown(text)}: a cap in bytes must be at least {MIN_CAP_TEXT}; write a fraction as 0.3 or 30%"
        )
    if nbytes > MAX_DEVICE:
        raise PolicyError(f"{shown(text)} is larger than any GPU")
    return CapSpec(nbytes=nbytes, text=text)


def format_bytes(nbytes: Optional[int]) -> str:
    """12884901888 -> '12.0 GiB'; None -> '-'."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover
