"""Who gets which cap, and what the watchdog does: the admin's settings validated, a kernel's cap resolved.

Pure: no I/O, no Jupyter imports, stdlib only. Each setting's name, default, choices and range come from
the table in `settings`; its parsing is here (`parse_value`), used by the server's start, `jupyter
gpu-quota check` and the hub alike. Sizes and their parsing live in `shared.sizes` (the kernel's `%gpucap`
uses them too); they are imported here so the policy's callers find them in one place.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

from .settings import CHOICE, COUNT, DEFAULTS, SECONDS, SETTINGS, SettingError, parsed
from .shared.sizes import (  # noqa: F401  (re-exported: the server side imports sizes with the policy)
    MIN_CAP,
    CapSpec,
    GiB,
    KiB,
    MiB,
    PolicyError,
    TiB,
    format_bytes,
    parse_cap,
    shown,
)

RULE_KEYS = ("user", "kernelspec", "cap", "max_cap", "devices")


# --- rules -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One entry of `c.GpuQuota.caps`: the first rule whose patterns match a kernel gives its cap."""

    cap: CapSpec
    max_cap: Optional[CapSpec] = None
    user: str = "*"
    kernelspec: str = "*"
    devices: int = 1
    label: str = "rule"

    def matches(self, user: str, kernelspec: str) -> bool:
        return fnmatch.fnmatchcase(user, self.user) and fnmatch.fnmatchcase(kernelspec, self.kernelspec)


def parse_rule(entry: Any, position: int, where: Optional[str] = None) -> Rule:
    """One rule from config, e.g. {"kernelspec": "big-*", "cap": "0.5", "max_cap": "0.8", "devices": 2}."""
    where = where or f"caps[{position}]"
    if not isinstance(entry, Mapping):
        raise PolicyError(f"{where} must be a dict like {{'user': 'alice', 'cap': '0.5'}}, not {shown(entry)}")
    unknown = sorted(set(entry) - set(RULE_KEYS), key=str)
    if unknown:
        raise PolicyError(f"{where} has unknown keys {shown(unknown)}; known keys are {list(RULE_KEYS)}")
    if "cap" not in entry:
        raise PolicyError(f"{where} needs a 'cap'")
    for key in ("user", "kernelspec"):
        if key in entry and not isinstance(entry[key], str):
            raise PolicyError(f"{where}['{key}'] must be a string (a name or a glob pattern)")
    devices = entry.get("devices", 1)
    if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= 64:
        raise PolicyError(f"{where}['devices'] must be a whole number from 1 to 64, not {shown(devices)}")
    try:
        cap = parse_cap(entry["cap"])
        max_cap = parse_cap(entry["max_cap"]) if entry.get("max_cap") is not None else None
    except PolicyError as error:
        raise PolicyError(f"{where}: {error}") from None
    label_parts = [f"{key}={entry[key]}" for key in ("user", "kernelspec") if key in entry]
    return Rule(
        cap=cap,
        max_cap=max_cap,
        user=entry.get("user", "*"),
        kernelspec=entry.get("kernelspec", "*"),
        devices=devices,
        label=f"rule {position}" + (f" ({', '.join(label_parts)})" if label_parts else ""),
    )


RuleSource = Union[Sequence[Any], Callable[[str, str], Any]]


@dataclass(frozen=True)
class Policy:
    """The admin's whole configuration, validated. Built once at server start."""

    default_cap: CapSpec
    max_cap: CapSpec
    rules: Union[tuple, Callable[[str, str], Any]] = ()
    overcommit: Optional[float] = DEFAULTS["overcommit"]
    placement: str = DEFAULTS["placement"]
    on_full: str = DEFAULTS["on_full"]
    on_over_max: str = DEFAULTS["on_over_max"]

    def describe(self) -> dict:
        """What the status API and the magic show of the policy (JSON-ready)."""
        return {
            "default_cap": str(self.default_cap),
            "max_cap": str(self.max_cap),
            "rules": "callable" if callable(self.rules) else len(self.rules),
            "overcommit": self.overcommit,
            "placement": self.placement,
            "on_full": self.on_full,
            "on_over_max": self.on_over_max,
        }


def build_policy(
    default_cap: Any,
    max_cap: Any,
    caps: RuleSource = DEFAULTS["caps"],
    overcommit: Any = DEFAULTS["overcommit"],
    placement: str = DEFAULTS["placement"],
    on_full: str = DEFAULTS["on_full"],
    on_over_max: str = DEFAULTS["on_over_max"],
) -> Policy:
    """Validate every setting; raise a SettingError (a PolicyError) naming the first bad one and its value."""
    default = parsed("default_cap", parse_cap, default_cap)
    maximum = parsed("max_cap", parse_cap, max_cap)
    _check_not_above("default_cap", default, maximum)
    if callable(caps):
        rules: Union[tuple, Callable[[str, str], Any]] = caps
    else:
        if isinstance(caps, (str, bytes)) or not isinstance(caps, Sequence):
            raise SettingError("caps", caps, SETTINGS["caps"].must)
        rules = tuple(parsed("caps", lambda entry, i=i: parse_rule(entry, i), entry) for i, entry in enumerate(caps))
        for rule in rules:
            _check_not_above(f"caps: {rule.label} cap", rule.cap, rule.max_cap or maximum)
    return Policy(
        default_cap=default,
        max_cap=maximum,
        rules=rules,
        overcommit=parse_setting("overcommit", overcommit),
        placement=parse_setting("placement", placement),
        on_full=parse_setting("on_full", on_full),
        on_over_max=parse_setting("on_over_max", on_over_max),
    )


