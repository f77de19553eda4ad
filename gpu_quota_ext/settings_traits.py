"""The settings tables made into traitlets: one trait per row, its type from the row's kind, its default and help
the row's. The one place that says which trait holds which kind of setting, for both apps that read the rows.

The two apps differ on purpose, so each has its own small table of kind -> trait below:
- the server (c.GpuQuota, app.py; rows of settings.SETTINGS) reads environment variables, which JupyterHub's
  spawners set per user: a trait's default is its variable's value when set (SettingTrait.default), its help
  names the variable, and its tag carries it (env=...). It is lenient in what a value may be written as (a cap
  or a size as a fraction, a percentage, a size or bytes, as text or as a number; a number as its text) and
  refuses a bad value, from config or the environment, in the extension's one line, `c.GpuQuota.NAME = VALUE:
  what it must be`, which stops the server at start;
- the host service (c.GpuQuotaService, hub/service/app.py; rows of settings.SERVICE_SETTINGS) is strict: plain
  traitlets with traitlets' own checks, nothing read from the environment; a cap or a size stays its text, parsed
  where the service builds its policy and broker. A bad value stops the service at start, where it reads it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Protocol, TypeVar

from traitlets import (
    Bool,
    CaselessStrEnum,
    Enum,
    Float,
    Int,
    List,
    TraitError,
    TraitType,
    Type,
    Unicode,
)
from traitlets import Callable as CallableTrait
from traitlets import Dict as DictTrait
from traitlets import Union as UnionTrait

from .settings import (
    CAP,
    CHOICE,
    CLASS,
    COUNT,
    FACTOR,
    FLAG,
    MAPPING,
    RATE,
    RULES,
    SECONDS,
    SERVICE_SETTINGS,
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


# --- kind -> trait, the server's and the host service's ----------------------------------------------------
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


def _service_given(row: Setting) -> Dict[str, Any]:
    """The service's help, the row's; None allowed where the row says so or its default is None."""
    return {"help": row.help, "allow_none": row.nullable or row.default is None}


def _bounds(row: Setting, whole: bool = False) -> Dict[str, Any]:
    """The row's range as the trait's min and max, where it has one (traitlets' own default is no bound)."""
    bounds = {"min": row.low, "max": row.high}
    return {key: int(value) if whole else value for key, value in bounds.items() if value is not None}


def _service_number(row: Setting) -> TraitType:
    return Float(row.default, **_service_given(row), **_bounds(row))


def _service_text(row: Setting) -> TraitType:
    # A cap or a size as its text ("0.25", "1GiB"): parsed where the service builds its policy and broker.
    return Unicode(row.default, **_service_given(row))


# The host service's: plain traitlets, strict, nothing from the environment.
SERVICE_TRAITS: Mapping[str, Callable[[Setting], TraitType]] = {
    CHOICE: lambda row: Enum(row.choices, row.default, **_service_given(row)),
    SECONDS: _service_number,
    FACTOR: _service_number,
    RATE: _service_number,
    COUNT: lambda row: Int(row.default, **_service_given(row), **_bounds(row, whole=True)),
    CAP: _service_text,
    SIZE: _service_text,
    SLACK: _service_text,
    TEXT: _service_text,
    CLASS: lambda row: Type(row.default, klass=row.klass, help=row.help),
    FLAG: lambda row: Bool(row.default, help=row.help),
    MAPPING: lambda row: DictTrait(help=row.help),
}


T = TypeVar("T", bound=TraitType)


def _made(table: str, row: Setting, kinds: Mapping[str, Callable[[Setting], T]]) -> T:
    """The row's trait, made by its kind's entry in one of the tables above (untagged)."""
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


def service_trait(name: str) -> TraitType:
    """The host service's trait of one row of settings.SERVICE_SETTINGS (c.GpuQuotaService)."""
    return _made("SERVICE_SETTINGS", SERVICE_SETTINGS[name], SERVICE_TRAITS).tag(config=True)
