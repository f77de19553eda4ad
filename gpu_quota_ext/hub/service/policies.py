"""Each user's policy on the host as the hub's mapping and the user's groups (asked of the hub) give it
(user_policy.py decides; this asks and keeps): refreshed at each grant, kept for the status and the admin's page,
its limits handed to the book.
"""

from __future__ import annotations

import asyncio
from typing import Dict, Iterable

from tornado import web

from ...policy import Policy
from ...shared.sizes import PolicyError
from ..caps import HubCaps
from .book import HostBook
from .hub_directory import HubDirectory, HubUnavailable
from .user_policy import UserLimits, UserPolicy, user_policy


class UserPolicies:
    def __init__(self, caps: HubCaps, host_policy: Policy, limits: UserLimits, book: HostBook) -> None:
        self.caps, self.host_policy, self.limits, self.book = caps, host_policy, limits, book
        self.known: Dict[str, UserPolicy] = {}  # the last policy of each user asked about

    async def policy_for(self, name: str, directory: HubDirectory) -> UserPolicy:
        """`name`'s policy now: 503 when the hub does not answer, 409 when its caps for them are invalid."""
        try:
            user = await directory.user(name)
            policy = user_policy(self.caps, self.host_policy, name, user.groups, self.limits)
        except HubUnavailable as error:
            raise web.HTTPError(503, f"cannot ask the hub for {name}'s groups: {error}") from None
        except PolicyError as error:
            raise web.HTTPError(409, f"the hub's caps for {name} are invalid: {error}") from None
        self.known[name] = policy
        self.book.set_limits(name, policy.limits)
        return policy

    async def refresh(self, names: Iterable[str], directory: HubDirectory) -> None:
        """Each user's policy asked again; one that cannot be had is left out of the status rather than failing
        it for everyone."""
        await asyncio.gather(*(self._quietly(name, directory) for name in names))

    async def _quietly(self, name: str, directory: HubDirectory) -> None:
        try:
            await self.policy_for(name, directory)
        except web.HTTPError:
            pass  # the status shows no policy for this user rather than failing for everyone
