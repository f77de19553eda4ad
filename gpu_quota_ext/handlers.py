"""REST API under /api/gpu-quota (the routes of shared.contract, parking's included). Every route needs
jupyter_server's authentication and authorization, except that a kernel may change (and report on) itself with
its own secret, sent in a header.

Bodies are small JSON objects: one over MAX_BODY is refused (413), from its Content-Length or as soon as it
grows past the limit when it comes chunked, and never kept. A refusal decided before the body is read (413,
403) is answered once the body has arrived and been dropped (shared/request_body.py says why); a malformed
Content-Length is tornado's 400, as on jupyter_server's own routes. A body that does not parse, however
(deep nesting included), is a 400. Error answers are JSON, `{"message": ..., "reason": ...}`, with the
message as written (tornado keeps an HTTPError's text as a %-format; it is formatted here, once) and
any value echoed from the request cut to a few dozen characters.
"""

from __future__ import annotations

import json
import math
from types import TracebackType
from typing import Any, Callable, Collection, Dict, Optional, Tuple, Type, TypeVar, Union

from jupyter_server.base.handlers import APIHandler
from jupyter_server.services.sessions.handlers import SessionRootHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.httputil import responses

from .ledger import UnknownKernel
from .manager import SETTINGS_KEY, GpuQuotaManager
from .shared.cap_request import read_cap_request
from .shared.contract import (
    HISTORY_PATH,
    HISTORY_SINCE,
    HISTORY_SUFFIX,
    KERNEL_TOKEN_HEADER,
    KERNELS_PATH,
    MAX_BODY_TEXT,
    PARK_SUFFIX,
    RESUME_SUFFIX,
    ROOM_SUFFIX,
    STATUS_PATH,
    USAGE_FIELDS,
    USAGE_SUFFIX,
)
from .shared.request_body import BodyRefused, BoundedBody
from .shared.sizes import CapSpec, PolicyError, shown

FuncT = TypeVar("FuncT", bound=Callable[..., Any])  # a handler's method, as jupyter_server's decorators take it

try:  # jupyter_server >= 2.13: keep the kernel-secret route usable when unauthenticated access is off
    from jupyter_server.auth.decorator import allow_unauthenticated
except ImportError:  # pragma: no cover

    def allow_unauthenticated(method: FuncT) -> FuncT:
        return method


AUTH_RESOURCE = "gpu_quota"
KERNEL_ID_PATTERN = r"(?P<kernel_id>[\w-]+)"


@web.stream_request_body  # so that a body over the limit is dropped as it arrives, never kept
class GpuQuotaHandler(APIHandler):
    auth_resource = AUTH_RESOURCE

    @property
    def manager(self) -> GpuQuotaManager:
        """The extension's GpuQuotaManager (never reached by a request refused before its body)."""
        self.answer_refusal()
        return self.settings[SETTINGS_KEY]

    # No keyword: as jupyter_server's own APIHandler.prepare, which drops JupyterHandler's _redirect_to_login.
    async def prepare(self) -> None:  # type: ignore[override]
        self._body = BoundedBody(self.request.headers)
        self._refusal: Optional[web.HTTPError] = None
        if self._body.malformed is not None:
            # tornado answers 400 and closes when it reads such a body, before any method runs; were it to
            # read it after all, the method would answer the same, knowing no user.
            self._refusal, self.current_user = web.HTTPError(400, self._body.malformed), None
            return
        try:
            await super().prepare()
            if self._body.over:
                raise web.HTTPError(
                    413, f"the request body is {self._body.declared} bytes; the most this API reads is {MAX_BODY_TEXT}"
                )
        except web.HTTPError as refusal:
            if not self._body.follows:
                raise
            self._refusal = refusal  # answered by the method, once the body is in
            self._body.drop()

    def answer_refusal(self) -> None:
        """Raise the refusal prepare() decided before the body arrived. Every route reaches it first: through
        require_user, require_user_or_kernel or the manager."""
        if self._refusal is not None:
            raise self._refusal

    def data_received(self, chunk: bytes) -> None:
        self._body.add(chunk)  # past the limit (or refused already), what arrives is dropped

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """jupyter_server's JSON error answer, with the message formatted: tornado stores a message given
        without arguments %-escaped ("25%" as "25%%") and jupyter_server sends that stored text as is."""
        error = (kwargs.get("exc_info") or (None, None, None))[1]
        if not isinstance(error, web.HTTPError):
            return super().write_error(status_code, **kwargs)
        try:
            message = error.log_message % error.args if error.log_message else None
        except (TypeError, ValueError):
            message = error.log_message
        self.set_header("Content-Type", "application/json")
        self.finish(
            json.dumps({"message": message or responses.get(status_code, "Unknown HTTP Error"), "reason": error.reason})
        )

    def kernel_token(self) -> Optional[str]:
        return self.request.headers.get(KERNEL_TOKEN_HEADER)

    def check_xsrf_cookie(self) -> None:
        # A kernel's secret travels in a header, never in a cookie: a browser cannot forge it cross-site.
        if self.kernel_token() is not None:
            return None
        return super().check_xsrf_cookie()

    def require_user(self, action: str) -> None:
        """What @web.authenticated and @authorized do, for routes that also accept a kernel's secret."""
        self.answer_refusal()
        if not self.current_user:
            raise web.HTTPError(403)
        if not self.authorizer.is_authorized(self, self.current_user, action, self.auth_resource):
            raise web.HTTPError(403, f"not authorized to {action} GPU quotas")

    def require_user_or_kernel(self, kernel_id: str, action: str) -> str:
        """The server's user, or kernel `kernel_id` itself with its own secret. Returns who asked."""
        self.answer_refusal()
        token = self.kernel_token()
        if token is None:
            self.require_user(action)
            return "user"
        if not self.manager.token_matches(kernel_id, token):
            raise web.HTTPError(403, f"this secret does not belong to kernel {shown(kernel_id)}")
        return "kernel"

    async def session_paths(self) -> dict:
        """kernel id -> notebook path, through jupyter_server's session manager (its public list_sessions)."""
        sessions = self.settings.get("session_manager")
        if sessions is None:
            return {}
        try:
            listed = await sessions.list_sessions()
            return {s["kernel"]["id"]: s.get("path") for s in listed if s.get("kernel")}
        except Exception as error:
            # Another implementation of the session manager may raise anything, or list other shapes: the paths are
            # optional (kernels are shown without them), and the sidebar asks every few seconds: debug, not warning.
            self.log.debug("gpu-quota-ext: kernels shown without notebook paths: listing sessions failed: %r", error)
            return {}

    def read_json_body(self) -> Any:
        try:
            return self._body.json()
        except BodyRefused as refused:
            raise web.HTTPError(refused.status, str(refused)) from None


