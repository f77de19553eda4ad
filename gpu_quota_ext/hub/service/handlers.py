"""The service's HTTP API (contract.py), thin: authenticate with the hub, parse, ask the book (and the host's
broker, room.py, through the app), answer.

Every API call carries a hub token; the hub says whose it is (HubAuth, cached a short while) and what it may
do: without access to this service it is a 403 (app.py, who_for_model). The user is that token's owner,
never anything in the body. Bodies over 64 KiB: 413 (from Content-Length, or as a
chunked body grows past it); bodies that are not what the contract says: 400; another user's kernel: 403;
a kernel the service does not know: 404; a grant or cap change whose caller closed its connection before the
service acted (it gave up waiting): nothing done, 499. A lease with "wait" is a long poll (polls.py): answered
when the broker wants some of its server's kernels parked, or after the wait. Errors are JSON `{"message": ...}`.
Every call passes the service's per-user limits first (guard.py, in prepare(): calls a second per route, requests
open at once, long polls, failed authentications per address): over one, 429 with `Retry-After`, nothing done.
The admin's page is behind hub OAuth (HubOAuthenticated), and so is its login callback: both bound to the
service's own HubOAuth. Tokens are never logged: tornado's access log prints no headers.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import time
from html import escape
from typing import Any, Dict, Optional, Tuple

try:
    from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
except ImportError:  # only the service imports this module, in the hub's environment, which has JupyterHub
    raise SystemExit(
        "gpu-quota-ext: the host quota service needs JupyterHub in its environment: pip install 'gpu-quota-ext[hub]'"
    ) from None
from prometheus_client.exposition import generate_latest
from tornado import web
from tornado.httputil import responses

from ...ledger import AdmissionRefused, UnknownKernel
from ...shared.cap_request import read_cap_request
from ...shared.contract import PARK_STATES
from ...shared.request_body import BodyRefused, BoundedBody
from ...shared.service_contract import ADMIN_SCOPE, CONTEXT_ALLOWANCE, LEASE_RENEW
from ...shared.sizes import PolicyError, shown
from .book import Forbidden
from .guard import TooMany
from .room import ParkReport, RoomRefused

# ASCII letters, digits, - and _ only, matched whole: "$" alone lets a final newline through ("x\n" was granted and
# then answered 404), and \w lets every script's letters in; an id must be one its owner can fetch back.
KERNEL_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
MAX_NAME = 255
MAX_KERNELS = 4096
MAX_PIDS = 1024
MAX_DEVICES = 64  # devices one need names
MAX_BYTES = 1 << 60  # a need larger than any device
MAX_IDLE = 10 * 365 * 86400.0  # seconds: ten years idle is the most a report may say


class Who:
    def __init__(self, name: str, admin: bool, model: dict):
        self.name, self.admin, self.model = name, admin, model

    def require_user(self) -> None:
        """Grants and leases are users' (their servers'): a service may look (with the admin scope), not hold."""
        if self.model.get("kind", "user") != "user":
            raise web.HTTPError(403, "only a hub user's token can hold grants or renew a lease")


def _error_message(status_code: int, kwargs: Dict[str, Any]) -> str:
    """An HTTPError's own message (ours, or JupyterHub's in the OAuth callback), else the status's name."""
    error = (kwargs.get("exc_info") or (None, None, None))[1]
    message = None
    if isinstance(error, web.HTTPError) and error.log_message:
        try:
            message = error.log_message % error.args
        except (TypeError, ValueError):
            message = error.log_message
    return message or responses.get(status_code, "error")


def _write_json_error(handler: web.RequestHandler, status_code: int, kwargs: Dict[str, Any]) -> None:
    error = (kwargs.get("exc_info") or (None, None, None))[1]
    if isinstance(error, TooMany):
        handler.set_header("Retry-After", str(error.retry_after))
        if error.disconnect:
            handler.set_header("Connection", "close")
            handler._disconnect = True
    handler.set_header("Content-Type", "application/json")
    handler.finish(json.dumps({"message": _error_message(status_code, kwargs)}))


def _summary(handler: web.RequestHandler) -> str:
    # What tornado's warnings print of a request: without its query, where a "?token=" could be.
    return f"{handler.request.method} {handler.request.path} ({handler.request.remote_ip})"


