"""The kernel's side of the REST API: ask the server for a cap, ask it to park or resume this kernel,
report allocator usage. Stdlib only.

The kernel proves who it is with the secret the launch hook put in its environment (shared.env_vars.TOKEN). The
secret travels in one header and nowhere else: it is never logged, printed or put in an error message.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.parse
from dataclasses import dataclass, field
from typing import List, Optional

from ..shared.contract import (
    HISTORY_SINCE,
    HISTORY_SUFFIX,
    PARK_SUFFIX,
    RESUME_SUFFIX,
    ROOM_SUFFIX,
    USAGE_SUFFIX,
    kernel_path,
)
from ..shared.contract import KERNEL_TOKEN_HEADER as TOKEN_HEADER
from ..shared.env_vars import API_URL, KERNEL_ID, TOKEN

REQUEST_TIMEOUT_S = 10.0  # the user is waiting on %gpucap; the server answers in milliseconds
USAGE_TIMEOUT_S = 2.0  # usage reports are best effort and must never pile up


@dataclass
class CapAnswer:
    """The server's decision: "granted", "clamped", "refused", or "error" (bad request, no answer)."""

    outcome: str
    message: str
    devices: List[dict] = field(default_factory=list)  # [{index, cap, max_cap, policy_cap}]
    source: Optional[str] = None  # the grant's source after the change ("kernel request", "default", ...)
    status: Optional[int] = None  # HTTP status, None when the server could not be reached

    @property
    def changed(self) -> bool:
        return self.outcome in ("granted", "clamped")


@dataclass
class ParkAnswer:
    """The server's answer to a park or resume request: "accepted" (202, `park` is the kernel's park
    state, shared.contract.PARK_FIELDS), "refused" (the server said no, `message` says why) or "error"
    (no answer, no such route, bad credentials)."""

    outcome: str
    message: str = ""
    park: Optional[dict] = None
    status: Optional[int] = None


