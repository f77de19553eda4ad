"""What the hub says about a user: their groups (with properties) and whether they are an admin.

Asked with the service's own token (its role needs `read:users` and `read:groups`), never with the
user's: what a user's token may read about itself is the user's business, the caps are the hub's.
Answers are kept for `ttl` seconds, so a group property edited through the hub's API counts within that.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from ..caps import HubGroup


class HubUnavailable(Exception):
    """The hub did not answer a lookup (down, or the service's token lacks a scope: the message says)."""


@dataclass(frozen=True)
class HubUser:
    name: str
    admin: bool
    groups: Tuple[HubGroup, ...]


class HubDirectory:
    def __init__(self, api_url: str, token: str, ttl: float = 10.0, timeout: float = 10.0):
        self.api_url = api_url.rstrip("/")
        self._token = token  # never logged, never written
        self.ttl = ttl
        self.timeout = timeout
        self._users: Dict[str, Tuple[float, HubUser]] = {}
        self._groups: Dict[str, Tuple[float, HubGroup]] = {}

    async def _get(self, path: str) -> Optional[dict]:
        request = HTTPRequest(
            self.api_url + path, headers={"Authorization": f"token {self._token}"}, request_timeout=self.timeout
        )
        try:
            response = await AsyncHTTPClient().fetch(request, raise_error=False)
        except OSError as error:
            raise HubUnavailable(f"the hub's API did not answer ({error.__class__.__name__})") from None
        if response.code == 404:
            return None
        if response.code != 200:
            raise HubUnavailable(f"the hub's API answered {response.code} to GET {path.split('?')[0]}")
        return json.loads(response.body)

    async def user(self, name: str) -> HubUser:
        now = time.monotonic()
        cached = self._users.get(name)
        if cached and now - cached[0] < self.ttl:
            return cached[1]
        model = await self._get(f"/users/{quote(name, safe='')}")
        if model is None:
            raise HubUnavailable(f"the hub knows no user {name!r}")
        groups = tuple([await self.group(g) for g in model.get("groups") or []])
        user = HubUser(name, bool(model.get("admin")), groups)
        self._users[name] = (now, user)
        return user

    async def group(self, name: str) -> HubGroup:
        now = time.monotonic()
        cached = self._groups.get(name)
        if cached and now - cached[0] < self.ttl:
            return cached[1]
        model = await self._get(f"/groups/{quote(name, safe='')}")
        group = HubGroup(name, dict((model or {}).get("properties") or {}))
        self._groups[name] = (now, group)
        return group

    def known(self) -> Dict[str, HubUser]:
        return {name: user for name, (_, user) in self._users.items()}