@web.stream_request_body
class ApiHandler(web.RequestHandler):
    _request_summary = _summary
    route = "status"  # which of the per-user limits (guard.ROUTES) this handler's calls count against
    _admitted: Optional[str] = None  # whose open request this is, once the guard counted it

    @property
    def service(self):
        return self.settings["gpu_quota_service"]

    async def prepare(self):
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
                self._who = await self.service.identify(self)
                # The one place every call meets the per-user limits: a refusal costs no parse, no book, no hub.
                self.service.guard.admit(self.route, self._who.name)
                self._admitted = self._who.name
            except TooMany as refusal:
                await self.service.guard.hold(refusal)
                raise
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

    def _leave(self) -> None:
        if self._admitted is not None:
            self.service.guard.leave(self._admitted)
            self._admitted = None

    def on_finish(self) -> None:
        self._leave()
        if getattr(self, "_disconnect", False):
            self.request.connection.close()  # the answer is written: the caller must connect again

    def on_connection_close(self) -> None:
        self._leave()

    def body(self) -> Any:
        if self._refusal is not None:
            raise self._refusal
        try:
            return self._body.json()
        except BodyRefused as refused:
            raise web.HTTPError(refused.status, str(refused)) from None

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        _write_json_error(self, status_code, kwargs)

    def log_exception(self, typ, value, tb) -> None:
        if isinstance(value, TooMany):
            return  # not a line per refused call: the guard says once a minute who is refused
        super().log_exception(typ, value, tb)

    def check_xsrf_cookie(self):
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

    def answer(self, code: int, data: Optional[dict]) -> None:
        self.set_status(code)
        if data is None:
            self.finish()
        else:
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps(data))


def _string(body: dict, key: str, required: bool = True, pattern: Optional[re.Pattern] = None) -> Optional[str]:
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or len(value) > MAX_NAME or (pattern is not None and not pattern.fullmatch(value)):
        raise web.HTTPError(
            400, f'"{key}" must be a string{" of letters, digits, - and _" if pattern else ""}, not {shown(value)}'
        )
    return value


def parse_grant_request(body: Any) -> Tuple[str, str, str, Optional[list]]:
    if not isinstance(body, dict):
        raise web.HTTPError(400, 'the body must be a JSON object {"server", "kernel_id", "kernelspec", "allowed"}')
    unknown = sorted(set(body) - {"server", "kernel_id", "kernelspec", "allowed"})
    if unknown:
        raise web.HTTPError(400, f"unknown fields {shown(unknown)}")
    server = _string(body, "server")
    kernel_id = _string(body, "kernel_id", pattern=KERNEL_ID)
    kernelspec = _string(body, "kernelspec")
    allowed = body.get("allowed")
    if allowed is not None and (
        not isinstance(allowed, list)
        or len(allowed) > 64
        or not all(isinstance(u, str) and len(u) <= MAX_NAME for u in allowed)
    ):
        raise web.HTTPError(400, '"allowed" must be null or a list of device uuids')
    return server, kernel_id, kernelspec, allowed


def parse_change_request(body: Any):
    """ "reset" or (CapSpec, device uuid or None)."""
    try:
        return read_cap_request(body, lambda d: isinstance(d, str) and len(d) <= MAX_NAME, "a device uuid or null")
    except PolicyError as error:
        raise web.HTTPError(400, str(error)) from None