class StatusHandler(GpuQuotaHandler):
    @web.authenticated
    async def get(self) -> None:
        self.require_user("read")
        self.finish(json.dumps(self.manager.status_answer(await self.session_paths())))


class KernelHandler(GpuQuotaHandler):
    @allow_unauthenticated
    async def get(self, kernel_id: str) -> None:
        """The server's user, or the kernel itself with its secret (it checks for caps changed elsewhere)."""
        self.require_user_or_kernel(kernel_id, "read")
        grant = self.manager.grant_of(kernel_id)
        if grant is None:
            raise web.HTTPError(404, f"no GPU grant for kernel {shown(kernel_id)}")
        self.finish(json.dumps(self.manager.kernel_status(grant, await self.session_paths())))

    @allow_unauthenticated
    async def put(self, kernel_id: str) -> None:
        """Body: {"cap": "0.3" | "30%" | "12GiB" | bytes, "device": optional server device index}
        or {"reset": true}. Answers 200 with the outcome ("granted" / "clamped"), 409 when refused."""
        who = self.require_user_or_kernel(kernel_id, "write")
        body = self.read_json_body()
        request = parse_cap_request(body)
        manager = self.manager
        try:
            if isinstance(request, str):  # RESET, the one text read_cap_request answers
                result = await manager.reset(kernel_id, source=f"{who} request")
            else:
                cap, device = request
                result = await manager.change(kernel_id, cap, device, source=f"{who} request")
            if result.status == "refused":
                self.set_status(409)
            grant, outcome, message = result.grant, result.status, result.message
        except UnknownKernel:
            raise web.HTTPError(404, f"no GPU grant for kernel {shown(kernel_id)}") from None
        except PolicyError as error:
            raise web.HTTPError(400, str(error)) from None
        self.log.info("gpu-quota-ext: kernel %s cap request: %s (%s)", kernel_id, outcome, message)
        kernel = manager.kernel_status(grant, await self.session_paths())
        self.finish(json.dumps({"outcome": outcome, "message": message, "kernel": kernel}))


class UsageHandler(GpuQuotaHandler):
    @allow_unauthenticated
    def post(self, kernel_id: str) -> None:
        """A kernel reports its own allocator after a cell: {"devices": [{"index": 0, "allocated": int,
        "reserved": int, "peak": int}]}. Stored with the usage (reports), never the ledger (caps).
        Answers with the kernel's last watchdog action, so the kernel can tell its user."""
        self.require_user_or_kernel(kernel_id, "write")
        manager = self.manager
        grant = manager.grant_of(kernel_id)
        if grant is None:
            raise web.HTTPError(404, f"no GPU grant for kernel {shown(kernel_id)}")
        entries = parse_usage_report(self.read_json_body(), grant.devices)
        manager.report_usage(kernel_id, entries)
        self.finish(json.dumps({"accepted": len(entries), "last_action": manager.last_action(kernel_id)}))


