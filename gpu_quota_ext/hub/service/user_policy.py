"""Each user's policy on the host, from the hub's mapping: the one `configure_hub_caps` takes, plus the host's
limits on each user.

Pure. The mapping (users, groups, default, and groups' "gpu_quota" properties) is layered exactly as
for the spawner's environment (`gpu_quota_ext.hub.choose_settings`); what the service takes of it per
user is the kernel's cap (`default_cap`), the most it may ask for (`max_cap`), what a full host does
to its start (`on_full`), and the user's limits (`max_kernels`, `user_budget`: the settings table's HOST
rows, hub.HOST_KEYS). Budget and placement (`overcommit`, `placement`) and `on_over_max` are the
host's: the service's own settings, one value for every user, since one budget is shared.

The caps come from the hub side only: the user's name and groups are what the hub says of the token's
owner, never what a request carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from ...devices import Device
from ...policy import Policy, PolicyDecision
from ...settings import DEFAULTS, parse_value
from ...shared.sizes import CapSpec, parse_cap
from ..caps import HubCaps, choose_settings, environment_of

USER_KEYS = ("default_cap", "max_cap", "on_full")  # what a kernel's grant says it came from


@dataclass(frozen=True)
class UserLimits:
    """What one user may hold on the host at once, whatever their kernels ask."""

    max_kernels: int = DEFAULTS["max_kernels"]
    user_budget: Optional[CapSpec] = parse_value("user_budget", DEFAULTS["user_budget"])  # None: no per-user budget

    def budget_on(self, device: Device) -> Optional[int]:
        """The most this user's grants may add up to on `device`, in bytes (None: only the device's budget)."""
        if self.user_budget is None:
            return None
        return self.user_budget.to_bytes(device.total, f"device {device.index}")

    def describe(self) -> dict:
        return {"max_kernels": self.max_kernels, "user_budget": str(self.user_budget or "none")}


BUILT_IN_LIMITS = UserLimits()


def host_limits(max_kernels: Any = DEFAULTS["max_kernels"], user_budget: Any = DEFAULTS["user_budget"]) -> UserLimits:
    """The host's own limits (the service's settings, for users the mapping sets none for); PolicyError if bad."""
    return UserLimits(parse_value("max_kernels", max_kernels), parse_value("user_budget", user_budget))


@dataclass(frozen=True)
class UserPolicy:
    """What one user's kernels get: `decision` for every kernel they start, `on_full`, and the user's limits."""

    decision: PolicyDecision
    on_full: str
    limits: UserLimits = BUILT_IN_LIMITS

    def describe(self) -> dict:
        return {
            "default_cap": str(self.decision.cap),
            "max_cap": str(self.decision.max_cap),
            "on_full": self.on_full,
            **self.limits.describe(),
            "source": self.decision.source,
        }


def user_policy(
    caps: HubCaps, host: Policy, user: str, groups: Iterable[Any] = (), limits: UserLimits = BUILT_IN_LIMITS
) -> UserPolicy:
    """`user`'s policy: each of USER_KEYS and caps.HOST_KEYS from the mapping (their entry, their first group
    with settings, the default), else the host's own setting (`host`, `limits`). Raises PolicyError (naming the
    user and the source) when the mapping's result is invalid, like a spawn would."""
    chosen, sources = choose_settings(caps, user, groups)
    environment_of(chosen, sources, user)  # the combination checked as for a spawned server
    cap = parse_cap(chosen["default_cap"]) if "default_cap" in chosen else host.default_cap
    maximum = parse_cap(chosen["max_cap"]) if "max_cap" in chosen else host.max_cap
    if cap.fraction is not None and maximum.fraction is not None and cap.fraction > maximum.fraction:
        cap = maximum  # the host's default above the mapping's max_cap: max_cap wins
    if cap.nbytes is not None and maximum.nbytes is not None and cap.nbytes > maximum.nbytes:
        cap = maximum
    used = [f"{key} from {sources[key]}" for key in USER_KEYS if key in chosen]
    source = "hub: " + (", ".join(used) if used else "the service's defaults")
    return UserPolicy(
        PolicyDecision(cap, maximum, 1, source), chosen.get("on_full", host.on_full), _limits(chosen, limits)
    )


def _limits(chosen: Mapping[str, str], host: UserLimits) -> UserLimits:
    return UserLimits(
        parse_value("max_kernels", chosen["max_kernels"]) if "max_kernels" in chosen else host.max_kernels,
        parse_value("user_budget", chosen["user_budget"]) if "user_budget" in chosen else host.user_budget,
    )