def parse_lease_request(
    body: Any,
) -> Tuple[str, Dict[str, Tuple[int, ...]], Optional[Dict[str, ParkReport]], Optional[float]]:
    """(server, kernel id -> PIDs, its kernels' park reports or None, seconds to wait or None)."""
    if not isinstance(body, dict) or set(body) - {"server", "kernels", "park", "wait"}:
        raise web.HTTPError(
            400,
            'the body must be a JSON object {"server": str, "kernels": [{"kernel_id": str, "pids": [int]}], '
            '"park": [KERNEL_PARK] (optional), "wait": seconds (optional)}',
        )
    server = _string(body, "server")
    entries = body.get("kernels")
    if not isinstance(entries, list) or len(entries) > MAX_KERNELS:
        raise web.HTTPError(400, '"kernels" must be a list of {"kernel_id": str, "pids": [int, ...]}')
    kernels: Dict[str, Tuple[int, ...]] = {}
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) - {"kernel_id", "pids"}:
            raise web.HTTPError(400, 'each kernel must be {"kernel_id": str, "pids": [int, ...]}')
        kernel_id = _string(entry, "kernel_id", pattern=KERNEL_ID)
        pids = entry.get("pids", [])
        if (
            not isinstance(pids, list)
            or len(pids) > MAX_PIDS
            or not all(isinstance(p, int) and not isinstance(p, bool) and 1 < p < 2**31 for p in pids)
        ):
            raise web.HTTPError(400, f'"pids" of kernel {kernel_id} must be a list of process ids')
        kernels[kernel_id] = tuple(pids)
    park = parse_park_reports(body["park"]) if "park" in body else None
    wait = None
    if "wait" in body:
        wait = body["wait"]
        if not _number(wait) or not 0 <= wait <= LEASE_RENEW:
            raise web.HTTPError(400, f'"wait" must be a number of seconds from 0 to {LEASE_RENEW}, not {shown(wait)}')
        wait = float(wait)
    return server, kernels, park, wait


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_park_reports(entries: Any) -> Dict[str, ParkReport]:
    """The "park" list of a lease or a room call: KERNEL_PARK entries, one per kernel."""
    if not isinstance(entries, list) or len(entries) > MAX_KERNELS:
        raise web.HTTPError(400, f'"park" must be a list of at most {MAX_KERNELS} KERNEL_PARK objects')
    reports: Dict[str, ParkReport] = {}
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) - {"kernel_id", "state", "idle_for", "parkable", "stays"}:
            raise web.HTTPError(
                400, 'each "park" entry must be {"kernel_id": str, "state": str, "idle_for": seconds | null, '
                '"parkable": bool, "stays": bytes (optional)}'
            )
        kernel_id = _string(entry, "kernel_id", pattern=KERNEL_ID)
        state, idle_for, parkable = entry.get("state"), entry.get("idle_for"), entry.get("parkable", False)
        if state not in PARK_STATES:
            raise web.HTTPError(400, f"the park state of kernel {kernel_id} must be one of {', '.join(PARK_STATES)}")
        if idle_for is not None and (not _number(idle_for) or not 0 <= idle_for <= MAX_IDLE):
            raise web.HTTPError(400, f'"idle_for" of kernel {kernel_id} must be null or seconds, not {shown(idle_for)}')
        if not isinstance(parkable, bool):
            raise web.HTTPError(400, f'"parkable" of kernel {kernel_id} must be true or false')
        stays = entry.get("stays", 0)
        if not isinstance(stays, int) or isinstance(stays, bool) or not 0 <= stays <= CONTEXT_ALLOWANCE:
            # A server's word: what a fast park leaves is a CUDA context, never more than the allowance for one.
            raise web.HTTPError(
                400, f'"stays" of kernel {kernel_id} must be bytes from 0 to {CONTEXT_ALLOWANCE}, not {shown(stays)}'
            )
        if kernel_id in reports:
            raise web.HTTPError(400, f"kernel {kernel_id} is reported twice")
        reports[kernel_id] = ParkReport(state, None if idle_for is None else float(idle_for), parkable, stays)
    return reports


