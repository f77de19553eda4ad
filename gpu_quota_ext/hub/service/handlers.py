"""The service's HTTP API (contract.py), thin: authenticate with the hub, read the body, ask the app, answer.

Every API call carries a hub token; the hub says whose it is and what it may do (auth.py): without access to this
service it is a 403. The user is that token's owner, never anything in the body. Bodies over 64 KiB: 413 (from
Content-Length, or as a chunked body grows past it); bodies that are not what the contract says: 400 (bodies.py,
one table per body); another user's kernel: 403; a kernel the service does not know: 404; a grant or cap change
whose caller closed its connection before the service acted (it gave up waiting): nothing done, 499. A lease with
"wait" is a long poll (broker.py): answered when the broker wants some of its server's kernels parked, or after
the wait. Errors are JSON `{"message": ...}` (one write_error, Refusals). Every call passes the service's per-user
limits first (guard.py, in prepare(): calls a second per route, requests open at once, long polls, failed
authentications per address): over one, 429 with `Retry-After`, nothing done. The admin's page is behind hub
OAuth (HubOAuthenticated), and so is its login callback: both bound to the service's own HubOAuth. Tokens are
never logged: tornado's access log prints no headers.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from html import escape
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Type, TypeVar

try:
    from jupyterhub.services.auth import (  # type: ignore[import-untyped]
        HubOAuthCallbackHandler,
        HubOAuthenticated,
    )
except ImportError:  # only the service imports this module, in the hub's environment, which has JupyterHub
    raise SystemExit(
        "gpu-quota-ext: the host quota service needs JupyterHub in its environment: pip install 'gpu-quota-ext[hub]'"
    ) from None
from prometheus_client.exposition import generate_latest
from tornado import web
from tornado.httputil import responses

from ...ledger import AdmissionRefused, UnknownKernel
from ...shared.request_body import BodyRefused, BoundedBody
from ...shared.service_contract import ADMIN_SCOPE
from ...shared.sizes import PolicyError, shown
from .auth import Who
from .bodies import MAX_NAME, parse_change_request, parse_grant_request, parse_lease_request, parse_room_request
from .book import Forbidden
from .guard import TooMany
from .room import RoomRefused

if TYPE_CHECKING:
    from .app import GpuQuotaService

T = TypeVar("T")


def _error_message(status_code: int, error: Optional[BaseException]) -> str:
    """An HTTPError's own message (ours, or JupyterHub's in the OAuth callback), else the status's name."""
    message = None
    if isinstance(error, web.HTTPError) and error.log_message:
        try:
            message = error.log_message % error.args
        except (TypeError, ValueError):
            message = error.log_message
    return message or responses.get(status_code, "error")


def _summary(handler: web.RequestHandler) -> str:
    # What tornado's warnings print of a request: without its query, where a "?token=" could be.
    return f"{handler.request.method} {handler.request.path} ({handler.request.remote_ip})"


