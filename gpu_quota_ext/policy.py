"""Who gets which cap, and what the watchdog does: the admin's settings validated, a kernel's cap resolved.

Pure: no I/O, no Jupyter imports, stdlib only. Each setting's name, default, choices, range and parsing come
from the table in `settings` (`parse_value`, used by the server's start, `jupyter gpu-quota check` and the hub
alike); here are the rules and how the settings hold together. Sizes and their parsing live in `shared.sizes`
(the kernel's `%gpucap` uses them too): import each name from the module where it lives.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

from .settings import (
    DEFAULTS,
    POLICY,
    parsed,
    validated,
)
from .shared.sizes import (
    CapSpec,
    PolicyError,
    parse_cap,
    shown,
)
from .shared.spelling import did_you_mean

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
        guess = did_you_mean(unknown, RULE_KEYS)
        raise PolicyError(f"{where} has unknown keys {shown(unknown)}; known keys are {list(RULE_KEYS)}{guess}")
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


def build_policy(*args: Any, **given: Any) -> Policy:
    """The policy from its settings (the table's POLICY rows: in its order, or by name), each validated, then
    how they hold together; a SettingError (a PolicyError) names the first bad one and its value."""
    values = validated(POLICY, args, given)
    _check_not_above("default_cap", values["default_cap"], values["max_cap"])
    if not callable(values["rules"]):
        values["rules"] = tuple(
            parsed("caps", functools.partial(parse_rule, position=i), entry) for i, entry in enumerate(values["rules"])
        )
        for rule in values["rules"]:
            _check_not_above(f"caps: {rule.label} cap", rule.cap, rule.max_cap or values["max_cap"])
    return Policy(**values)


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
        except Exception as error:  # the admin's code may raise anything: not swallowed, a PolicyError naming it
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


def resolve_answer(policy: Policy, answer: object) -> PolicyDecision:
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
