"""The host service's traits, one per row of settings.SERVICE_SETTINGS: its type from the row's kind, its default
and help the row's. The server's traits come from the same rows the same way (app.py, setting_trait); the
service's are plain traitlets (no environment variable, traitlets' own checks): a bad value stops the service at
start, where build() reads it (the policy's and the broker's rows are parsed there as the server parses them).
"""

from __future__ import annotations

from typing import Any, Dict

from traitlets import Bool, Enum, Float, Int, TraitType, Type, Unicode
from traitlets import Dict as DictTrait

from ...settings import (
    CAP,
    CHOICE,
    CLASS,
    COUNT,
    FACTOR,
    FLAG,
    MAPPING,
    RATE,
    SECONDS,
    SERVICE_SETTINGS,
    SIZE,
    SLACK,
    TEXT,
    Setting,
)


def _bounds(row: Setting, whole: bool = False) -> Dict[str, Any]:
    """The row's range as the trait's min and max, where it has one (traitlets' own default is no bound)."""
    bounds = {"min": row.low, "max": row.high}
    return {key: int(value) if whole else value for key, value in bounds.items() if value is not None}


def service_trait(name: str) -> TraitType:
    """The trait of one row of the service's settings table (config=True)."""
    row = SERVICE_SETTINGS[name]
    # traitlets' stubs type allow_none as a literal: given through a mapping, it is the row's.
    common: Dict[str, Any] = {"help": row.help, "allow_none": row.nullable or row.default is None}
    trait: TraitType
    if row.kind == CHOICE:
        trait = Enum(row.choices, row.default, **common)
    elif row.kind in (SECONDS, FACTOR, RATE):
        trait = Float(row.default, **common, **_bounds(row))
    elif row.kind == COUNT:
        trait = Int(row.default, **common, **_bounds(row, whole=True))
    elif row.kind in (CAP, SIZE, SLACK, TEXT):
        # A cap or a size as its text ("0.25", "1GiB"): parsed where the service builds its policy and broker.
        trait = Unicode(row.default, **common)
    elif row.kind == CLASS:
        trait = Type(row.default, klass=row.klass, help=row.help)
    elif row.kind == FLAG:
        trait = Bool(row.default, help=row.help)
    elif row.kind == MAPPING:
        trait = DictTrait(help=row.help)
    else:
        raise ValueError(f"settings.SERVICE_SETTINGS[{name!r}]: no trait for kind {row.kind!r}")
    return trait.tag(config=True)