def parse_room_request(
    body: Any,
) -> Tuple[str, Dict[str, ParkReport], Dict[str, Dict[str, int]], Optional[Tuple[str, int]]]:
    """(server, its kernels' park reports, kernel id -> uuid -> bytes needed, the park asking for host memory)."""
    if not isinstance(body, dict) or set(body) - {"server", "park", "demands", "host_park"}:
        raise web.HTTPError(
            400,
            'the body must be a JSON object {"server": str, "park": [KERNEL_PARK], '
            '"demands": [{"kernel_id": str, "need": {uuid: bytes}}], "host_park": {"kernel_id": str, "bytes": int}}',
        )
    host_park = None
    if body.get("host_park") is not None:
        entry = body["host_park"]
        if not isinstance(entry, dict) or set(entry) != {"kernel_id", "bytes"}:
            raise web.HTTPError(400, '"host_park" must be {"kernel_id": str, "bytes": int}')
        nbytes = entry["bytes"]
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes < MAX_BYTES:
            raise web.HTTPError(400, f'"bytes" of "host_park" must be a whole number of bytes, not {shown(nbytes)}')
        host_park = (_string(entry, "kernel_id", pattern=KERNEL_ID), nbytes)
    server = _string(body, "server")
    reports = parse_park_reports(body.get("park", []))
    entries = body.get("demands", [])
    if not isinstance(entries, list) or len(entries) > MAX_KERNELS:
        raise web.HTTPError(400, f'"demands" must be a list of at most {MAX_KERNELS} {{"kernel_id", "need"}} objects')
    demands: Dict[str, Dict[str, int]] = {}
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"kernel_id", "need"}:
            raise web.HTTPError(400, 'each demand must be {"kernel_id": str, "need": {uuid: bytes}}')
        kernel_id = _string(entry, "kernel_id", pattern=KERNEL_ID)
        need = entry["need"]
        if (
            not isinstance(need, dict)
            or len(need) > MAX_DEVICES
            or not all(isinstance(u, str) and len(u) <= MAX_NAME for u in need)
            or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < MAX_BYTES for n in need.values())
        ):
            raise web.HTTPError(400, f'"need" of kernel {kernel_id} must map device uuids to bytes')
        if kernel_id in demands:
            raise web.HTTPError(400, f"kernel {kernel_id} demands twice")
        demands[kernel_id] = dict(need)
    return server, reports, demands, host_park


class GrantsHandler(ApiHandler):
    route = "grants"

    async def post(self):
        self.who.require_user()
        server, kernel_id, kernelspec, allowed = parse_grant_request(self.body())
        service = self.service
        policy = await service.policy_for(self.who.name)
        indexes = None if allowed is None else [d.index for d in service.book.ledger.devices if d.uuid in allowed]
        self.give_up_if_caller_gone(f"kernel {kernel_id} was granted")
        try:
            grant, created = service.book.grant(
                self.who.name, server, kernel_id, kernelspec, policy, indexes, time.time()
            )
        except Forbidden:
            raise web.HTTPError(403, f"kernel {kernel_id} is another user's") from None
        except AdmissionRefused as refusal:
            raise web.HTTPError(409, str(refusal)) from None
        self.answer(201 if created else 200, {"grant": service.book.record(grant)})

    async def get(self):
        book = self.service.book
        self.answer(200, {"grants": [book.record(o.grant) for o in book.visible(self.who.name, self.who.admin)]})


class GrantHandler(ApiHandler):
    route = "grants"

    def _call(self, method, kernel_id: str, *args):
        try:
            return method(self.who.name, kernel_id, self.who.admin, *args)
        except Forbidden:
            raise web.HTTPError(403, f"kernel {kernel_id} is another user's") from None
        except UnknownKernel:
            raise web.HTTPError(404, f"no grant for kernel {kernel_id}") from None
        except PolicyError as error:
            raise web.HTTPError(400, str(error)) from None

    async def get(self, kernel_id: str):
        grant = self._call(self.service.book.get, kernel_id)
        self.answer(200, {"grant": self.service.book.record(grant)})

    async def put(self, kernel_id: str):
        request = parse_change_request(self.body())
        book = self.service.book
        self.give_up_if_caller_gone(f"kernel {kernel_id}'s cap was changed")
        if request == "reset":
            outcome = self._call(book.reset, kernel_id)
        else:
            cap, uuid = request
            device = None
            if uuid is not None:
                device = next((d.index for d in book.ledger.devices if d.uuid == uuid), None)
                if device is None:
                    raise web.HTTPError(400, f"device {shown(uuid)} is not one of this host's")
            outcome = self._call(book.change, kernel_id, cap, device)
        self.answer(200, {"status": outcome.status, "message": outcome.message, "grant": book.record(outcome.grant)})

    async def delete(self, kernel_id: str):
        self._call(self.service.book.release, kernel_id)
        self.answer(204, None)


