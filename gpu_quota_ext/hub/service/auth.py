"""Who calls: the hub says whose a token is and what it may do (JupyterHub's HubAuth, its answers cached a short
while), and the hub's directory whether that user is an admin. The user is the token's owner, never anything in a
request's body.

A token must be given access to this service (the hub's access scopes for it, as a JupyterHub service checks:
HubAuthenticated.hub_scopes); being some user's or service's token is not enough. A service's token may look (with
ADMIN_SCOPE), never hold grants. Failed authentications count against the caller's address (guard.py): past its
limit, only a token the hub confirmed lately is asked about. Concurrent calls with one token share one check with
the hub. The hub down or failing: 503, never a grant without knowing who asks. Tokens are never logged.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Dict, Mapping, Optional, Set

from jupyterhub.services.auth import HubAuth, HubOAuth, check_scopes  # type: ignore[import-untyped]
from tornado import web

from ...shared.service_contract import ADMIN_SCOPE, SERVICE_NAME
from .guard import Guard, token_digest
from .hub_directory import HubDirectory, HubUnavailable


class Who:
    """The owner of a call's token, as the hub says: a user's name or "service:NAME", admin or not."""

    def __init__(self, name: str, admin: bool, model: Mapping[str, Any]):
        self.name, self.admin, self.model = name, admin, model

    def require_user(self) -> None:
        """Grants and leases are users' (their servers'): a service may look (with the admin scope), not hold."""
        if self.model.get("kind", "user") != "user":
            raise web.HTTPError(403, "only a hub user's token can hold grants or renew a lease")


class ServiceAuth:
    """The hub's side of every call, from the JUPYTERHUB_* environment (HubAuth reads it): token checks, the OAuth
    of the admin's page, the users' directory."""

    def __init__(self, guard: Guard, cache_seconds: float) -> None:
        self.guard = guard
        self.hub_auth = HubAuth(cache_max_age=int(cache_seconds))
        self.hub_oauth = HubOAuth(cache_max_age=int(cache_seconds))
        self.directory = HubDirectory(self.hub_auth.api_url, self.hub_auth.api_token, cache_seconds)
        self._identifying: Dict[str, asyncio.Future] = {}  # token digest -> its check with the hub under way

    def access_scopes(self) -> Set[str]:
        """The scopes a token needs to use this service at all: what the hub gives the service as its access
        scopes (HubAuth.access_scopes, from $JUPYTERHUB_OAUTH_ACCESS_SCOPES), else access to it by name."""
        return set(self.hub_auth.access_scopes) or service_access_scopes()

    async def identify(self, handler: web.RequestHandler) -> Who:
        """Who owns the call's token, as the hub says. A token whose owner has no call left on the handler's route
        is refused before it is checked (guard.before_hub). Concurrent calls with one token share one check: a
        flood's calls never queue hundreds of the same question to the hub (tornado's client asks 10 at a time,
        and the other users' checks would wait behind them)."""
        token = self.hub_auth.get_token(handler, in_cookie=False)
        address = handler.request.remote_ip or ""
        self.guard.before_hub(token, address, getattr(handler, "route", "status"))
        key = token_digest(token) if token else ""
        checking = self._identifying.get(key)
        if checking is None:
            checking = asyncio.ensure_future(self._identify(token))
            self._identifying[key] = checking
            checking.add_done_callback(lambda _: self._identifying.pop(key, None))
        try:
            who = await asyncio.shield(checking)
        except web.HTTPError as error:
            if error.status_code < 500:
                self.guard.failed(address)
            raise
        self.guard.confirmed(token, who.name)
        return who

    async def _identify(self, token: Optional[str]) -> Who:
        if not token:
            raise web.HTTPError(
                401, "this API needs a hub token: Authorization: token <your server's JUPYTERHUB_API_TOKEN>"
            )
        try:
            model = await self.hub_auth.user_for_token(token, sync=False)
        except web.HTTPError as error:
            if error.status_code < 500:
                raise
            # The hub is down or failing: a clear "try again", never a grant without knowing who asks.
            raise web.HTTPError(503, "the hub did not answer: this token cannot be checked now") from None
        if not model:
            raise web.HTTPError(403, "the hub does not know this token")
        return await self.who_for_model(model)

    async def who_for_model(self, model: Mapping[str, Any]) -> Who:
        """Who a token's model (the hub's answer, or the admin page's OAuth user) is, if it may use this service."""
        return await who_for_model(model, self.access_scopes(), self.directory)


def service_access_scopes() -> Set[str]:
    """Access to this service by name: the scope a token needs when the hub names no access scopes for it."""
    return {f"access:services!service={os.environ.get('JUPYTERHUB_SERVICE_NAME') or SERVICE_NAME}"}


async def who_for_model(model: Mapping[str, Any], access: Set[str], directory: HubDirectory) -> Who:
    """A token's owner, given the hub's model of it: refused (403) without access to this service, a service
    without ADMIN_SCOPE; a user's admin flag is the hub directory's (503 when the hub does not answer)."""
    scopes = set(model.get("scopes") or ())
    try:
        allowed = check_scopes(access, scopes)
    except ValueError:  # a scope the hub's own parser cannot read: no access, not a traceback
        allowed = set()
    if not allowed:
        # As a JupyterHub service checks (HubAuthenticated.hub_scopes): a token must be given access to
        # this service; being some user's or service's token is not enough.
        raise web.HTTPError(403, f"this token was not given access to this service: it needs {sorted(access)}")
    if model.get("kind", "user") != "user":
        if ADMIN_SCOPE in scopes:
            return Who(f"service:{model['name']}", True, model)
        raise web.HTTPError(403, f"service {model.get('name')} is not a user and lacks {ADMIN_SCOPE}")
    try:
        user = await directory.user(model["name"])
    except HubUnavailable as error:
        raise web.HTTPError(503, f"cannot ask the hub about this user: {error}") from None
    return Who(user.name, user.admin or ADMIN_SCOPE in scopes, model)
