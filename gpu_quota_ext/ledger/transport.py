"""The HTTP transport to the host's quota service: one request and its answer, for the remote ledger and its lease.

- It authenticates with this server's own hub token (the service asks the hub whose token it is) and uses no
  proxy from the environment: the service is the hub's, reached on the hub's own network (with the hub's internal
  TLS where the hub turns it on).
- Every failure to get a usable answer (connection refused or reset, a timeout, a proxy's 502/503/504, an answer
  that is not JSON or too large) is `Unreachable`; any other answer, error codes included, is an `Answer`. A
  kernel start's call retries while the service is unreachable, then is refused (AdmissionRefused).
- `close()` ends the calls of long polls under way at once (their sockets shut down) and the waits between
  retries: the lease's renewal and a start's retries do not outlive the server.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

from .interface import AdmissionRefused

RETRY_DELAY = 1.0  # seconds between two tries of a kernel start, and between lease tries while unreachable
MAX_ANSWER = 1024 * 1024  # bytes of one answer this server reads

UNREACHABLE = "GPU quota service unreachable"  # AdmissionRefused's reason


class Unreachable(Exception):
    """No usable answer: connection refused or reset, timeout, a proxy's 502/503/504, not JSON."""


@dataclass(frozen=True)
class Answer:
    code: int
    data: dict

    @property
    def message(self) -> str:
        text = self.data.get("message") if isinstance(self.data, dict) else None
        return str(text) if text else f"HTTP {self.code}"