class QuotaClient:
    def __init__(self, api_url: str, kernel_id: str, token: str):
        self.api_url = api_url if api_url.endswith("/") else api_url + "/"
        self.kernel_id = kernel_id
        self._token = token
        self._opener = None  # built at the first request: urllib.request costs ~20 ms of kernel start
        self._usage_in_flight = threading.Lock()

    def __repr__(self) -> str:  # never show the secret, even in a debugger
        return f"QuotaClient({self.api_url!r}, kernel {self.kernel_id})"

    @classmethod
    def from_environment(cls, env=os.environ) -> Optional["QuotaClient"]:
        """None when the launch hook gave this kernel no way to reach the server."""
        from . import state as state_module

        # The bootstrap moves the secret from the environment into the kernel's state.
        api_url, kernel_id = env.get(API_URL), env.get(KERNEL_ID)
        token = env.get(TOKEN) or state_module.STATE.token
        if not (api_url and kernel_id and token):
            return None
        return cls(api_url, kernel_id, token)

    def kernel_url(self, *parts: str) -> str:
        path = kernel_path(
            urllib.parse.quote(self.kernel_id, safe=""), *(urllib.parse.quote(p, safe="") for p in parts)
        )
        return self.api_url + path.lstrip("/")

    # --- cap requests ---------------------------------------------------------------------------

    def request_cap(self, cap_text: str, device_index: Optional[int] = None) -> CapAnswer:
        body: dict = {"cap": cap_text}
        if device_index is not None:
            body["device"] = device_index
        return self._put(body)

    def reset(self) -> CapAnswer:
        return self._put({"reset": True})

    def grant(self) -> Optional[dict]:
        """This kernel's record in the server's ledger (caps as the server has them now), or None."""
        try:
            status, reply = self._send("GET", self.kernel_url(), None, USAGE_TIMEOUT_S)
        except OSError:
            return None
        return reply if status == 200 and isinstance(reply, dict) else None

    def _put(self, body: dict) -> CapAnswer:
        try:
            status, reply = self._send("PUT", self.kernel_url(), body, REQUEST_TIMEOUT_S)
        except OSError as error:
            return CapAnswer("error", f"cannot reach the GPU quota server at {self.api_url}: {_reason(error)}")
        if status in (200, 409) and isinstance(reply, dict) and "outcome" in reply:
            kernel = reply.get("kernel") or {}
            return CapAnswer(
                outcome=str(reply["outcome"]),
                message=str(reply.get("message", "")),
                devices=list(kernel.get("devices") or []),
                source=kernel.get("source"),
                status=status,
            )
        message = reply.get("message") if isinstance(reply, dict) else None
        if status == 403:
            message = "the server refused this kernel's credentials (403): " + (message or "forbidden")
        return CapAnswer("error", message or f"the server answered HTTP {status}", status=status)

    # --- parking ----------------------------------------------------------------------------------

    def park(self) -> ParkAnswer:
        """Ask the server to park this kernel once its current cell has finished."""
        return self._post_park(PARK_SUFFIX)

    def resume(self) -> ParkAnswer:
        """Ask the server to bring this kernel's GPU memory back now (or to drop a park not yet done)."""
        return self._post_park(RESUME_SUFFIX)

    def park_state(self) -> Optional[dict]:
        """This kernel's park state as the server has it now (PARK_FIELDS), or None: no answer, or a
        server that does not park."""
        record = self.grant()
        park = record.get("park") if record else None
        return park if isinstance(park, dict) else None

    def _post_park(self, suffix: str) -> ParkAnswer:
        try:
            status, reply = self._send("POST", self.kernel_url(suffix), {}, REQUEST_TIMEOUT_S)
        except OSError as error:
            return ParkAnswer("error", f"cannot reach the GPU quota server at {self.api_url}: {_reason(error)}")
        park = reply.get("park") if isinstance(reply, dict) else None
        message = reply.get("message") if isinstance(reply, dict) else None
        if 200 <= status < 300 and isinstance(park, dict):
            return ParkAnswer("accepted", str(message or ""), park, status)
        if status in (400, 409) and message:  # the server's reason: not parkable, host memory short, ...
            return ParkAnswer("refused", str(message), park if isinstance(park, dict) else None, status)
        if status in (403, 404, 405) and reply is None:
            # Not our API's answer (ours are JSON) but jupyter_server's own error page: no handler has
            # this path. For a POST its catch-all asks for an XSRF cookie first, hence a 403, not a 404.
            message = (
                f"this server cannot park kernels: it has no {suffix} route (HTTP {status}; its gpu-quota-ext "
                "predates parking)"
            )
        elif status == 403:
            message = "the server refused this kernel's credentials (403): " + (message or "forbidden")
        return ParkAnswer("error", str(message or f"the server answered HTTP {status}"), status=status)

    def ask_room(self, device_index: Optional[int]) -> ParkAnswer:
        """This kernel's allocation found the GPU itself full: ask the server to make room up to its cap (where
        the admin turned that on). "accepted" (room is being made: follow `park_state()["room"]`), "refused"
        (off on this server, or nothing to give: `message` says which) or "error"."""
        try:
            body = {"device": device_index}
            status, reply = self._send("POST", self.kernel_url(ROOM_SUFFIX), body, REQUEST_TIMEOUT_S)
        except OSError as error:
            return ParkAnswer("error", f"cannot reach the GPU quota server at {self.api_url}: {_reason(error)}")
        park = reply.get("park") if isinstance(reply, dict) else None
        message = str(reply.get("message") or "") if isinstance(reply, dict) else ""
        if status == 202 and isinstance(park, dict):
            return ParkAnswer("accepted", message, park, status)
        if status == 409:
            return ParkAnswer("refused", message, park if isinstance(park, dict) else None, status)
        return ParkAnswer("error", message or f"the server answered HTTP {status}", status=status)

    # --- usage history -------------------------------------------------------------------------

    def history(self, since: Optional[float] = None) -> Optional[dict]:
        """This kernel's usage history as the server keeps it (contract.KERNEL_HISTORY_FIELDS), the points
        newer than `since` only when given; None: no answer, or a server that keeps none."""
        url = self.kernel_url(HISTORY_SUFFIX)
        if since is not None:
            url += f"?{HISTORY_SINCE}={since!r}"
        try:
            status, reply = self._send("GET", url, None, USAGE_TIMEOUT_S)
        except OSError:
            return None
        if status != 200 or not isinstance(reply, dict) or not isinstance(reply.get("points"), list):
            return None
        return reply

    # --- usage reports --------------------------------------------------------------------------

    def report_usage(self, devices: List[dict]) -> None:
        """POST allocator usage, fire-and-forget from a daemon thread; errors are swallowed (the endpoint
        may not exist on this server). A report still in flight makes this one be skipped."""
        if not devices or not self._usage_in_flight.acquire(blocking=False):
            return

        def send() -> None:
            try:
                self._send("POST", self.kernel_url(USAGE_SUFFIX), {"devices": devices}, USAGE_TIMEOUT_S)
            except Exception:  # broad: the thread's last line; the endpoint may not exist on this server
                pass
            finally:
                self._usage_in_flight.release()

        try:
            threading.Thread(target=send, name="gpu-quota-usage-report", daemon=True).start()
        except Exception:  # broad: a thread that cannot start (RuntimeError at exit): this report is skipped
            self._usage_in_flight.release()

    # --- HTTP -----------------------------------------------------------------------------------

    def _send(self, method: str, url: str, body: Optional[dict], timeout: float):
        """(status, parsed JSON or None). HTTP errors are answers, not exceptions; OSError = no answer."""
        import urllib.error
        import urllib.request

        if self._opener is None:
            # Loopback only: a proxy from the user's environment (HTTP_PROXY) must never see the secret.
            self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        request = urllib.request.Request(
            url,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Content-Type": "application/json", TOKEN_HEADER: self._token},
        )
        try:
            with self._opener.open(request, timeout=timeout) as response:
                return response.status, _json(response.read())
        except urllib.error.HTTPError as error:
            with error:
                return error.code, _json(error.read())


def _json(raw: bytes):
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return None


def _reason(error: OSError) -> str:
    reason = getattr(error, "reason", None) or error
    return str(reason)
