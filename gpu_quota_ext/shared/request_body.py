"""What the two HTTP APIs (the server's routes, the host service's) read of a request: its headers before its
body, then the body as it streams in, kept only up to the limit.

Both stream their bodies (tornado's stream_request_body) so that one over the limit is never kept; so both
see a request's headers before tornado has checked them. A malformed Content-Length is tornado's to refuse
(400, as on jupyter_server's own routes) when it reads the body; it must not reach `int()` first. And a
refusal decided before the body is read (no credentials, over the limit) is answered only once the body has
arrived, dropped: a server that answers and closes while the client, or the hub's proxy, is still sending
makes the kernel reset the connection, and the proxy then reports a 503 of its own, not the answer.

Standard library only: pure reading of header values and bytes; each API turns what it finds into its answers.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Optional

from .contract import MAX_BODY, MAX_BODY_TEXT

_DIGITS = re.compile(r"[0-9]+")  # ASCII only: int() takes "٣" and "³" would fail; neither is HTTP
_SAME_VALUES = re.compile(r",[ \t]*")


class BodyRefused(Exception):
    """Why a request's body cannot be read: the HTTP status to answer (413 over the limit, 400 not JSON) and
    the message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def declared_length(headers: Mapping[str, str]) -> Optional[int]:
    """The body's length as the Content-Length header declares it, read as tornado reads it (a list of equal
    values, as proxies sometimes repeat it, is that value); None without the header. ValueError when it is
    not a number of bytes ("abc", "-5", "1, 2"): tornado refuses such a request when it reads its body."""
    value = headers.get("Content-Length")
    if value is None:
        return None
    pieces = _SAME_VALUES.split(value.strip())
    if any(piece != pieces[0] for piece in pieces) or not _DIGITS.fullmatch(pieces[0]):
        raise ValueError(f"Content-Length {value[:40]!r} is not a number of bytes")
    return int(pieces[0])


def body_follows(headers: Mapping[str, str]) -> bool:
    """Whether the client is sending (or may still send) a body after these headers."""
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        return True
    try:
        return bool(declared_length(headers))
    except ValueError:
        return True  # unknown: as if it did


class BoundedBody:
    """A request body as its headers declare it and as it streams in (tornado's data_received), kept while
    within `limit` bytes: one declared or grown past it is dropped at once and marked `over`, so no more than
    the limit is ever held. `malformed`: why the Content-Length is not a number of bytes (tornado's 400), or
    None; `follows`: whether a body comes after the headers (a refusal must wait for it: see above)."""

    def __init__(self, headers: Optional[Mapping[str, str]] = None, limit: int = MAX_BODY) -> None:
        headers = headers or {}
        self.limit = limit
        self.malformed: Optional[str] = None
        try:
            self.declared = declared_length(headers)
        except ValueError as error:
            self.declared, self.malformed = None, str(error)
        self.follows = body_follows(headers)
        self.over = False
        self._data = bytearray()
        if self.malformed is not None or (self.declared is not None and self.declared > limit):
            self.drop()

    def add(self, chunk: bytes) -> None:
        if self.over:
            return
        if len(self._data) + len(chunk) > self.limit:
            self.drop()
        else:
            self._data += chunk

    def drop(self) -> None:
        """Keep nothing of it (over the limit, or refused before it arrived): what still arrives is dropped."""
        self.over, self._data = True, bytearray()

    def json(self) -> Any:
        """The body as JSON, None when empty. BodyRefused when it was over the limit (413), or is not JSON,
        however deep its nesting (400)."""
        if self.over:
            raise BodyRefused(413, f"the request body is over {MAX_BODY_TEXT}, the most this API reads")
        try:
            return json.loads(bytes(self._data) or b"null")
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder goes
            raise BodyRefused(400, "the body is not JSON") from None
