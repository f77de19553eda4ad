"""The settings tables made into traitlets: one trait per row, its type from the row's kind, its default and help
the row's.

- the server (c.GpuQuota, app.py; rows of settings.SETTINGS) reads environment variables, which JupyterHub's
  spawners set per user: a trait's default is its variable's value when set (SettingTrait.default), its help
  names the variable, and its tag carries it (env=...). It is lenient in what a value may be written as (a cap
  or a size as a fraction, a percentage, a size or bytes, as text or as a number; a number as its text) and
  refuses a bad value, from config or the environment, in the extension's one line, `c.GpuQuota.NAME = VALUE:
  what it must be`, which stops the server at start.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Protocol, TypeVar

from traitlets import Callable as CallableTrait
from traitlets import (
    CaselessStrEnum,
    Float,
    Int,
    List,
    TraitError,
    TraitType,
    Type,
    Unicode,
)
from traitlets import Union as UnionTrait

from .settings import (
    CAP,
    CHOICE,
    CLASS,
    FACTOR,
    RULES,
    SECONDS,
    SETTINGS,
    SIZE,
    SLACK,
    TEXT,
    Setting,
    SettingError,
    as_text,
    parse_value,
)
from .shared.sizes import PolicyError

# --- the server's trait classes ---------------------------------------------------------------------------


class SettingsOwner(Protocol):
    """What holds setting traits (GpuQuota): each one's default, read from its environment variable."""

    def _from_env(self, name: str) -> object: ...


class SettingTrait(TraitType):
    """A GpuQuota setting's trait: its default from its environment variable (GpuQuota._from_env), and a bad
    value refused in the extension's one line, `c.GpuQuota.NAME = VALUE: what it must be`, VALUE as written."""

    row: Setting

    @property
    def setting(self) -> str:
        """The setting's name: the trait's, once it is a GpuQuota attribute (the row's, which is the same, before)."""
        return self.name or self.row.name

    def default(self, obj: Optional[SettingsOwner] = None) -> object:
        return super().default(obj) if obj is None else obj._from_env(self.setting)

    def validate(self, obj: object, value: object) -> object:
        try:
            typed = self.coerce(value)
            # A mixin: validate is the trait class's after this one in the MRO (CaselessStrEnum, Float, ...), which
            # traitlets' TraitType itself does not declare.
            return typed if typed is None and self.allow_none else super().validate(obj, typed)  # type: ignore[misc]
        except (TraitError, ValueError, PolicyError):
            raise TraitError(str(SettingError(self.setting, value, self.row.must))) from None

    def coerce(self, value: object) -> object:
        """A value as written in a config file, on the command line or in the environment, made the trait's type."""
        return value


class ChoiceEnum(SettingTrait, CaselessStrEnum):
    def from_string(self, s: str) -> str:
        return s  # validate reads the text, so that a refusal shows it as written

    def coerce(self, value: object) -> object:
        return value.strip() if isinstance(value, str) else value


class Number(SettingTrait, Float):
    """A number with a range; its text ("0.5" in a config file, on the command line) is read as the number,
    by policy.parse_value as the hub's mapping is: True is no number, NaN is in no range."""

    def from_string(self, s: str) -> str:
        return s  # validate reads the text, so that a refusal shows it as written

    def coerce(self, value: object) -> object:
        return parse_value(self.setting, value)


class SizeOrFraction(SettingTrait, UnionTrait):
    """A string ("0.25", "25%", "12GiB") or a number (0.25, 2**30), kept as the text the environment
    variable would carry: policy.py parses a number from a config file as it parses the same text."""

    def validate(self, obj: object, value: object) -> object:
        value = super().validate(obj, value)
        return value if isinstance(value, (str, bool)) else as_text(value)


class RulesOrCallable(SettingTrait, UnionTrait):
    pass


class Text(SettingTrait, Unicode):
    pass


class PluginClass(SettingTrait, Type):
    pass


# --- kind -> trait ------------------------------------------------------------------------------------------
# Keyword arguments go through dicts: traitlets' overloads want allow_none as a literal True or False, the row
# says which.


def _server_given(row: Setting) -> Dict[str, Any]:
    """The server's default and help: the row's, the help naming the environment variable read."""
    read_from = f" Read from ${row.env} when neither config nor the command line sets it." if row.env else ""
    return dict(default_value=row.default, help=row.help + read_from)


def _server_or_none(row: Setting) -> Dict[str, Any]:
    """The same, None allowed where the row's default is None (a number or a text that may be off)."""
    return dict(allow_none=row.default is None, **_server_given(row))


def _server_number(row: Setting) -> SettingTrait:
    return Number(min=row.low, max=row.high, **_server_or_none(row))


def _size_or_fraction(row: Setting) -> SettingTrait:
    return SizeOrFraction([Unicode(), Int(), Float()], **_server_given(row))


# The server's: lenient traits whose default is their environment variable's value (SettingTrait).
SERVER_TRAITS: Mapping[str, Callable[[Setting], SettingTrait]] = {
    CHOICE: lambda row: ChoiceEnum(row.choices, **_server_given(row)),
    SECONDS: _server_number,
    FACTOR: _server_number,
    CAP: _size_or_fraction,
    SIZE: _size_or_fraction,
    SLACK: _size_or_fraction,
    RULES: lambda row: RulesOrCallable([List(), CallableTrait()], **_server_given(row)),
    TEXT: lambda row: Text(**_server_or_none(row)),
    CLASS: lambda row: PluginClass(klass=row.klass, **_server_given(row)),
}


T = TypeVar("T", bound=TraitType)


def _made(table: str, row: Setting, kinds: Mapping[str, Callable[[Setting], T]]) -> T:
    """The row's trait, made by its kind's entry in the table above (untagged)."""
    make = kinds.get(row.kind)
    if make is None:
        raise ValueError(f"settings.{table}[{row.name!r}]: no trait for kind {row.kind!r}")
    return make(row)


def setting_trait(name: str) -> TraitType:
    """The server's trait of one row of settings.SETTINGS (c.GpuQuota): its type from the row's kind, its
    default the row's (or its environment variable's), its help the row's with the variable named."""
    row = SETTINGS[name]
    trait = _made("SETTINGS", row, SERVER_TRAITS)
    trait.row = row
    return trait.tag(config=True, env=row.env)