class HistoryHandler(GpuQuotaHandler):
    @web.authenticated
    def get(self) -> None:
        """Every kernel's usage history, the points newer than ?since= (all kept points without it)."""
        self.require_user("read")
        self.set_header("Content-Type", "application/json")
        self.finish(self.manager.usage_history(parse_since(self)))


class KernelHistoryHandler(GpuQuotaHandler):
    @allow_unauthenticated
    def get(self, kernel_id: str) -> None:
        """One kernel's usage history: the server's user, or the kernel itself with its secret (%gpucap panel)."""
        self.require_user_or_kernel(kernel_id, "read")
        answer = self.manager.kernel_usage_history(kernel_id, parse_since(self))
        if answer is None:
            raise web.HTTPError(404, f"no GPU grant for kernel {shown(kernel_id)}")
        self.set_header("Content-Type", "application/json")
        self.finish(answer)


def parse_since(handler: GpuQuotaHandler) -> Optional[float]:
    """The ?since= argument as wall-clock seconds, None when absent; HTTP 400 for anything but a number."""
    raw = handler.get_query_argument(HISTORY_SINCE, None)
    if raw is None:
        return None
    try:
        since = float(raw)
    except ValueError:
        since = math.nan
    if not math.isfinite(since):
        raise web.HTTPError(
            400,
            f"{HISTORY_SINCE}={shown(raw)} is not a time: give wall-clock seconds, e.g. {HISTORY_SINCE}=1700000000.5",
        )
    return since


MAX_BYTES = 1 << 50  # no GPU holds a petabyte: larger numbers are garbage


def parse_usage_report(body: object, granted: Collection[int]) -> list:
    """The validated entries of a usage report, or HTTP 400 saying what is wrong."""
    if not isinstance(body, dict) or set(body) != {"devices"}:
        raise web.HTTPError(
            400,
            'the body must be a JSON object {"devices": [{"index": 0, "allocated": ..., "reserved": ..., "peak": '
            '...}]}',
        )
    devices = body["devices"]
    if not isinstance(devices, list) or len(devices) > 64:
        raise web.HTTPError(400, '"devices" must be a list (at most 64 entries)')
    entries, seen = [], set()
    for position, entry in enumerate(devices):
        where = f"devices[{position}]"
        if not isinstance(entry, dict):
            raise web.HTTPError(400, f"{where} must be an object")
        unknown = sorted(set(entry) - {"index", *USAGE_FIELDS})
        if unknown:
            raise web.HTTPError(
                400, f"{where}: unknown fields {shown(unknown)}; known: index, {', '.join(USAGE_FIELDS)}"
            )
        index = entry.get("index")
        if isinstance(index, bool) or not isinstance(index, int):
            raise web.HTTPError(400, f'{where}: "index" must be the server\'s device index (a whole number)')
        if index not in granted:
            raise web.HTTPError(400, f"{where}: device {index} is not one of this kernel's devices {list(granted)}")
        if index in seen:
            raise web.HTTPError(400, f"{where}: device {index} is listed twice")
        seen.add(index)
        clean: Dict[str, Optional[int]] = {"index": index}
        for name in USAGE_FIELDS:
            value = entry.get(name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BYTES
            ):
                raise web.HTTPError(400, f'{where}: "{name}" must be a number of bytes (a whole number from 0) or null')
            clean[name] = value
        entries.append(clean)
    return entries


def parse_cap_request(body: object) -> Union[str, Tuple[CapSpec, Optional[int]]]:
    """'reset', or (CapSpec, device index or None). Anything else: HTTP 400 with the reason."""
    try:
        return read_cap_request(
            body,
            lambda d: not isinstance(d, bool) and isinstance(d, int) and d >= 0,
            "a device index (a whole number from 0)",
        )
    except PolicyError as error:
        raise web.HTTPError(400, str(error)) from None