class LeaseHandler(ApiHandler):
    route = "lease"
    _woken: Optional[asyncio.Event] = None
    _gone = False

    async def post(self):
        self.who.require_user()
        server, kernels, reports, wait = parse_lease_request(self.body())
        service, user = self.service, self.who.name
        if wait:
            try:
                service.guard.enter_long_poll(user)  # before anything is done: over the limit, nothing is renewed
            except TooMany as refusal:
                await service.guard.hold(refusal)
                raise
            try:
                return await self._renew(service, user, server, kernels, reports, wait)
            finally:
                service.guard.leave_long_poll(user)
        await self._renew(service, user, server, kernels, reports, wait)

    async def _renew(self, service, user: str, server: str, kernels, reports, wait: Optional[float]) -> None:
        now = time.time()
        released = service.book.lease(user, server, kernels, now)
        data: Dict[str, Any] = {"lease_seconds": int(service.book.lease_seconds), "released": released}
        if reports is None and wait is None:
            return self.answer(200, data)
        service.hear_lease(user, server, reports or {}, now)
        if wait and not service.room.pending(user, server):
            # The long poll: recorded at once, answered when the broker wants some of this server's kernels parked.
            self._woken = asyncio.Event()
            await service.polls.wait((user, server), min(wait, service.longest_wait()), self._woken)
            if self._gone:
                return  # nobody to answer: what is asked of this server stays for its next renewal
        data["park"] = service.room.take(user, server, service.book.owned(), time.time())
        self.answer(200, data)

    def on_connection_close(self):
        self._gone = True
        if self._woken is not None:
            self._woken.set()
        super().on_connection_close()


class RoomHandler(ApiHandler):
    route = "room"

    async def post(self):
        self.who.require_user()
        server, reports, demands, host_park = parse_room_request(self.body())
        self.give_up_if_caller_gone("the host's broker decided")
        try:
            answer = self.service.room_call(self.who.name, server, reports, demands, host_park)
        except RoomRefused as refusal:
            raise web.HTTPError(refusal.code, refusal.message) from None
        self.answer(200, answer)


class StatusHandler(ApiHandler):
    async def get(self):
        self.answer(200, await self.service.status(self.who.name, self.who.admin))


class MetricsHandler(ApiHandler):
    async def get(self):
        if not self.who.admin:
            raise web.HTTPError(403, f"the metrics need the hub's admin or {ADMIN_SCOPE}")
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.finish(generate_latest(self.service.registry))


class ServiceOAuth(HubOAuthenticated):
    """The OAuth side of the service's handlers, bound to the app's own HubOAuth (settings["hub_oauth"]), as
    JupyterHub's single-user server binds its own. The mixin's default, HubOAuth.instance(), is another
    object: JupyterHub 6 keeps each login's PKCE code verifier in the HubOAuth that began the login, and a
    callback asking another one has none to send ("Code verifier required.")."""

    _request_summary = _summary

    @property
    def hub_auth(self):
        return self.settings["hub_oauth"]

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        error = (kwargs.get("exc_info") or (None, None, None))[1]
        if isinstance(error, TooMany):
            self.set_header("Retry-After", str(error.retry_after))
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(f"<!doctype html><p>{status_code}: {escape(_error_message(status_code, kwargs))}</p>")


class OAuthCallbackHandler(ServiceOAuth, HubOAuthCallbackHandler):
    """JupyterHub's own end of the login (state check, code for token, the login cookie), at oauth_callback."""


class PageHandler(ServiceOAuth, web.RequestHandler):
    """The admin's page. A signed-in user who is no admin sees their own kernels only. Loads count against the
    viewer's "page" limit (guard.py), as API calls count against theirs."""

    _admitted: Optional[str] = None

    def log_exception(self, typ, value, tb) -> None:
        if isinstance(value, TooMany):
            return
        super().log_exception(typ, value, tb)

    def on_finish(self) -> None:
        if self._admitted is not None:
            self.settings["gpu_quota_service"].guard.leave(self._admitted)
            self._admitted = None

    on_connection_close = on_finish

    @property
    def hub_scopes(self):
        return None  # any hub user may look: what they see depends on who they are

    async def prepare(self):
        # Asked here, awaited: the mixin's get_current_user would block the event loop on the hub.
        self._hub_auth_user_cache = await self.hub_auth.get_user(self, sync=False)

    @web.authenticated
    async def get(self):
        service = self.settings["gpu_quota_service"]
        who = await service.who_for_model(self.current_user)
        try:
            service.guard.admit("page", who.name)
        except TooMany as refusal:
            await service.guard.hold(refusal)
            raise
        self._admitted = who.name
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
        self.finish(await service.page(who, user, page))
