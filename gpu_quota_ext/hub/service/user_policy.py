"""Each user's policy on the host, from the hub's mapping: the one `configure_hub_caps` takes.

Pure. The mapping (users, groups, default, and groups' "gpu_quota" properties) is layered exactly as
for the spawner's environment (`gpu_quota_ext.hub.choose_settings`); what the service takes of it per
user is the kernel's cap (`default_cap`), the most it may ask for (`max_cap`) and what a full host does
to its start (`on_full`). Budget and placement (`overcommit`, `placement`) and `on_over_max` are the
host's: the service's own settings, one value for every user, since one budget is shared.

The caps come from the hub side only: the user's name and groups are what the hub says of the token's
owner, never what a request carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from ...policy import Policy, PolicyDecision, parse_cap
from ..caps import HubCaps, choose_settings, environment_of

USER_KEYS = ("default_cap", "max_cap", "on_full")


@dataclass(frozen=True)
class UserPolicy:
    """What one user's kernels get: `decision` for every kernel they start, and `on_full`."""

    decision: PolicyDecision
    on_full: str

    def describe(self) -> dict:
        return {
            "default_cap": str(self.decision.cap),
            "max_cap": str(self.decision.max_cap),
            "on_full": self.on_full,
            "source": self.decision.source,
        }


def user_policy(caps: HubCaps, host: Policy, user: str, groups: Iterable[Any] = ()) -> UserPolicy:
    """`user`'s policy: each of USER_KEYS from the mapping (their entry, their first group with settings,
    the default), else the host's own setting. Raises PolicyError (naming the user and the source) when
    the mapping's result is invalid, like a spawn would."""
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
    return UserPolicy(PolicyDecision(cap, maximum, 1, source), chosen.get("on_full", host.on_full))
