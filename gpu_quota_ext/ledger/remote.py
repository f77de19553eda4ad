"""The remote ledger: a user server's grants, held by the host's quota service (a JupyterHub service).

On a hub host the service keeps one ledger for every user (shared/service_contract.py is the wire). This
server asks it for every write (grant, change, reset, release) and keeps a copy of its own grants as the
service last answered them, so reads (get, grants, device_grants) answer at once. Writes block up to
CALL_TIMEOUT: the manager makes them off the event loop (manager.py). The calls go through transport.py (HTTP,
the token, timeouts); the grants stay alive through the lease (lease.py), started at the first grant.

- The service knows the user from this server's token: the ledger never names the user. The policy is the
  service's too: the local PolicyDecision passed to `grant` (what c.GpuQuota would give) is ignored, so a user's
  own config can neither raise a cap nor skip admission.
- Devices are UUIDs on the wire and this server's indexes here.
- The host's broker (parking.HostRooms): `room(body)` asks the service's broker for this server's kernels
  that wait for device memory; the lease carries their park states and the service's park requests
  (`subscribe`, the manager's wiring). `host_service()` says so: the manager wires parking by it.
- A kernel start while the service cannot be reached is retried START_RETRIES times, then refused with
  "the GPU quota service at <url> is unreachable: ...": never a kernel started without a cap silently.
  Whatever the service granted of it all the same (it answered just as this server gave up) is given back
  before the next start and at each renewal.
  A cap change then is refused (the cap stays); a release is left to the next lease renewal.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence

from ..devices import Device
from ..policy import PolicyDecision
from ..shared.env_vars import SERVICE_URL as SERVICE_URL_ENV
from ..shared.service_contract import (
    CALL_TIMEOUT,
    GRANTS_PATH,
    LEASE_RENEW,
    LEASE_SECONDS,
    ROOM_PATH,
    START_RETRIES,
    STATUS_PATH,
)
from ..shared.sizes import CapSpec, PolicyError, shown
from .interface import AdmissionRefused, ChangeOutcome, Grant, HeldGrants, HostService, LeaseHooks, UnknownKernel
from .lease import Lease
from .transport import RETRY_DELAY, ServiceTransport, Unreachable, url_problem
from .transport import ssl_context as hub_tls

log = logging.getLogger("gpu_quota_ext")


class _Unusable(ValueError):
    """An answer that says something this server cannot act on (a grant on a device it does not have)."""


UNUSABLE = "GPU quota service answer unusable"
OTHER_DEVICES = "GPU quota service has other GPUs"
REFUSED = "Refused by the GPU quota service"


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
        self._transport = ServiceTransport(url, token, call_timeout, ssl_context)
        self.url = self._transport.url
        self.server = server
        self.start_retries = start_retries
        self.retry_delay = retry_delay
        self._grants: Dict[str, Grant] = {}
        # Starts given up while the service did not answer: it may still take their queued requests (a hung
        # service resumed), so each is given back at the next contact rather than held until its lease says.
        self._abandoned: Dict[str, float] = {}  # kernel id -> time.monotonic() when given up
        self._giving_back = threading.Lock()  # held while abandoned starts are given back
        self._lock = threading.Lock()
        self._host_devices: Dict[str, dict] = {}  # uuid -> the service's row: the host's budget, every user's grants
        self.lease = Lease(self._transport, self, server, renew_every, retry_delay)

    @classmethod
    def from_environment(
        cls, devices: Sequence[Device], environ: Mapping[str, str] = os.environ
    ) -> Optional["RemoteLedger"]:
        """The remote ledger the hub asks for ($GPU_QUOTA_SERVICE_URL), or None when it asks for none.
        PolicyError when the hub set something that is not a service's URL, or gave this server no token
        to present: the server refuses to start, rather than fail every kernel start. Only the hub sets the URL
        (hub/service/configure.py): no c.GpuQuota setting names it, so a user's config cannot point it elsewhere."""
        url = (environ.get(SERVICE_URL_ENV) or "").strip()
        if not url:
            return None
        problem = url_problem(url)
        if problem:
            raise PolicyError(f"${SERVICE_URL_ENV} = {shown(url)} is not the URL of a GPU quota service: {problem}")
        token = environ.get("JUPYTERHUB_API_TOKEN") or environ.get("JPY_API_TOKEN")
        if not token:
            raise PolicyError(
                f"${SERVICE_URL_ENV} is set ({shown(url)}) but this server has no JUPYTERHUB_API_TOKEN to present to it"
            )
        return cls(devices, url, token, environ.get("JUPYTERHUB_SERVER_NAME", ""), ssl_context=hub_tls(environ))

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
            answer = self._transport.call_retrying("POST", GRANTS_PATH, body, self.start_retries, self.retry_delay)
        except AdmissionRefused:
            with self._lock:
                self._abandoned[kernel_id] = time.monotonic()
            self.lease.start()  # the renewals give it back once the service answers
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
            self.lease.start()
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
            answer = self._transport.call("DELETE", f"{GRANTS_PATH}/{kernel_id}")
        except Unreachable as error:
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
        return self.lease.brokers

    def room(self, body: dict) -> dict:
        """POST ROOM_PATH: the host's broker's answer for this server's kernels that wait. OSError when the
        service cannot be reached or refuses the request (the waiting kernels say so and wait)."""
        try:
            answer = self._transport.call("POST", ROOM_PATH, {**body, "server": self.server})
        except Unreachable as error:
            raise OSError(f"unreachable: {error}") from None
        if answer.code != 200:
            raise OSError(f"HTTP {answer.code}: {answer.message}")
        return answer.data

    # --- the lease (lease.py) ------------------------------------------------------------------

    def subscribe(self, hooks: LeaseHooks) -> None:
        """What the lease reports and whom it tells about park requests (the manager, once)."""
        self.lease.subscribe(hooks)

    def held(self) -> List[str]:
        """The kernel ids this server holds a grant for: what each renewal lists."""
        with self._lock:
            return list(self._grants)

    def released(self, kernel_ids: Sequence[object]) -> None:
        """The service released these grants (its lease renewal's answer): forgotten here."""
        with self._lock:
            dropped = [k for k in kernel_ids if isinstance(k, str) and self._grants.pop(k, None) is not None]
        for kernel_id in dropped:
            log.warning("gpu-quota-ext: the GPU quota service released kernel %s's grant", kernel_id)

    def renewed(self) -> None:
        """The service answered a renewal: starts given up go back, the host's devices are learnt again."""
        self._give_back_abandoned()
        self._learn_host_devices()

    def _give_back_abandoned(self) -> None:
        """DELETE what the service may have granted for starts given up while it did not answer (before the next
        start, and at each renewal). The service does not grant a request whose caller has gone (handlers.py),
        but it may have granted one just as this server gave up waiting for the answer."""
        with self._giving_back:
            with self._lock:
                abandoned = [(k, since) for k, since in self._abandoned.items() if k not in self._grants]
            for kernel_id, since in abandoned:
                try:
                    answer = self._transport.call("DELETE", f"{GRANTS_PATH}/{kernel_id}")
                except Unreachable:
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
            answer = self._transport.call("GET", STATUS_PATH)
        except Unreachable:
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

    def host_service(self) -> HostService:
        """This ledger is the service's client: its room calls and its lease (the manager wires parking to them)."""
        return self

    def close(self) -> None:
        """Stop renewing (the server is stopping); a renewal under way (a long poll) ends at once. Idempotent."""
        self._transport.close()
        self.lease.join()

    # --- the wire -------------------------------------------------------------------------------

    def _put(self, kernel_id: str, current: Grant, body: dict) -> ChangeOutcome:
        try:
            answer = self._transport.call("PUT", f"{GRANTS_PATH}/{kernel_id}", body)
        except Unreachable as error:
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