class _ParkRoute(GpuQuotaHandler):
    action = "park"

    async def _request(self, kernel_id: str, who: str) -> Tuple[bool, dict]:
        raise NotImplementedError

    @allow_unauthenticated
    async def post(self, kernel_id: str) -> None:
        who = self.require_user_or_kernel(kernel_id, "write")
        body = self.read_json_body()
        if body not in (None, {}):
            raise web.HTTPError(400, f"POST {self.action} takes no fields: send no body or {{}}")
        try:
            accepted, park = await self._request(kernel_id, who)
        except UnknownKernel:
            raise web.HTTPError(404, f"no kernel {shown(kernel_id)} on this server") from None
        answer = {"park": park}
        if not accepted:
            self.set_status(409)
            answer["message"] = park["reason"]
        else:
            self.set_status(202)
        self.log.info("gpu-quota-ext: kernel %s %s request (%s): %s", kernel_id, self.action, who, park["state"])
        self.finish(json.dumps(answer))


class ParkHandler(_ParkRoute):
    action = "park"

    async def _request(self, kernel_id: str, who: str) -> Tuple[bool, dict]:
        return await self.manager.request_park(kernel_id, who)


class ResumeHandler(_ParkRoute):
    action = "resume"

    async def _request(self, kernel_id: str, who: str) -> Tuple[bool, dict]:
        return await self.manager.request_resume(kernel_id, who)


class RoomHandler(GpuQuotaHandler):
    """POST kernels/<id>/room {"device": index | null}: the kernel found the GPU full (shared.contract ROOM_SUFFIX)."""

    @allow_unauthenticated
    async def post(self, kernel_id: str) -> None:
        who = self.require_user_or_kernel(kernel_id, "write")
        body = self.read_json_body()
        if body is None:
            body = {}
        if not isinstance(body, dict) or set(body) - {"device"}:
            raise web.HTTPError(400, 'POST room takes {"device": a device index or null}, or no body')
        device = body.get("device")
        if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
            raise web.HTTPError(400, '"device" must be a device index (a whole number from 0) or null')
        try:
            accepted, park, why_not = await self.manager.request_room(kernel_id, device)
        except UnknownKernel:
            raise web.HTTPError(404, f"no kernel {shown(kernel_id)} on this server") from None
        answer: Dict[str, Any] = {"park": park}
        if accepted:
            self.set_status(202)
        else:
            self.set_status(409)
            answer["message"] = why_not
        self.log.info("gpu-quota-ext: kernel %s room request (%s): %s", kernel_id, who, park.get("room") or why_not)
        self.finish(json.dumps(answer))


class SessionsHandler(SessionRootHandler):
    """jupyter_server's own POST /api/sessions (what JupyterLab opens a notebook with), in every respect but
    one: a kernel start that failed with an HTTP status of its own (the quota's 503 "GPU budget full", 400,
    409) is answered with that status and message, as POST /api/kernels answers it. jupyter_server turns any
    exception of a session's kernel start into a 500 (keeping the exception as its cause); a full GPU is no
    server error, and a client that retries on 503 should see one."""

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        refusal = _start_refusal((kwargs.get("exc_info") or (None, None, None))[1])
        if refusal is not None:
            kwargs["exc_info"] = (type(refusal), refusal, refusal.__traceback__)
            status_code = refusal.status_code
        super().send_error(status_code, **kwargs)

    def log_exception(
        self, typ: Optional[Type[BaseException]], value: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        refusal = _start_refusal(value)
        if refusal is not None:
            typ, value, tb = type(refusal), refusal, refusal.__traceback__
        super().log_exception(typ, value, tb)


def _start_refusal(error: Optional[BaseException]) -> Optional[web.HTTPError]:
    """The HTTP error a session's kernel start failed with, when jupyter_server wrapped it in its 500."""
    cause = getattr(error, "__cause__", None)
    if isinstance(error, web.HTTPError) and error.status_code == 500 and isinstance(cause, web.HTTPError):
        return cause
    return None


# Relative to the server's base_url (ExtensionApp prepends it); the paths are shared.contract's, but for
# jupyter_server's own sessions route: an extension's handlers are matched before the server's.
HANDLERS = [
    ("/api/sessions", SessionsHandler),
    (STATUS_PATH, StatusHandler),
    (url_path_join(KERNELS_PATH, KERNEL_ID_PATTERN), KernelHandler),
    (url_path_join(KERNELS_PATH, KERNEL_ID_PATTERN, USAGE_SUFFIX), UsageHandler),
    (url_path_join(KERNELS_PATH, KERNEL_ID_PATTERN, PARK_SUFFIX), ParkHandler),
    (url_path_join(KERNELS_PATH, KERNEL_ID_PATTERN, RESUME_SUFFIX), ResumeHandler),
    (url_path_join(KERNELS_PATH, KERNEL_ID_PATTERN, ROOM_SUFFIX), RoomHandler),
    (HISTORY_PATH, HistoryHandler),
    (url_path_join(KERNELS_PATH, KERNEL_ID_PATTERN, HISTORY_SUFFIX), KernelHistoryHandler),
]
