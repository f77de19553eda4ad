"""The remote ledger: a user server's grants, held by the host's quota service (a JupyterHub service).

On a hub host the service keeps one ledger for every user (shared/service_contract.py is the wire). This
server asks it for every write (grant, change, reset, release) and keeps a copy of its own grants as the
service last answered them, so reads (get, grants, device_grants) answer at once. Writes block up to
CALL_TIMEOUT: the manager makes them off the event loop (manager.py).

- It authenticates with this server's own hub token and never names the user: the service asks the hub
  whose token it is. The policy is the service's too: the local PolicyDecision passed to `grant` (what
  c.GpuQuota would give) is ignored, so a user's own config can neither raise a cap nor skip admission.
- Devices are UUIDs on the wire and this server's indexes here.
- A background thread renews this server's lease every LEASE_RENEW seconds (sooner when the service
  grants shorter leases), listing every kernel it holds a grant for and their processes (`processes`, given
  by the server: usage.attribution finds them, as for the monitor; none until it is given): a service that
  restarted re-learns them, and the grants of a server that stopped renewing (it crashed) are released
  by the service when the lease runs out. The thread never touches the event loop; `close()` stops it, and
  ends a renewal under way at once.
- The host's broker (parking.HostRooms): `room(body)` asks the service's broker for this server's kernels
  that wait for device memory. Each renewal carries the kernels' park states (`park_report()`, set by the
  manager) and is a long poll: the service answers as soon as it wants some of this server's idle kernels
  parked for another kernel of the host ("park", handed to `on_park_requests`, in this thread), else after
  the renewal interval; an early answer is followed by the next renewal at once. A service that does not know
  these keys (an older one answers 400) gets plain renewals from then on.
- A kernel start while the service cannot be reached is retried START_RETRIES times, then refused with
  "the GPU quota service at <url> is unreachable: ...": never a kernel started without a cap silently.
  Whatever the service granted of it all the same (it answered just as this server gave up) is given back
  before the next start and at each renewal.
  A cap change then is refused (the cap stays); a release is left to the next lease renewal.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set

from ..devices import Device
from ..policy import CapSpec, PolicyDecision, PolicyError, shown
from ..shared.env_vars import SERVICE_URL as SERVICE_URL_ENV
from ..shared.service_contract import (
    CALL_TIMEOUT,
    GRANTS_PATH,
    LEASE_PATH,
    LEASE_RENEW,
    LEASE_SECONDS,
    ROOM_PATH,
    START_RETRIES,
    STATUS_PATH,
)
from .interface import AdmissionRefused, ChangeOutcome, Grant, HeldGrants, UnknownKernel

log = logging.getLogger("gpu_quota_ext")

# Set by the hub (hub/service/configure.py) in every user server's environment: the service's URL with
# its prefix, e.g. "http://127.0.0.1:10101/services/gpu-quota/". Only the hub sets
# it: there is no c.GpuQuota setting for it, so a user's config file cannot point it elsewhere.
RETRY_DELAY = 1.0  # seconds between two tries of a kernel start, and between lease tries while unreachable
MAX_ANSWER = 1024 * 1024  # bytes of one answer this server reads


class _Unreachable(Exception):
    """No usable answer: connection refused or reset, timeout, a proxy's 502/503/504, not JSON."""


class _Unusable(ValueError):
    """An answer that says something this server cannot act on (a grant on a device it does not have)."""


UNREACHABLE = "GPU quota service unreachable"
UNUSABLE = "GPU quota service answer unusable"
OTHER_DEVICES = "GPU quota service has other GPUs"
REFUSED = "Refused by the GPU quota service"


@dataclass(frozen=True)
class _Answer:
    code: int
    data: dict

    @property
    def message(self) -> str:
        text = self.data.get("message") if isinstance(self.data, dict) else None
        return str(text) if text else f"HTTP {self.code}"


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
        """The calls of this thread inside the block are long polls."""
        self._local.long_poll = True
        try:
            yield
        finally:
            self._local.long_poll = False

    def factory(self, http_class: Any) -> Callable[..., http.client.HTTPConnection]:
        tracker = self

        class Tracked(http_class):  # type: ignore[misc, valid-type]
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
        def do_open(self, http_class, req, **kwargs):  # type: ignore[override]
            return super().do_open(connections.factory(http_class), req, **kwargs)

    class Https(urllib.request.HTTPSHandler):
        def do_open(self, http_class, req, **kwargs):  # type: ignore[override]
            return super().do_open(connections.factory(http_class), req, **kwargs)

    return [Http(), Https(context=ssl_context)]