class ServiceTransport:
    """Calls to the host service at `url` (its prefix), as this server (`token`)."""

    def __init__(
        self,
        url: str,
        token: str,
        call_timeout: float,
        ssl_context: Optional[ssl.SSLContext] = None,
    ):
        self.url = url if url.endswith("/") else url + "/"
        self._token = token
        self.call_timeout = call_timeout
        self.closed = threading.Event()  # set by close(): retries and the lease's waits end
        self._connections = _Connections()
        handlers: list = [urllib.request.ProxyHandler({}), *_tracked_handlers(self._connections, ssl_context)]
        self._opener = urllib.request.build_opener(*handlers)

    def call(self, method: str, path: str, body: Optional[dict] = None, timeout: Optional[float] = None) -> Answer:
        """One request; Unreachable when no usable answer came within `timeout` (call_timeout when not given)."""
        request = urllib.request.Request(
            self.url + path,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={
                "Authorization": f"token {self._token}",
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
        )
        try:
            with self._opener.open(request, timeout=self.call_timeout if timeout is None else timeout) as response:
                return _answer(response.status, response.read(MAX_ANSWER + 1))
        except urllib.error.HTTPError as error:
            with error:
                raw = error.read(MAX_ANSWER + 1)
            if error.code in (502, 503, 504):  # the proxy's answer: the service is not there
                raise Unreachable(f"HTTP {error.code}") from None
            return _answer(error.code, raw, allow_text=True)
        except (urllib.error.URLError, OSError, socket.timeout) as error:
            reason = getattr(error, "reason", error)
            raise Unreachable(str(reason) or error.__class__.__name__) from None

    def call_retrying(self, method: str, path: str, body: dict, retries: int, delay: float) -> Answer:
        """A kernel start's call: `retries` more tries, `delay` apart, while the service cannot be reached; then
        AdmissionRefused. A repeated grant request is harmless (the service answers 200)."""
        error: Optional[Unreachable] = None
        for attempt in range(retries + 1):
            if attempt:
                self.closed.wait(delay)
            try:
                return self.call(method, path, body)
            except Unreachable as failure:
                error = failure
        raise AdmissionRefused(f"the GPU quota service at {self.url} is unreachable: {error}", UNREACHABLE)

    def long_poll(self) -> contextlib.AbstractContextManager:
        """The calls of this thread inside the block are long polls: close() ends them at once."""
        return self._connections.long_poll()

    def close(self) -> None:
        """No more waiting on the service: long polls under way end (unreachable), retries stop waiting."""
        self.closed.set()
        self._connections.end_all()


class _Connections:
    """The HTTP connections of long polls under way, so that close() can end them at once (their sockets shut
    down: the call returns unreachable) instead of waiting out the service's answer. A long poll asked after
    close() began ends as soon as it connects. Other calls are not tracked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: "weakref.WeakSet[http.client.HTTPConnection]" = weakref.WeakSet()
        self._ending = False
        self._local = threading.local()

    @contextlib.contextmanager
    def long_poll(self) -> Iterator[None]:
        self._local.long_poll = True
        try:
            yield
        finally:
            self._local.long_poll = False

    def factory(self, http_class: Any) -> Callable[..., http.client.HTTPConnection]:
        tracker = self

        class Tracked(http_class):
            def connect(self) -> None:
                super().connect()
                with tracker._lock:
                    ending = tracker._ending
                if ending:
                    self.sock.shutdown(socket.SHUT_RDWR)

        def connection(*args: Any, **kwargs: Any) -> http.client.HTTPConnection:
            if not getattr(self._local, "long_poll", False):
                return http_class(*args, **kwargs)
            made = Tracked(*args, **kwargs)
            with self._lock:
                self._open.add(made)
            return made

        return connection

    def end_all(self) -> None:
        with self._lock:
            self._ending = True
            connections = list(self._open)
        for connection in connections:
            sock = connection.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # closed meanwhile


def _tracked_handlers(connections: _Connections, ssl_context: Optional[ssl.SSLContext]) -> list:
    """urllib's HTTP and HTTPS handlers, their connections known to `connections`."""

    class Http(urllib.request.HTTPHandler):
        def do_open(
            self, http_class: Callable[..., http.client.HTTPConnection], req: urllib.request.Request, **kwargs: Any
        ) -> http.client.HTTPResponse:
            return super().do_open(connections.factory(http_class), req, **kwargs)

    class Https(urllib.request.HTTPSHandler):
        def do_open(
            self, http_class: Callable[..., http.client.HTTPConnection], req: urllib.request.Request, **kwargs: Any
        ) -> http.client.HTTPResponse:
            return super().do_open(connections.factory(http_class), req, **kwargs)

    return [Http(), Https(context=ssl_context)]


def ssl_context(environ: Mapping[str, str]) -> Optional[ssl.SSLContext]:
    """The hub's internal TLS (c.JupyterHub.internal_ssl): its CA and this server's client certificate."""
    ca = environ.get("JUPYTERHUB_SSL_CLIENT_CA")
    if not ca:
        return None
    context = ssl.create_default_context(cafile=ca)
    if environ.get("JUPYTERHUB_SSL_CERTFILE"):
        context.load_cert_chain(environ["JUPYTERHUB_SSL_CERTFILE"], environ.get("JUPYTERHUB_SSL_KEYFILE") or None)
    return context


def url_problem(url: str) -> Optional[str]:
    """Why urllib could never call `url` (+ a path), or None: an http(s) URL with a host and a valid port."""
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        return "it holds spaces or control characters"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is no number, or out of range)
    except ValueError as error:
        return str(error)
    if parts.scheme not in ("http", "https"):
        return "it must start with http:// or https://"
    if not parts.hostname:
        return "it names no host"
    if parts.query or parts.fragment:
        return "it must end with the service's prefix, without ? or #"
    return None


def _answer(code: int, raw: bytes, allow_text: bool = False) -> Answer:
    if len(raw) > MAX_ANSWER:
        raise Unreachable(f"an answer over {MAX_ANSWER} bytes")
    if not raw:
        return Answer(code, {})
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        if allow_text:  # an error page: its first line is the message
            return Answer(code, {"message": raw[:200].decode(errors="replace").strip()})
        raise Unreachable(f"HTTP {code} with an answer that is not JSON") from None
    return Answer(code, data if isinstance(data, dict) else {})
