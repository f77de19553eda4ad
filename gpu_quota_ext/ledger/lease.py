"""The lease of a user server on a hub host: the thread that keeps its grants alive at the host's quota service.

- A background thread renews the lease every LEASE_RENEW seconds (sooner when the service grants shorter leases),
  listing every kernel the ledger holds a grant for and their processes: a service that restarted re-learns them,
  and the grants of a server that stopped renewing (it crashed) are released by the service when the lease runs
  out. Kernels the service says it released are handed back to the ledger (LeaseHolder), which forgets them.
- Each renewal carries the kernels' park states and is a long poll: the service answers as soon as it wants some
  of this server's idle kernels parked for another kernel of the host, else after the renewal interval; an early
  answer is followed by the next renewal at once. A service that does not know these keys (an older one answers
  400) gets plain renewals from then on (`brokers` turns False).
- What the server gives the lease (the kernels' processes, their park report, what to do with park requests) comes
  in one `LeaseHooks` (interface.py), given once through `subscribe` (the manager's wiring); until then the lease
  lists no processes, reports no park states and ignores park requests. The hooks run in the lease's thread: they
  read what the event loop published and hand work to the loop, never touch its state (manager.py, parking.Parker).
- The thread never touches the event loop; it ends when the transport closes (the ledger's close()).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional, Protocol, Sequence

from ..shared.service_contract import LEASE_PATH, LEASE_RENEW
from .interface import LeaseHooks
from .transport import RETRY_DELAY, ServiceTransport, Unreachable

log = logging.getLogger("gpu_quota_ext")


class LeaseHolder(Protocol):
    """What the lease needs of the ledger that holds the grants."""

    def held(self) -> List[str]:
        """The kernel ids this server holds a grant for."""

    def released(self, kernel_ids: Sequence[object]) -> None:
        """The service says it released these kernels' grants (the lease's answer, unchecked)."""

    def renewed(self) -> None:
        """The service answered a renewal: whatever waits for its next contact may go on."""


class Lease:
    """This server's lease at the service behind `transport`, renewed in a thread from `start()` on."""

    def __init__(
        self,
        transport: ServiceTransport,
        holder: LeaseHolder,
        server: str = "",
        renew_every: float = LEASE_RENEW,
        retry_delay: float = RETRY_DELAY,
    ):
        self._transport = transport
        self._holder = holder
        self.server = server
        self.renew_every = renew_every
        self.retry_delay = retry_delay
        self._hooks = LeaseHooks()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._interval = renew_every
        self._reachable = True  # the thread logs the moments this changes, not every failed try
        self._long_polls = True  # False once the service refused a renewal with "park" and "wait" (an older one)
        self._asked_to_park = False  # the last renewal's answer named kernels to park

    def subscribe(self, hooks: LeaseHooks) -> None:
        """The server's hooks, from now on (the next renewal uses them). Given once, by the manager."""
        self._hooks = hooks

    @property
    def brokers(self) -> bool:
        """The host service brokers device memory (room calls, park requests): False for a service of an older
        version, found out at the first lease it refused with the new keys."""
        return self._long_polls

    def start(self) -> None:
        """Renew in a thread from now on (the first grant, or a start given up). Idempotent; none once closed."""
        with self._lock:
            if self._thread is not None or self._transport.closed.is_set():
                return
            self._thread = threading.Thread(target=self._renew_loop, name="gpu-quota-lease", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait for the thread to end (the transport is closed: a renewal under way has ended)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._transport.call_timeout + 1)

    def renew(self, wait: Optional[float] = None) -> bool:
        """One lease renewal: every kernel this server holds a grant for, with its processes and park states.
        Kernels the service says it released go back to the ledger; kernels it asks this server to park are handed
        to the hooks' `on_park_requests`. `wait`: seconds the service may hold the answer back until it has kernels
        of this server to park (a long poll). False when the service could not be reached."""
        hooks = self._hooks
        self._asked_to_park = False
        held = self._holder.held()
        try:
            pids = hooks.processes(set(held))
        except Exception as error:  # the lease goes on without PIDs: the grants matter more
            log.warning("gpu-quota-ext: finding the kernels' processes for the lease failed: %r", error)
            pids = {}
        body: Dict[str, Any] = {
            "server": self.server,
            "kernels": [{"kernel_id": k, "pids": pids.get(k, [])} for k in held],
        }
        if self._long_polls:
            try:
                body["park"] = list(hooks.park_report())
            except Exception as error:  # the lease goes on without park states: the service counts them running
                log.warning("gpu-quota-ext: reading the kernels' park states for the lease failed: %r", error)
                body["park"] = []
            if wait is not None:
                body["wait"] = min(max(0.0, float(wait)), float(LEASE_RENEW))  # the most the contract allows
        transport = self._transport
        try:
            if body.get("wait"):
                with transport.long_poll():
                    answer = transport.call("POST", LEASE_PATH, body, transport.call_timeout + float(body["wait"]))
            else:
                answer = transport.call("POST", LEASE_PATH, body)
            if answer.code == 400 and "park" in body:
                # A service of an older version knows neither key: asked again without them, it renews; then plain
                # renewals from now on (a 400 for another reason stays a refusal, and the keys stay).
                answer = transport.call("POST", LEASE_PATH, {"server": body["server"], "kernels": body["kernels"]})
                if answer.code == 200:
                    with self._lock:
                        first, self._long_polls = self._long_polls, False
                    if first:
                        log.info(
                            "gpu-quota-ext: the GPU quota service at %s does not broker device memory (it refused a "
                            "lease with park states): plain lease renewals from now on",
                            transport.url,
                        )
        except Unreachable as error:
            if transport.closed.is_set():
                return False  # close() ended the call
            if self._reachable:
                log.warning(
                    "gpu-quota-ext: the GPU quota service at %s is unreachable (%s): kernels keep their caps; "
                    "new kernels are refused until it answers",
                    transport.url,
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
                "gpu-quota-ext: the GPU quota service at %s answers again; %d kernel(s) registered",
                transport.url,
                len(held),
            )
        self._reachable = True
        seconds = answer.data.get("lease_seconds")
        if isinstance(seconds, (int, float)) and seconds > 0:
            # Four renewals per lease: one lost answer does not cost a server its grants.
            self._interval = max(0.1, min(self.renew_every, seconds / 4))
        self._holder.released(answer.data.get("released") or [])
        self._hand_park_requests(hooks, answer.data.get("park"))
        self._holder.renewed()
        return True

    def _hand_park_requests(self, hooks: LeaseHooks, asked: object) -> None:
        """The kernels of this server the service asks to park (the lease's answer), those this server holds."""
        if not isinstance(asked, list):
            return
        held = set(self._holder.held())
        kernel_ids = list(dict.fromkeys(k for k in asked if isinstance(k, str) and k in held))
        if not kernel_ids:
            return
        self._asked_to_park = True
        try:
            hooks.on_park_requests(kernel_ids)
        except Exception as error:  # the next answer asks again if they are still wanted
            log.warning("gpu-quota-ext: the host service's park requests for %s failed: %r", kernel_ids, error)

    def _renew_loop(self) -> None:
        closed = self._transport.closed
        while not closed.is_set():
            began = time.monotonic()
            ok = self.renew(wait=self._interval)
            if not ok:
                # Unreachable: try again soon, so a restarted service re-learns this server's kernels at once.
                closed.wait(min(self._interval, self.retry_delay))
            elif not self._asked_to_park:
                # A long poll that waited its interval renews at once; an answer that came early for no park (a
                # service without long polls) waits out the rest of the interval.
                closed.wait(max(0.0, self._interval - (time.monotonic() - began)))