def _check_not_above(name: str, cap: CapSpec, maximum: CapSpec) -> None:
    if _is_above(cap, maximum):
        raise PolicyError(f"{name} {cap} is above max_cap {maximum}")


def _is_above(cap: CapSpec, maximum: CapSpec) -> bool:
    # Comparable only when both are written the same way; mixed kinds are checked per device later.
    if cap.fraction is not None and maximum.fraction is not None:
        return cap.fraction > maximum.fraction
    if cap.nbytes is not None and maximum.nbytes is not None:
        return cap.nbytes > maximum.nbytes
    return False


def parse_overcommit(value: Any) -> Optional[float]:
    """None / "" / "none" = no admission control; else a positive factor (1.0 = grant at most the device)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    row = SETTINGS["overcommit"]
    factor = _number(value, row.must)
    if factor <= row.low or factor > row.high:
        raise PolicyError(row.must)
    return factor


def parse_slack(value: Any) -> CapSpec:
    """Slack over the cap: bytes ("1GiB", 1073741824), a fraction of the kernel's cap ("0.1", "10%") or 0."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return CapSpec(nbytes=0, text="0")
    if isinstance(value, str) and value.strip() in ("0", "0B", "0b", "0%"):
        return CapSpec(nbytes=0, text=value.strip())
    return parse_cap(value)


def parse_user_budget(value: Any) -> Optional[CapSpec]:
    """The most one user's grants may add up to on a device: a cap's forms, or "none" (the device's budget only)."""
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    return parse_cap(value)


def parse_value(name: str, value: Any) -> Any:
    """One setting's value parsed the way the server parses it (choices and ranges from the table);
    PolicyError says why not. The server's settings and the hub's per-user mapping both come here."""
    row = SETTINGS[name]
    if row.kind == CHOICE:
        if not isinstance(value, str) or value.strip().lower() not in row.choices:
            raise PolicyError(row.must)
        return value.strip().lower()
    if row.kind == SECONDS:
        if value is None and row.default is None:
            return None
        seconds = _number(value, row.must)
        if not row.low <= seconds <= row.high:
            raise PolicyError(row.must)
        return seconds
    if row.kind == COUNT:
        number = _number(value, row.must)
        if number != int(number) or not row.low <= number <= row.high:
            raise PolicyError(row.must)
        return int(number)
    return _PARSERS[name](value)


def parse_setting(name: str, value: Any) -> Any:
    """`parse_value`, its refusal naming the setting and the value (a SettingError)."""
    return parsed(name, lambda v: parse_value(name, v), value)


def _number(value: Any, must: str) -> float:
    if isinstance(value, bool):
        raise PolicyError(must)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PolicyError(must) from None
    if not math.isfinite(number):
        raise PolicyError(must)
    return number


_PARSERS: Dict[str, Callable[[Any], Any]] = {
    "default_cap": parse_cap,
    "max_cap": parse_cap,
    "overcommit": parse_overcommit,
    "slack": parse_slack,
    "user_budget": parse_user_budget,
}


@dataclass(frozen=True)
class PolicyDecision:
    """What policy gives one kernel: its cap and the most it may ask for, on how many devices, and why."""

    cap: CapSpec
    max_cap: CapSpec
    devices: int
    source: str


def resolve(policy: Policy, user: str, kernelspec: str) -> PolicyDecision:
    """The first matching rule wins; a callable rule returns a cap, a rule dict, or None (= default).

    The server calls a callable off its event loop and handles its failures (GpuQuotaManager); here a
    failure is a PolicyError."""
    if callable(policy.rules):
        try:
            answer = policy.rules(user, kernelspec)
        except Exception as error:
            raise PolicyError(
                f"c.GpuQuota.caps callable failed for user {shown(user)}, kernelspec {shown(kernelspec)}: "
                f"{shown(error)}"
            ) from None
        return resolve_answer(policy, answer)
    for rule in policy.rules:
        if rule.matches(user, kernelspec):
            return PolicyDecision(rule.cap, rule.max_cap or policy.max_cap, rule.devices, rule.label)
    return default_decision(policy)


def default_decision(policy: Policy, source: str = "default") -> PolicyDecision:
    return PolicyDecision(policy.default_cap, policy.max_cap, 1, source)


def resolve_answer(policy: Policy, answer: Any) -> PolicyDecision:
    """A caps callable's answer, treated like a rule: None is the default policy; a cap or a rule dict
    gets the rule's max_cap (its own, else c.GpuQuota.max_cap), and a cap above it is clamped to it
    (a list rule above its max_cap stops the server at start; a callable's answer cannot, so it is clamped).
    PolicyError when the answer is not a cap or a rule."""
    if answer is None:
        return default_decision(policy)
    rule = parse_rule(answer if isinstance(answer, Mapping) else {"cap": answer}, 0, where="the caps callable's answer")
    maximum = rule.max_cap or policy.max_cap
    if _is_above(rule.cap, maximum):
        return PolicyDecision(maximum, maximum, rule.devices, f"caps callable (clamped to max_cap {maximum})")
    # Mixed forms (a size against a fraction) are compared per device: the ledger never grants above max_cap.
    return PolicyDecision(rule.cap, maximum, rule.devices, "caps callable")