class Refusals(web.RequestHandler):
    """What every handler of the service shares: one write_error (the error's one line: JSON `{"message": ...}`
    for the API, a line of HTML for the admin's page), a 429's Retry-After, no traceback logged for a refusal, and
    the guard's count of the caller's open requests given back when the request ends."""

    _request_summary = _summary
    _admitted: Optional[str] = None  # whose open request this is, once the guard counted it
    _disconnect = False  # close the connection once the answer is written (a 429 past the held refusals)
    html_errors = False  # the admin's page answers errors in HTML

    @property
    def service(self) -> GpuQuotaService:
        return self.settings["gpu_quota_service"]

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        error = (kwargs.get("exc_info") or (None, None, None))[1]
        if isinstance(error, TooMany):
            self.set_header("Retry-After", str(error.retry_after))
            if error.disconnect and not self.html_errors:
                self.set_header("Connection", "close")
                self._disconnect = True
        message = _error_message(status_code, error)
        if self.html_errors:
            self.set_header("Content-Type", "text/html; charset=utf-8")
            self.finish(f"<!doctype html><p>{status_code}: {escape(message)}</p>")
        else:
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"message": message}))

    def log_exception(
        self,
        typ: Optional[Type[BaseException]],
        value: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if isinstance(value, TooMany):
            return  # not a line per refused call: the guard says once a minute who is refused
        super().log_exception(typ, value, tb)

    async def admit(self, route: str, who: str) -> None:
        """The caller's per-user limit on `route` (guard.py): over it, the refusal is held a while, then raised."""
        try:
            self.service.guard.admit(route, who)
        except TooMany as refusal:
            await self.service.guard.hold(refusal)
            raise
        self._admitted = who

    def _leave(self) -> None:
        if self._admitted is not None:
            self.service.guard.leave(self._admitted)
            self._admitted = None

    def on_finish(self) -> None:
        self._leave()
        if self._disconnect and self.request.connection is not None:
            self.request.connection.close()  # type: ignore[attr-defined]  # the answer is written: connect again

    def on_connection_close(self) -> None:
        self._leave()


@web.stream_request_body
class ApiHandler(Refusals):
    route = "status"  # which of the per-user limits (guard.ROUTES) this handler's calls count against

    async def prepare(self) -> None:
        # Too large: the body is read and dropped, then refused (413) by body(). A refusal of the token,
        # likewise, is answered once the body is in (shared/request_body.py says why).
        self._body = BoundedBody(self.request.headers)
        self._refusal: Optional[web.HTTPError] = None
        if self._body.malformed is not None:
            # tornado answers 400 and closes when it reads such a body, before any method runs.
            self._refusal = web.HTTPError(400, self._body.malformed)
            return
        try:
            try:
                # The guard refuses a token whose owner has no call left before the hub is asked (auth.py).
                self._who = await self.service.identify(self)
            except TooMany as refusal:
                await self.service.guard.hold(refusal)
                raise
            # The one place every call meets the per-user limits: a refusal costs no parse, no book, no hub.
            await self.admit(self.route, self._who.name)
        except web.HTTPError as refusal:
            # Answered by the method, once the request is all read (its first look at `who` or `body()` raises it),
            # never from here: tornado closes the connection of an answer written before the request was read, and
            # the hub's proxy pools its connections, so the next user's call on that connection would get a 503.
            self._refusal = refusal
            if self._body.follows:
                self._body.drop()

    @property
    def who(self) -> Who:
        """Who asks (every route asks this first); a refusal prepare() decided before the body is raised here."""
        if self._refusal is not None:
            raise self._refusal
        return self._who

    def data_received(self, chunk: bytes) -> None:
        self._body.add(chunk)

    def body(self) -> Any:
        if self._refusal is not None:
            raise self._refusal
        try:
            return self._body.json()
        except BodyRefused as refused:
            raise web.HTTPError(refused.status, str(refused)) from None

    def check_xsrf_cookie(self) -> None:
        return None  # token-authenticated API: no cookies are read

    def give_up_if_caller_gone(self, what: str) -> None:
        """Raise (499, nothing done) when the caller closed its connection before this write: it stopped waiting.
        A service that hung (SIGSTOP, a stalled disk) and resumes still takes the requests queued meanwhile in
        its socket's backlog; a grant made for a start its server gave up and refused would be held by nobody,
        yet count in the user's limits until a lease period passed."""
        stream = getattr(self.request.connection, "stream", None)
        if stream is None:
            return
        gone = stream.closed()
        if not gone:
            try:
                # The raw socket (under TLS too): b"" once the peer closed and the request is all read (a client
                # that half-closes after its request would read as gone: HTTP clients do not).
                gone = socket.socket.recv(stream.socket, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except (BlockingIOError, InterruptedError):
                gone = False  # open, nothing more sent: the caller waits
            except OSError:
                gone = True  # reset by the peer
        if gone:
            raise web.HTTPError(
                499, "the caller stopped waiting before %s: not done", what, reason="Client Closed Request"
            )

    def answer(self, code: int, data: Optional[Dict[str, Any]]) -> None:
        self.set_status(code)
        if data is None:
            self.finish()
        else:
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps(data))


class GrantsHandler(ApiHandler):
    route = "grants"

    async def post(self) -> None:
        self.who.require_user()
        server, kernel_id, kernelspec, allowed = parse_grant_request(self.body())
        book = self.service.book
        policy = await self.service.policy_for(self.who.name)
        indexes = None if allowed is None else book.device_indexes(allowed)
        self.give_up_if_caller_gone(f"kernel {kernel_id} was granted")
        try:
            grant, created = book.grant(self.who.name, server, kernel_id, kernelspec, policy, indexes, time.time())
        except Forbidden:
            raise web.HTTPError(403, f"kernel {kernel_id} is another user's") from None
        except AdmissionRefused as refusal:
            raise web.HTTPError(409, str(refusal)) from None
        self.answer(201 if created else 200, {"grant": book.record(grant)})

    async def get(self) -> None:
        book = self.service.book
        self.answer(200, {"grants": [book.record(o.grant) for o in book.visible(self.who.name, self.who.admin)]})


class GrantHandler(ApiHandler):
    route = "grants"

    def _call(self, method: Callable[..., T], kernel_id: str, *args: Any) -> T:
        try:
            return method(self.who.name, kernel_id, self.who.admin, *args)
        except Forbidden:
            raise web.HTTPError(403, f"kernel {kernel_id} is another user's") from None
        except UnknownKernel:
            raise web.HTTPError(404, f"no grant for kernel {kernel_id}") from None
        except PolicyError as error:
            raise web.HTTPError(400, str(error)) from None

    async def get(self, kernel_id: str) -> None:
        grant = self._call(self.service.book.get, kernel_id)
        self.answer(200, {"grant": self.service.book.record(grant)})

    async def put(self, kernel_id: str) -> None:
        request = parse_change_request(self.body())
        book = self.service.book
        self.give_up_if_caller_gone(f"kernel {kernel_id}'s cap was changed")
        if isinstance(request, str):  # "reset"
            outcome = self._call(book.reset, kernel_id)
        else:
            cap, uuid = request
            device = None if uuid is None else book.device_index(uuid)
            if uuid is not None and device is None:
                raise web.HTTPError(400, f"device {shown(uuid)} is not one of this host's")
            outcome = self._call(book.change, kernel_id, cap, device)
        self.answer(200, {"status": outcome.status, "message": outcome.message, "grant": book.record(outcome.grant)})

    async def delete(self, kernel_id: str) -> None:
        self._call(self.service.book.release, kernel_id)
        self.answer(204, None)


class LeaseHandler(ApiHandler):
    route = "lease"
    _woken: Optional[asyncio.Event] = None
    _gone = False

    async def post(self) -> None:
        self.who.require_user()
        server, kernels, reports, wait = parse_lease_request(self.body())
        guard, user = self.service.guard, self.who.name
        if wait:
            try:
                guard.enter_long_poll(user)  # before anything is done: over the limit, nothing is renewed
            except TooMany as refusal:
                await guard.hold(refusal)
                raise
        self._woken = asyncio.Event()
        try:
            data = await self.service.broker.renew(
                user, server, kernels, reports, wait, self._woken, lambda: self._gone
            )
        finally:
            if wait:
                guard.leave_long_poll(user)
        if data is not None:  # None: nobody to answer; what is asked of this server stays for its next renewal
            self.answer(200, data)

    def on_connection_close(self) -> None:
        self._gone = True
        if self._woken is not None:
            self._woken.set()
        super().on_connection_close()


class RoomHandler(ApiHandler):
    route = "room"

    async def post(self) -> None:
        self.who.require_user()
        server, reports, demands, host_park, may_wait = parse_room_request(self.body())
        self.give_up_if_caller_gone("the host's broker decided")
        try:
            answer = self.service.room_call(self.who.name, server, reports, demands, host_park, may_wait)
        except RoomRefused as refusal:
            raise web.HTTPError(refusal.code, refusal.message) from None
        self.answer(200, answer)


class StatusHandler(ApiHandler):
    async def get(self) -> None:
        self.answer(200, await self.service.status(self.who.name, self.who.admin))


class MetricsHandler(ApiHandler):
    async def get(self) -> None:
        if not self.who.admin:
            raise web.HTTPError(403, f"the metrics need the hub's admin or {ADMIN_SCOPE}")
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.finish(generate_latest(self.service.registry))


class ServiceOAuth(HubOAuthenticated):
    """The OAuth side of the service's handlers, bound to the app's own HubOAuth (settings["hub_oauth"]), as
    JupyterHub's single-user server binds its own. The mixin's default, HubOAuth.instance(), is another
    object: JupyterHub 6 keeps each login's PKCE code verifier in the HubOAuth that began the login, and a
    callback asking another one has none to send ("Code verifier required.")."""

    html_errors = True

    @property
    def hub_auth(self) -> Any:  # jupyterhub.services.auth.HubOAuth, untyped
        return self.settings["hub_oauth"]


class OAuthCallbackHandler(ServiceOAuth, Refusals, HubOAuthCallbackHandler):
    """JupyterHub's own end of the login (state check, code for token, the login cookie), at oauth_callback."""


class PageHandler(ServiceOAuth, Refusals):
    """The admin's page. A signed-in user who is no admin sees their own kernels only. Loads count against the
    viewer's "page" limit (guard.py), as API calls count against theirs."""

    @property
    def hub_scopes(self) -> None:
        return None  # any hub user may look: what they see depends on who they are

    async def prepare(self) -> None:
        # Asked here, awaited: the mixin's get_current_user would block the event loop on the hub.
        self._hub_auth_user_cache = await self.hub_auth.get_user(self, sync=False)

    @web.authenticated
    async def get(self) -> None:
        who = await self.service.who_for_model(self.current_user)
        await self.admit("page", who.name)
        user = self.get_query_argument("user", None)
        if user is not None and len(user) > MAX_NAME:
            raise web.HTTPError(400, "no such user")
        try:
            page = int(self.get_query_argument("page", "1"))
        except ValueError:
            raise web.HTTPError(400, "page must be a whole number") from None
        page = min(max(page, 1), 10**6)
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.finish(await self.service.page(who, user, page))