def _ssl_context(environ: Mapping[str, str]) -> Optional[ssl.SSLContext]:
    """The hub's internal TLS (c.JupyterHub.internal_ssl): its CA and this server's client certificate."""
    ca = environ.get("JUPYTERHUB_SSL_CLIENT_CA")
    if not ca:
        return None
    context = ssl.create_default_context(cafile=ca)
    if environ.get("JUPYTERHUB_SSL_CERTFILE"):
        context.load_cert_chain(environ["JUPYTERHUB_SSL_CERTFILE"], environ.get("JUPYTERHUB_SSL_KEYFILE") or None)
    return context


class RemoteLedger(HeldGrants):
    """The `Ledger` of a user server on a hub host: the quota service decides, this keeps its answers."""

    def __init__(
        self,
        devices: Sequence[Device],
        url: str,
        token: str,
        server: str = "",
        call_timeout: float = CALL_TIMEOUT,
        renew_every: float = LEASE_RENEW,
        start_retries: int = START_RETRIES,
        retry_delay: float = RETRY_DELAY,
        ssl_context: Optional[ssl.SSLContext] = None,
    ):
        self._devices = list(devices)
        self._uuid_of = {d.index: d.uuid for d in self._devices}
        self._index_of = {d.uuid: d.index for d in self._devices}
        self.url = url if url.endswith("/") else url + "/"
        self._token = token
        self.server = server
        self.call_timeout = call_timeout
        self.renew_every = renew_every
        self.start_retries = start_retries
        self.retry_delay = retry_delay
        # No proxy from the environment: the service is the hub's, reached on the hub's own network.
        self._connections = _Connections()
        handlers: list = [urllib.request.ProxyHandler({}), *_tracked_handlers(self._connections, ssl_context)]
        self._opener = urllib.request.build_opener(*handlers)
        self._grants: Dict[str, Grant] = {}
        # Starts given up while the service did not answer: it may still take their queued requests (a hung
        # service resumed), so each is given back at the next contact rather than held until its lease says.
        self._abandoned: Dict[str, float] = {}  # kernel id -> time.monotonic() when given up
        self._giving_back = threading.Lock()  # held while abandoned starts are given back
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._renewer: Optional[threading.Thread] = None
        self._interval = renew_every
        self._reachable = True  # the renewer logs the moments this changes, not every failed try
        self._host_devices: Dict[str, dict] = {}  # uuid -> the service's row: the host's budget, every user's grants
        # kernel ids -> {kernel id: its processes' PIDs}; called from the renewer thread.
        self.processes: Callable[[Set[str]], Dict[str, List[int]]] = lambda kernel_ids: {}
        # The host's broker (parking.HostRooms), both called from the renewer thread and set by the manager: this
        # server's kernels' park states (KERNEL_PARK of the wire), and what to do with the kernels the service
        # asks this server to park.
        self.park_report: Callable[[], List[dict]] = lambda: []
        self.on_park_requests: Callable[[List[str]], None] = lambda kernel_ids: None
        self._long_polls = True  # False once the service refused a renewal with "park" and "wait" (an older one)
        self._asked_to_park = False  # the last renewal's answer named kernels to park
    @classmethod
    def from_environment(
        cls, devices: Sequence[Device], environ: Mapping[str, str] = os.environ
    ) -> Optional["RemoteLedger"]:
        """The remote ledger the hub asks for ($GPU_QUOTA_SERVICE_URL), or None when it asks for none.
        PolicyError when the hub set something that is not a service's URL, or gave this server no token
        to present: the server refuses to start, rather than fail every kernel start."""
        url = (environ.get(SERVICE_URL_ENV) or "").strip()
        if not url:
            return None
        problem = _url_problem(url)
        if problem:
            raise PolicyError(f"${SERVICE_URL_ENV} = {shown(url)} is not the URL of a GPU quota service: {problem}")
        token = environ.get("JUPYTERHUB_API_TOKEN") or environ.get("JPY_API_TOKEN")
        if not token:
            raise PolicyError(
                f"${SERVICE_URL_ENV} is set ({shown(url)}) but this server has no JUPYTERHUB_API_TOKEN to present to it"
            )
        return cls(devices, url, token, environ.get("JUPYTERHUB_SERVER_NAME", ""), ssl_context=_ssl_context(environ))

    # --- the interface ------------------------------------------------------------------------

    def grant(
        self,
        kernel_id: str,
        user: str,
        kernelspec: str,
        decision: PolicyDecision,
        allowed: Optional[Sequence[int]] = None,
    ) -> Grant:
        """Ask the service to admit a starting kernel. `user` and `decision` are not sent: the service
        knows the user from the token and resolves the policy itself. Raises AdmissionRefused (budget
        full, not this user's kernel id, the service unreachable after START_RETRIES tries) or PolicyError."""
        with self._lock:
            held = self._grants.get(kernel_id)
        if held is not None:
            return held  # a restart keeps its grant
        # Starts given up before go back first, so that they count no more in this user's limits; this kernel id's
        # own (asked again) is not given back: the service answers this request with what it holds of it.
        self._forget_abandoned(kernel_id)
        self._give_back_abandoned()
        body = {
            "server": self.server,
            "kernel_id": kernel_id,
            "kernelspec": kernelspec,
            "allowed": None if allowed is None else [self._uuid_of[i] for i in allowed if i in self._uuid_of],
        }
        try:
            answer = self._call_retrying("POST", GRANTS_PATH, body)
        except AdmissionRefused:
            with self._lock:
                self._abandoned[kernel_id] = time.monotonic()
            self._start_renewer()  # the renewals give it back once the service answers
            raise
        if answer.code in (200, 201):
            try:
                grant = self._grant_from_wire(answer.data, kernel_id)
            except _Unusable as problem:
                # The service holds it now: given back at once, not when this server's lease runs out.
                self._give_back(kernel_id)
                reason = OTHER_DEVICES if problem.args[1:] == ("devices",) else UNUSABLE
                raise AdmissionRefused(f"{problem.args[0]}; the grant was given back", reason) from None
            with self._lock:
                self._grants[kernel_id] = grant
            self._start_renewer()
            return grant
        if answer.code == 400:
            raise PolicyError(f"the GPU quota service: {answer.message}")
        if answer.code == 409:
            raise AdmissionRefused(answer.message)
        raise AdmissionRefused(
            f"the GPU quota service at {self.url} refused this kernel ({answer.code}): {answer.message}", REFUSED
        )

    def change(
        self, kernel_id: str, requested: CapSpec, device: Optional[int] = None, source: str = "kernel request"
    ) -> ChangeOutcome:
        """Ask the service for a new cap. `source` is not on the wire: the grant's source is the service's."""
        current = self._held(kernel_id)
        if not current.devices:
            raise PolicyError("this kernel holds no GPU (it runs on CPU), so it has no cap to change")
        if device is not None and device not in current.devices:
            raise PolicyError(f"device {device} is not one of this kernel's devices {list(current.devices)}")
        cap = requested.text or (requested.nbytes if requested.nbytes is not None else requested.fraction)
        body = {"cap": cap, "device": None if device is None else self._uuid_of[device]}
        return self._put(kernel_id, current, body)

    def reset(self, kernel_id: str, source: str = "kernel request") -> ChangeOutcome:
        return self._put(kernel_id, self._held(kernel_id), {"reset": True})

    def release(self, kernel_id: str) -> Optional[Grant]:
        """Forget the grant here and tell the service. Unreachable: the next lease renewal, which no longer
        lists the kernel, releases it there (or the lease runs out)."""
        with self._lock:
            gone = self._grants.pop(kernel_id, None)
        if gone is not None:
            self._give_back(kernel_id)
        return gone

    def _give_back(self, kernel_id: str) -> None:
        """DELETE the service's grant of a kernel this server no longer holds (released, or never usable)."""
        try:
            answer = self._call("DELETE", f"{GRANTS_PATH}/{kernel_id}")
        except _Unreachable as error:
            log.warning(
                "gpu-quota-ext: kernel %s released here; the GPU quota service at %s is unreachable (%s): "
                "its lease renewal releases it there",
                kernel_id,
                self.url,
                error,
            )
            return
        if answer.code not in (204, 404):
            log.warning(
                "gpu-quota-ext: the GPU quota service answered %s to the release of kernel %s: %s",
                answer.code,
                kernel_id,
                answer.message,
            )

    def device_grants(self) -> List[dict]:
        """Per device: the host's budget and what every user holds of it, as the service said at the last
        lease renewal (what decides whether the next kernel fits); before that, this server's grants and
        no budget."""
        with self._lock:
            held = list(self._grants.values())
            host = dict(self._host_devices)
        rows = []
        for d in self._devices:
            row = {
                "index": d.index,
                "name": d.name,
                "uuid": d.uuid,
                "total": d.total,
                "budget": None,
                "granted": sum(g.caps[d.index] for g in held if d.index in g.caps),
                "kernels": sum(1 for g in held if d.index in g.caps),
            }
            seen = host.get(d.uuid)
            if seen is not None:
                row.update(budget=seen["budget"], granted=seen["granted"], kernels=seen["kernels"])
            rows.append(row)
        return rows

    @property
    def devices(self) -> List[Device]:
        return list(self._devices)

    # --- the host's broker (parking.HostRooms) -------------------------------------------------------

    @property
    def brokers(self) -> bool:
        """The host service brokers device memory (room calls, park requests): False for a service of an older
        version, found out at the first lease it refused with the new keys."""
        return self._long_polls

    def room(self, body: dict) -> dict:
        """POST ROOM_PATH: the host's broker's answer for this server's kernels that wait. OSError when the
        service cannot be reached or refuses the request (the waiting kernels say so and wait)."""
        try:
            answer = self._call("POST", ROOM_PATH, {**body, "server": self.server})
        except _Unreachable as error:
            raise OSError(f"unreachable: {error}") from None
        if answer.code != 200:
            raise OSError(f"HTTP {answer.code}: {answer.message}")
        return answer.data

    # --- the lease ------------------------------------------------------------------------------

    def renew(self, wait: Optional[float] = None) -> bool:
        """One lease renewal: every kernel this server holds a grant for, with its processes and park states.
        Kernels the service says it released are forgotten here; kernels it asks this server to park are handed
        to `on_park_requests`. `wait`: seconds the service may hold the answer back until it has kernels of this
        server to park (a long poll). False when the service could not be reached."""
        self._asked_to_park = False
        with self._lock:
            held = list(self._grants)
        try:
            pids = self.processes(set(held))
        except Exception as error:  # the lease goes on without PIDs: the grants matter more
            log.warning("gpu-quota-ext: finding the kernels' processes for the lease failed: %r", error)
            pids = {}
        body: Dict[str, Any] = {
            "server": self.server,
            "kernels": [{"kernel_id": k, "pids": pids.get(k, [])} for k in held],
        }
        if self._long_polls:
            try:
                body["park"] = list(self.park_report())
            except Exception as error:  # the lease goes on without park states: the service counts them running
                log.warning("gpu-quota-ext: reading the kernels' park states for the lease failed: %r", error)
                body["park"] = []
            if wait is not None:
                body["wait"] = min(max(0.0, float(wait)), float(LEASE_RENEW))  # the most the contract allows
        try:
            if body.get("wait"):
                with self._connections.long_poll():
                    answer = self._call("POST", LEASE_PATH, body, self.call_timeout + float(body["wait"]))
            else:
                answer = self._call("POST", LEASE_PATH, body)
            if answer.code == 400 and "park" in body:
                # A service of an older version knows neither key: asked again without them, it renews; then plain
                # renewals from now on (a 400 for another reason stays a refusal, and the keys stay).
                answer = self._call("POST", LEASE_PATH, {"server": body["server"], "kernels": body["kernels"]})
                if answer.code == 200:
                    with self._lock:
                        first, self._long_polls = self._long_polls, False
                    if first:
                        log.info(
                            "gpu-quota-ext: the GPU quota service at %s does not broker device memory (it refused a "
                            "lease with park states): plain lease renewals from now on",
                            self.url,
                        )
        except _Unreachable as error:
            if self._stopped.is_set():
                return False  # close() ended the call
            if self._reachable:
                log.warning(
                    "gpu-quota-ext: the GPU quota service at %s is unreachable (%s): kernels keep their caps; "
                    "new kernels are refused until it answers",
                    self.url,
                    error,
                )
            self._reachable = False
            return False
        if answer.code != 200:
            log.warning(
                "gpu-quota-ext: the GPU quota service refused this server's lease (%s): %s", answer.code, answer.message
            )
            return False
        if not self._reachable:
            log.info(
                "gpu-quota-ext: the GPU quota service at %s answers again; %d kernel(s) registered", self.url, len(held)
            )
        self._reachable = True
        seconds = answer.data.get("lease_seconds")
        if isinstance(seconds, (int, float)) and seconds > 0:
            # Four renewals per lease: one lost answer does not cost a server its grants.
            self._interval = max(0.1, min(self.renew_every, seconds / 4))
        released = answer.data.get("released") or []
        with self._lock:
            dropped = [k for k in released if isinstance(k, str) and self._grants.pop(k, None) is not None]
        for kernel_id in dropped:
            log.warning("gpu-quota-ext: the GPU quota service released kernel %s's grant", kernel_id)
        self._hand_park_requests(answer.data.get("park"))
        self._give_back_abandoned()
        self._learn_host_devices()
        return True

    def _hand_park_requests(self, asked: Any) -> None:
        """The kernels of this server the service asks to park (the lease's answer), those this server holds."""
        if not isinstance(asked, list):
            return
        with self._lock:
            kernel_ids = list(dict.fromkeys(k for k in asked if isinstance(k, str) and k in self._grants))
        if not kernel_ids:
            return
        self._asked_to_park = True
        try:
            self.on_park_requests(kernel_ids)
        except Exception as error:  # the next answer asks again if they are still wanted
            log.warning("gpu-quota-ext: the host service's park requests for %s failed: %r", kernel_ids, error)

    def _give_back_abandoned(self) -> None:
        """DELETE what the service may have granted for starts given up while it did not answer (before the next
        start, and at each renewal). The service does not grant a request whose caller has gone (handlers.py),
        but it may have granted one just as this server gave up waiting for the answer."""
        with self._giving_back:
            with self._lock:
                abandoned = [(k, since) for k, since in self._abandoned.items() if k not in self._grants]
            for kernel_id, since in abandoned:
                try:
                    answer = self._call("DELETE", f"{GRANTS_PATH}/{kernel_id}")
                except _Unreachable:
                    return  # the next start or renewal tries again
                # Given back, or not ours: done. Not granted (404): perhaps not yet (a service of an older version
                # may still take a queued request); after a lease period its own renewal check released it.
                lease_over = time.monotonic() - since > float(LEASE_SECONDS)
                if answer.code in (204, 403) or (answer.code == 404 and lease_over):
                    with self._lock:
                        self._abandoned.pop(kernel_id, None)

    def _forget_abandoned(self, kernel_id: str) -> None:
        """Stop giving back `kernel_id` (it is asked for again). A give-back under way ends first: none of it
        may reach the service after the new request."""
        with self._giving_back, self._lock:
            self._abandoned.pop(kernel_id, None)

    def _learn_host_devices(self) -> None:
        """The host's budget and grants per device (the service's status), for device_grants()."""
        try:
            answer = self._call("GET", STATUS_PATH)
        except _Unreachable:
            return
        rows = answer.data.get("devices") if answer.code == 200 else None
        if not isinstance(rows, list):
            return
        seen = {}
        for row in rows:
            try:
                budget = row["budget"]
                seen[str(row["uuid"])] = {
                    "budget": None if budget is None else int(budget),
                    "granted": int(row["granted"]),
                    "kernels": int(row["kernels"]),
                }
            except (KeyError, TypeError, ValueError):
                continue  # a row this server cannot read: that device shows this server's own view
        with self._lock:
            self._host_devices = seen

    def decided_by(self) -> Optional[str]:
        return f"the host's GPU quota service at {self.url}"

    def close(self) -> None:
        """Stop renewing (the server is stopping); a renewal under way (a long poll) ends at once. Idempotent."""
        self._stopped.set()
        self._connections.end_all()
        renewer = self._renewer
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join(self.call_timeout + 1)

    def _start_renewer(self) -> None:
        with self._lock:
            if self._renewer is not None or self._stopped.is_set():
                return
            self._renewer = threading.Thread(target=self._renew_loop, name="gpu-quota-lease", daemon=True)
        self._renewer.start()

    def _renew_loop(self) -> None:
        while not self._stopped.is_set():
            began = time.monotonic()
            ok = self.renew(wait=self._interval)
            if not ok:
                # Unreachable: try again soon, so a restarted service re-learns this server's kernels at once.
                self._stopped.wait(min(self._interval, self.retry_delay))
            elif not self._asked_to_park:
                # A long poll that waited its interval renews at once; an answer that came early for no park (a
                # service without long polls) waits out the rest of the interval.
                self._stopped.wait(max(0.0, self._interval - (time.monotonic() - began)))

    # --- the wire -------------------------------------------------------------------------------

    def _put(self, kernel_id: str, current: Grant, body: dict) -> ChangeOutcome:
        try:
            answer = self._call("PUT", f"{GRANTS_PATH}/{kernel_id}", body)
        except _Unreachable as error:
            return ChangeOutcome(
                "refused",
                current,
                f"the GPU quota service at {self.url} is unreachable: {error}; the cap stays as it was",
            )
        if answer.code in (403, 404):
            with self._lock:
                self._grants.pop(kernel_id, None)
            raise UnknownKernel(kernel_id)
        if answer.code == 400:
            raise PolicyError(answer.message)
        if answer.code != 200:
            return ChangeOutcome("refused", current, f"the GPU quota service answered {answer.code}: {answer.message}")
        try:
            grant = self._grant_from_wire(answer.data, kernel_id)
        except _Unusable as problem:
            return ChangeOutcome("refused", current, f"{problem.args[0]}; the cap stays as it was")
        with self._lock:
            if kernel_id in self._grants:  # released meanwhile: stays released
                self._grants[kernel_id] = grant
        status = answer.data.get("status")
        if status not in ("granted", "clamped", "refused"):
            raise PolicyError(f"the GPU quota service answered an unknown status {shown(status)}")
        return ChangeOutcome(status, grant, str(answer.data.get("message", "")))

    def _held(self, kernel_id: str) -> Grant:
        with self._lock:
            grant = self._grants.get(kernel_id)
        if grant is None:
            raise UnknownKernel(kernel_id)
        return grant

    def _grant_from_wire(self, data: dict, kernel_id: str) -> Grant:
        """The grant of the service's answer, in this server's device indexes. _Unusable when it is none;
        its second argument "devices" when the service granted a device this server does not have."""
        record = data.get("grant") if isinstance(data, dict) else None
        try:
            if not isinstance(record, dict) or record.get("kernel_id") != kernel_id:
                raise ValueError("no grant for this kernel")
            entries = record["devices"]
            unknown = [str(e["uuid"]) for e in entries if e["uuid"] not in self._index_of]
            if unknown:
                have = shown(", ".join(self._index_of)) if self._index_of else "none"
                raise _Unusable(
                    f"the host's GPU quota service at {self.url} granted device {shown(', '.join(unknown))}, which "
                    f"this server does not have: it has {have} (the service and the users' servers must list the "
                    "host's GPUs by the same UUIDs)",
                    "devices",
                )
            index = {e["uuid"]: self._index_of[e["uuid"]] for e in entries}
            return Grant(
                kernel_id=kernel_id,
                user=str(record["user"]),
                kernelspec=str(record["kernelspec"]),
                devices=tuple(index[e["uuid"]] for e in entries),
                caps={index[e["uuid"]]: int(e["cap"]) for e in entries},
                policy_caps={index[e["uuid"]]: int(e["policy_cap"]) for e in entries},
                max_caps={index[e["uuid"]]: int(e["max_cap"]) for e in entries},
                source=str(record["source"]),
                placed=bool(record["placed"]),
                cpu_only_reason=record.get("cpu_only_reason"),
            )
        except _Unusable:
            raise
        except (KeyError, TypeError, ValueError) as error:
            raise _Unusable(
                f"the GPU quota service at {self.url} answered something this server cannot use: {error}"
            ) from None

    def _call_retrying(self, method: str, path: str, body: dict) -> _Answer:
        """A kernel start's call: START_RETRIES more tries, RETRY_DELAY apart, while the service cannot be
        reached; then AdmissionRefused. A repeated grant request is harmless (the service answers 200)."""
        error: Optional[_Unreachable] = None
        for attempt in range(self.start_retries + 1):
            if attempt:
                self._stopped.wait(self.retry_delay)
            try:
                return self._call(method, path, body)
            except _Unreachable as failure:
                error = failure
        raise AdmissionRefused(f"the GPU quota service at {self.url} is unreachable: {error}", UNREACHABLE)

    def _call(self, method: str, path: str, body: Optional[dict] = None, timeout: Optional[float] = None) -> _Answer:
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
                raise _Unreachable(f"HTTP {error.code}") from None
            return _answer(error.code, raw, allow_text=True)
        except (urllib.error.URLError, OSError, socket.timeout) as error:
            reason = getattr(error, "reason", error)
            raise _Unreachable(str(reason) or error.__class__.__name__) from None


def _url_problem(url: str) -> Optional[str]:
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


def _answer(code: int, raw: bytes, allow_text: bool = False) -> _Answer:
    if len(raw) > MAX_ANSWER:
        raise _Unreachable(f"an answer over {MAX_ANSWER} bytes")
    if not raw:
        return _Answer(code, {})
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        if allow_text:  # an error page: its first line is the message
            return _Answer(code, {"message": raw[:200].decode(errors="replace").strip()})
        raise _Unreachable(f"HTTP {code} with an answer that is not JSON") from None
    return _Answer(code, data if isinstance(data, dict) else {})
