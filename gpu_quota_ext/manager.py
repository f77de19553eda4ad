"""GpuQuotaManager: the one object the extension shares (the launch hook, the REST API, /metrics).

It is built whole and owns its parts: the validated policy, the device inventory, the ledger (any `Ledger`:
the server depends on that interface only), the kernels' secrets, the hard-limit layer, and the usage side
(the monitor that samples, the kernels' allocator reports, the kernels' lifecycle, the watchdog, the status
view, each kernel's usage history) and parking (the parker). It turns "kernel K of kernelspec S is starting"
into a grant and the environment that carries it, and knows which start holds each kernel id, so two starts
that chose the same id cannot share one grant.

Every ledger write (grant, change, reset, release) runs in a thread, never on the event loop: a remote ledger
may block up to its timeout (a daemon thread per call, at most LEDGER_THREADS at once). The writes of one
kernel run in the order asked (a release asked before a restart's grant is made before it). A release asked
from a sync callback (jupyter_client's "dead" event, a failed start) does its bookkeeping at once and the
ledger's call in a thread; one asked again while it is under way is the same release. Reads (get, grants,
device_grants, devices) stay direct.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import getpass
import hmac
import logging
import os
import secrets
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from .devices import Device, NvmlBackend, devices_named, parse_cuda_visible_devices
from .hard_limit import LIMIT_VARIABLE, HardLimitLayer, HardLimitSettings
from .launch_env import is_python_kernel, launch_env, preload
from .ledger import ChangeOutcome, Grant, HostService, LeaseHooks, Ledger
from .parking import (
    CheckpointDriver,
    CudaCheckpointDriver,
    HostBroker,
    KernelChannel,
    KernelClients,
    ParkedKernels,
    Parker,
    ParkSettings,
    RoomBroker,
    preload_library,
    preloads,
)
from .policy import Policy, PolicyDecision, default_decision, resolve, resolve_answer
from .shared.env_vars import LOST
from .shared.sizes import CapSpec, format_bytes, shown
from .status import COLLECTOR, StatusView, host_memory_families, park_families
from .threads import off_loop
from .usage import (
    KernelActions,
    KernelEnds,
    KernelLifecycle,
    KernelReports,
    KernelRoots,
    Monitor,
    PidResolver,
    Sample,
    UsageHistory,
    Watchdog,
    WatchdogSettings,
    history_text,
    kernel_history_text,
    point_for,
    processes_by_kernel,
)

log = logging.getLogger("gpu_quota_ext")

SETTINGS_KEY = "gpu_quota_manager"  # where the extension puts its GpuQuotaManager in the web app's settings

CAPS_CALLABLE_TIMEOUT = 5.0  # seconds a caps callable may take before its kernel gets the default policy
CAPS_CALLABLE_THREADS = 4  # callables still running at once; past that, starts get the default policy
LEDGER_THREADS = 8  # ledger calls at once; more wait their turn


class ServerKernels(KernelRoots, KernelEnds, KernelActions, ParkedKernels, KernelClients, Protocol):
    """The server's kernels as the manager hands them to its parts, each part's Protocol (the monitor's, the
    lifecycle's, the watchdog's, the parker's and its channel's), and their shutdown before the MPS daemon stops.
    usage.KernelManagerView has it all: jupyter_server's kernel manager, seen through one adapter."""

    async def shutdown_all(self) -> None: ...


class KernelIdTaken(Exception):
    """Another start holds this kernel id (a client chose the same id for two starts at once)."""


def describe_grant(grant: Grant) -> str:
    """One line for the server's log: what a kernel got, where, and why."""
    if not grant.devices:
        return f"runs without a GPU cap: {grant.cpu_only_reason}" if grant.cpu_only_reason else "no GPU on this server"
    caps = ", ".join(f"{format_bytes(grant.caps[i])} on device {i}" for i in grant.devices)
    return f"granted {caps} (max {format_bytes(max(grant.max_caps.values()))}; source: {grant.source})"


def server_user() -> str:
    """The user this server runs for: JupyterHub's name for them when spawned by a hub."""
    try:
        fallback = getpass.getuser()
    except (KeyError, OSError, ImportError):  # a uid without a name (a container's), OSError from Python 3.13 on
        fallback = "unknown"
    return os.environ.get("JUPYTERHUB_USER") or fallback


class GpuQuotaManager:
    """`kernels`: the server's kernel manager as its parts need it (ServerKernels); `backend`:
    where the monitor reads NVML; `hard_cap`: the hard-limit layer (off when not given); `checkpoint`: what
    parks kernels (the CUDA driver's checkpoint API when not given)."""

    def __init__(
        self,
        policy: Policy,
        devices: Sequence[Device],
        ledger: Ledger,
        kernels: ServerKernels,
        backend: NvmlBackend,
        watchdog_settings: WatchdogSettings = WatchdogSettings(),
        hard_cap: Optional[HardLimitLayer] = None,
        api_url: Callable[[], Optional[str]] = lambda: None,
        user: Optional[str] = None,
        no_gpu_reason: Optional[str] = None,
        resolver: Optional[PidResolver] = None,
        park_settings: ParkSettings = ParkSettings(),
        checkpoint: Optional[CheckpointDriver] = None,
        room_broker: Optional[RoomBroker] = None,
    ):
        self.policy = policy
        self.devices: Dict[int, Device] = {d.index: d for d in devices}
        self.ledger = ledger
        self.kernels = kernels
        self.user = user or server_user()
        self.no_gpu_reason = no_gpu_reason
        self._api_url = api_url
        self._tokens: Dict[str, str] = {}
        self._tokens_lock = threading.Lock()
        # kernel id -> the start (its provisioner, any object: compared by identity) that holds its grant
        self._holders: Dict[str, object] = {}
        self._holders_lock = threading.RLock()
        self.caps_timeout = CAPS_CALLABLE_TIMEOUT
        self._caps_slots = threading.BoundedSemaphore(CAPS_CALLABLE_THREADS)
        # kernel id -> (what, task) of its latest ledger write in a thread: the next one waits for it.
        self._writes: Dict[str, Tuple[str, asyncio.Task]] = {}
        self._slots: Optional[Tuple[asyncio.AbstractEventLoop, asyncio.Semaphore]] = None
        # The hard limit (MPS): off unless the app gives a layer built from c.GpuQuota.hard_cap.
        self.hard_cap = hard_cap if hard_cap is not None else HardLimitLayer(HardLimitSettings())
        # Usage: measured by the monitor, reported by kernels; caps stay in the ledger.
        self.watchdog_settings = watchdog_settings
        self.monitor = self._new_monitor(devices, backend, resolver)
        self.reports = KernelReports()
        self.watchdog = Watchdog(watchdog_settings, kernels)
        self.lifecycle = KernelLifecycle(kernels, self.ledger, self.release_soon, watchdog_settings.poll_interval)
        self.status = self._new_status_view()
        self._bootstrapped: set = set()  # kernels whose bootstrap answers on their control channel
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # the server's, for calls from the lease's thread
        self._fast_park_library: Optional[concurrent.futures.Future] = None  # fast_park on: its build, once per server
        # The ledger says whether a host service stands behind it (a user server of a hub host): then that service
        # brokers every user's device memory (one view, one decision-maker) and its lease carries the park states.
        host = ledger.host_service()
        self.parker = self._new_parker(park_settings, checkpoint, room_broker, host)
        if host is not None:
            self._follow_host(host)
        self.status.add_kernel_field("park", self.parker.kernel_json, families=park_families)
        self.status.add_server_field("host_memory", self.parker.host_json, families=host_memory_families)
        self.history = UsageHistory()  # each kernel's usage over the last minutes
        self.sample_consumers = self._subscribe_to_samples()

    # --- its parts, built once (__init__) ---------------------------------------------------------

    def _new_monitor(
        self, devices: Sequence[Device], backend: NvmlBackend, resolver: Optional[PidResolver]
    ) -> Monitor:
        return Monitor(
            devices,
            backend,
            self.kernels,
            self.watchdog_settings.poll_interval,
            no_gpu_reason=self.no_gpu_reason,
            resolver=resolver,
            holders=lambda: [g.kernel_id for g in self.ledger.grants()],
        )

    def _new_status_view(self) -> StatusView:
        return StatusView(
            policy=self.policy,
            settings=self.watchdog_settings,
            user=self.user,
            no_gpu_reason=self.no_gpu_reason,
            ledger=self.ledger,
            monitor=self.monitor,
            reports=self.reports,
            watchdog=self.watchdog,
            hard_cap=self.hard_cap,
            kernels=self.kernels,
        )

    def _new_parker(
        self,
        park_settings: ParkSettings,
        checkpoint: Optional[CheckpointDriver],
        room_broker: Optional[RoomBroker],
        host: Optional[HostService],
    ) -> Parker:
        """The parker; on a hub host its broker is the host service's (unless one is given)."""
        if room_broker is None and host is not None:
            room_broker = HostBroker(host, {d.index: d.uuid for d in self.devices.values()})
        return Parker(
            park_settings,
            checkpoint or CudaCheckpointDriver(),
            self.kernels,
            self.ledger,
            self.devices,
            self.monitor,
            self.hard_cap,
            broker=room_broker,
            channel=KernelChannel(self.kernels),
            bootstrapped=self._bootstrapped.__contains__,
            reports_to_host=host is not None,
        )

    def _follow_host(self, host: HostService) -> None:
        """The lease names each kernel's processes (found as the monitor finds them), carries the parker's
        published park states, and hands the host's park requests to the event loop."""
        kernels = self.kernels
        host.subscribe(
            LeaseHooks(
                processes=lambda kernel_ids: processes_by_kernel(kernel_ids, kernels.roots()),
                park_report=self.parker.host_report,
                on_park_requests=self.park_for_host,
            )
        )

    def _subscribe_to_samples(self) -> Tuple[Callable[[Sample], None], ...]:
        """What each sample feeds, in this order (the monitor calls them in the order subscribed; one that raises
        does not keep the next from its turn):
        1. parking: this sample's park states (reservations, activity, idle timers, the broker);
        2. the usage history: a point carries the kernel's park state, so this sample's, after parking;
        3. the review: forget kernels that are gone and let the watchdog act, last, on what parking made of it."""
        consumers: Tuple[Callable[[Sample], None], ...] = (self.parker.on_sample, self._record_history, self._review)
        for consume in consumers:
            self.monitor.on_sample(consume)
        return consumers

    # --- start and stop (event loop) ----------------------------------------------------------

    def start(self) -> None:
        """Start sampling and following the kernels on the running event loop; publish /metrics. Idempotent."""
        self._loop = asyncio.get_running_loop()
        self.monitor.start()
        self.lifecycle.start()
        self.parker.start()
        COLLECTOR.publish(self.status.metric_families)  # /metrics reads the status view at each scrape

    async def stop(self) -> None:
        """Stop sampling and following; wait for the ledger writes under way. Idempotent."""
        COLLECTOR.withdraw(self.status.metric_families)
        await self.monitor.stop()
        await self.lifecycle.stop()
        await self.parker.stop()
        await self.settled()

    def _review(self, sample: Sample) -> None:
        """After each sample: forget kernels that are gone, and let the watchdog act on the sample."""
        # The ledger as it is now: a late sample must not act on a kernel released meanwhile.
        grants = {g.kernel_id: dict(g.caps) for g in self.ledger.grants()}
        known = set(self.kernels.kernel_ids()) | set(grants)
        self.reports.forget_all_but(known)
        self.watchdog.forget_all_but(known)
        self.watchdog.act_on(sample, grants)

    # --- what the REST API and the provisioner ask (they call these, never the parts) ----------------

    def grant_of(self, kernel_id: str) -> Optional[Grant]:
        return self.ledger.get(kernel_id)

    def status_answer(self, paths: Mapping[str, Optional[str]]) -> dict:
        """The status API's answer; `paths`: kernel id -> notebook path."""
        return self.status.answer(paths)

    def kernel_status(self, grant: Grant, paths: Mapping[str, Optional[str]]) -> dict:
        return self.status.kernel(grant, paths)

    def report_usage(self, kernel_id: str, entries: List[dict]) -> None:
        """A kernel's own allocator report (validated by the handler), kept beside the usage."""
        self.reports.report(kernel_id, entries)

    def last_action(self, kernel_id: str) -> Optional[dict]:
        return self.status.last_action(kernel_id)

    async def request_park(self, kernel_id: str, who: str) -> Tuple[bool, dict]:
        """(accepted, the kernel's park object). Raises UnknownKernel for a kernel this server does not have."""
        return await self.parker.request_park(kernel_id, who)

    async def request_resume(self, kernel_id: str, who: str) -> Tuple[bool, dict]:
        return await self.parker.request_resume(kernel_id, who)

    async def request_room(self, kernel_id: str, device: Optional[int]) -> Tuple[bool, dict, str]:
        """A kernel found the device full: room up to its cap, where the admin turned that on."""
        return await self.parker.request_room(kernel_id, device)

    def park_for_host(self, kernel_ids: List[str]) -> None:
        """The host service chose these idle kernels of this server to park, for another kernel of the host (the
        lease's answer, in the lease's thread): the parker decides on the event loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.parker.park_for_host, list(kernel_ids), self.parker.reported_at)

    def holds_gpu_state(self, kernel_id: str) -> bool:
        """The driver holds (or is moving) the kernel's GPU state: its processes cannot run CUDA now."""
        return self.parker.holds_gpu_state(kernel_id)

    def forget_parking(self, kernel_id: str) -> None:
        """The kernel's processes are gone (shut down, restarted): nothing of its parking remains."""
        self.parker.forget(kernel_id)

    async def close(self) -> None:
        """The server is stopping: sampling and following end, the hard-limit layer stops (a managed MPS
        daemon with it), the ledger closes (a RemoteLedger's lease renewals end, in a thread)."""
        await self.stop()
        await self.hard_cap.stop(self.kernels.shutdown_all)
        try:
            await off_loop(self.ledger.close, name="gpu-quota-ledger-close")
        except Exception as error:
            # Whatever a Ledger's close raises (any implementation of the interface): the server stops all the same,
            # and a remote ledger's grants end with its lease at the service.
            log.warning("gpu-quota-ext: closing the ledger failed: %r", error)

    def _record_history(self, sample: Sample) -> None:
        """One history point per kernel holding a GPU: this sample's NVML figures, the kernel's last allocator
        report, its caps and hard limit now, its park state. Kernels without a grant are forgotten."""
        now = time.time()  # not sample.time: without NVML the monitor hands the same old sample each round
        grants = [g for g in self.ledger.grants() if g.devices]
        self.history.forget_all_but({g.kernel_id for g in grants})
        for grant in grants:
            kernel_id = grant.kernel_id
            layers = self.hard_cap.layers(kernel_id)
            point = point_for(
                now,
                grant.devices,
                {index: sample.used(kernel_id, index) for index in grant.devices},
                self.reports.get(kernel_id) or {},
                grant.caps,
                {d.index: d.limit for d in layers.limits} if layers is not None else {},
                self.parker.kernel_json(kernel_id)["state"],
            )
            self.history.add(kernel_id, point)

    def usage_history(self, since: Optional[float] = None) -> str:
        """GET history (JSON text): every kernel's points newer than `since` (wall-clock seconds)."""
        return history_text(self.history, self.monitor.poll_interval, since)

    def kernel_usage_history(self, kernel_id: str, since: Optional[float] = None) -> Optional[str]:
        """GET kernels/<id>/history (JSON text); None for a kernel this server holds no grant for."""
        points = self.history.kernel(kernel_id, since)
        if points is None:
            if self.ledger.get(kernel_id) is None:
                return None
            points = []  # a CPU-only kernel, or one no sample has seen yet
        return kernel_history_text(points, self.history, self.monitor.poll_interval)

    def gpu_pids(self, kernel_id: str) -> Tuple[int, ...]:
        """The kernel's processes on the GPUs in the last sample (parking checkpoints these)."""
        return self.monitor.gpu_pids(kernel_id)

    # --- kernel lifecycle (called by the provisioner) -----------------------------------------

    async def admit(
        self,
        kernel_id: str,
        kernelspec: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        holder: Optional[object] = None,
        *,
        language: str,
    ) -> Dict[str, str]:
        """Grant (or find, on restart) the kernel's caps; return the variables its environment gets.

        `holder` is the start asking (its provisioner): a restart by the same holder keeps its grant;
        another start of the same kernel id raises KernelIdTaken. `language` (the kernelspec's) and `argv`
        say whether the bootstrap runs there (launch_env.is_python_kernel). Raises AdmissionRefused
        (on_full="refuse") or PolicyError (a cap that cannot be granted on a device).
        """
        grant = self._held_grant(kernel_id, holder)
        if grant is None:
            self._check_free(kernel_id, holder)
            resolved = await self.resolve_caps(kernelspec)
            with self._holders_lock:
                # Another start of this id may have won while the caps callable ran; from here this
                # start holds the id, while the ledger's grant is made in a thread.
                self._check_free(kernel_id, holder)
                self._holders[kernel_id] = holder
            try:
                grant = await self._write(
                    kernel_id,
                    "grant",
                    functools.partial(
                        self.ledger.grant, kernel_id, self.user, kernelspec, resolved, allowed=self._pinned_devices(env)
                    ),
                )
            except BaseException:  # not swallowed (raised again), cancellation included: the id is free again
                with self._holders_lock:
                    if self._holders.get(kernel_id) is holder:
                        del self._holders[kernel_id]
                raise
            log.info("gpu-quota-ext: kernel %s (%s) %s", kernel_id, kernelspec, describe_grant(grant))
        # Only a Python kernel's bootstrap moves the secret out of its environment: no one else gets it.
        python = is_python_kernel(argv, language)
        if python:
            self._bootstrapped.add(kernel_id)
        else:
            self._bootstrapped.discard(kernel_id)
        probe = await self.hard_cap.probe()  # asks the MPS daemon (hard_cap on) in a thread, with a timeout
        hard_limit = self.hard_cap.decide(kernel_id, grant, self.devices, env, probe)
        updates = launch_env(
            grant,
            self.devices,
            env,
            api_url=self._api_url() if python else None,
            token=self.token_for(kernel_id) if python else None,
            python_kernel=python,
            hard_limit=hard_limit,
        )
        if preloads(self.parker.settings.fast_park, python, mps_client=LIMIT_VARIABLE in hard_limit):
            library = await self.fast_park_library()
            if library is not None:  # a failed build said so once: the kernel parks the old way
                updates.update(preload(env, library))
        lost = self.parker.lost_env(kernel_id) if python else None
        if lost is not None:  # restarted after its process ended while parked: its first cell says so
            updates[LOST] = lost
        return updates

    async def fast_park_library(self) -> Optional[str]:
        """The fast park library's path, built once into the cache folder (in a thread: a compile takes a second),
        or None when it could not be built."""
        if self._fast_park_library is None:
            # A thread's future, not a loop's: the build outlives any one event loop that asked for it first.
            built: concurrent.futures.Future = concurrent.futures.Future()

            def build() -> None:
                try:
                    built.set_result(preload_library())
                except BaseException as error:  # handed to every waiter, which says it once and goes on
                    built.set_exception(error)

            threading.Thread(target=build, name="gpu-quota-fast-park-build", daemon=True).start()
            self._fast_park_library = built
        try:
            # shielded: a start cancelled while it waits leaves the build to the next one
            return await asyncio.shield(asyncio.wrap_future(self._fast_park_library))
        except Exception:  # broad: never a kernel's start refused for it (preload_library logged why)
            return None

    async def release(self, kernel_id: str, holder: Optional[object] = None) -> Optional[Grant]:
        """Free the kernel's grant and secret; the grant that was released, or None. With `holder`, only
        if that start holds them (a start that lost the race for its kernel id must not release the
        winner's grant). Idempotent."""
        if not self._forget(kernel_id, holder):
            return None
        task = self._pending(kernel_id, "release") or self._write(
            kernel_id, "release", functools.partial(self.ledger.release, kernel_id)
        )
        return await task

    def release_soon(self, kernel_id: str, holder: Optional[object] = None) -> bool:
        """`release` for sync callers on the event loop (jupyter_client's callbacks, a start that failed):
        the bookkeeping at once, the ledger's call in a thread. False when the holder check refused or
        this kernel's release is already under way."""
        if self._pending(kernel_id, "release") is not None or not self._forget(kernel_id, holder):
            return False
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no event loop here (a script): nothing to keep from blocking
            self.ledger.release(kernel_id)
            return True
        self._write(kernel_id, "release", functools.partial(self.ledger.release, kernel_id))
        return True

    def _forget(self, kernel_id: str, holder: Optional[object]) -> bool:
        """The release's bookkeeping: who holds the id, the secret, the hard limit. False (nothing done)
        when `holder` is given and another start holds the id."""
        with self._holders_lock:
            if holder is not None and self._holders.get(kernel_id, holder) is not holder:
                return False
            self._holders.pop(kernel_id, None)
        with self._tokens_lock:
            self._tokens.pop(kernel_id, None)
        self._bootstrapped.discard(kernel_id)
        self.hard_cap.forget(kernel_id)
        return True

    # --- cap changes (the REST API) -------------------------------------------------------------

    async def change(
        self, kernel_id: str, requested: CapSpec, device: Optional[int] = None, source: str = "kernel request"
    ) -> ChangeOutcome:
        """The ledger's answer to a new cap on one granted device (or all). Raises UnknownKernel, PolicyError."""
        return await self._write(
            kernel_id, "change", functools.partial(self.ledger.change, kernel_id, requested, device, source=source)
        )

    async def reset(self, kernel_id: str, source: str = "kernel request") -> ChangeOutcome:
        """Back to what policy gave the kernel at start, as far as the budget allows."""
        return await self._write(kernel_id, "reset", functools.partial(self.ledger.reset, kernel_id, source=source))

    # --- ledger writes, off the event loop, in order per kernel ------------------------------------

    def _write(self, kernel_id: str, what: str, call: Callable[[], Any]) -> asyncio.Task:
        before = self._writes.get(kernel_id)

        async def write() -> Any:
            if before is not None:
                await asyncio.wait({before[1]})  # whatever its outcome: its caller hears of that
            async with self._ledger_slots():
                return await off_loop(call, name="gpu-quota-ledger")

        task = asyncio.get_running_loop().create_task(write())
        self._writes[kernel_id] = (what, task)
        task.add_done_callback(functools.partial(self._written, kernel_id, what))
        return task

    def _written(self, kernel_id: str, what: str, task: asyncio.Task) -> None:
        if self._writes.get(kernel_id, (None, None))[1] is task:
            del self._writes[kernel_id]
        error = None if task.cancelled() else task.exception()  # retrieved here: a release has no awaiter
        if error is not None and what == "release":
            log.error("gpu-quota-ext: releasing kernel %s's grant failed: %r", kernel_id, error)

    def _ledger_slots(self) -> asyncio.Semaphore:
        """At most LEDGER_THREADS ledger calls at once (a slow remote ledger, a storm of requests): the
        rest wait their turn on the loop. One semaphore per event loop (tests run several)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(LEDGER_THREADS))
        return self._slots[1]

    def _pending(self, kernel_id: str, what: str) -> Optional[asyncio.Task]:
        """The kernel's last ledger write, if it is a `what` still under way."""
        last = self._writes.get(kernel_id)
        return last[1] if last is not None and last[0] == what and not last[1].done() else None

    async def settled(self) -> None:
        """Wait until every ledger write asked so far is made (tests, the server's stop)."""
        while self._writes:
            await asyncio.wait([task for _, task in list(self._writes.values())])

    def holder(self, kernel_id: str) -> Optional[object]:
        with self._holders_lock:
            return self._holders.get(kernel_id)

    def _held_grant(self, kernel_id: str, holder: Optional[object]) -> Optional[Grant]:
        with self._holders_lock:
            if kernel_id not in self._holders or self._holders[kernel_id] is not holder:
                return None
        return self.ledger.get(kernel_id)

    def _check_free(self, kernel_id: str, holder: Optional[object]) -> None:
        with self._holders_lock:
            if kernel_id in self._holders and self._holders[kernel_id] is not holder:
                raise KernelIdTaken(
                    f"kernel {shown(kernel_id)} is already starting or running; a new kernel needs another id"
                )

    # --- what policy gives a kernel -------------------------------------------------------------

    async def resolve_caps(self, kernelspec: str) -> PolicyDecision:
        """Policy's answer for this server's user and `kernelspec`. A caps callable (the admin's code) runs
        in a thread, never on the event loop; if it fails, hangs or answers nonsense, the kernel gets the
        default policy and the log one warning line."""
        policy = self.policy
        rules = policy.rules
        if not callable(rules):
            return resolve(policy, self.user, kernelspec)
        try:
            return resolve_answer(policy, await self._call_caps(rules, kernelspec))
        except Exception as error:  # the admin's code may raise anything: logged, and the kernel starts all the same
            log.warning(
                "gpu-quota-ext: c.GpuQuota.caps callable failed for user %s, kernelspec %s: %s; the kernel gets the "
                "default policy",
                shown(self.user),
                shown(kernelspec),
                _one_line(error),
            )
            return default_decision(policy, "default (caps callable failed)")

    async def _call_caps(self, rules: Callable[[str, str], Any], kernelspec: str) -> Any:
        # The admin's callable may answer anything: resolve_answer checks what it is.
        # At most CAPS_CALLABLE_THREADS calls run at once, so hung callables cannot pile up threads.
        if not self._caps_slots.acquire(blocking=False):
            raise TimeoutError(f"{CAPS_CALLABLE_THREADS} earlier calls have not returned yet")
        answered = off_loop(
            rules, self.user, kernelspec, name="gpu-quota-caps-callable", finished=self._caps_slots.release
        )
        try:
            return await asyncio.wait_for(answered, self.caps_timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer within {self.caps_timeout:g} s") from None

    def _pinned_devices(self, env: Mapping[str, str]) -> Optional[List[int]]:
        """A kernelspec that sets its own CUDA_VISIBLE_DEVICES is placed only among those devices."""
        pinned = parse_cuda_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
        if pinned is None or pinned == parse_cuda_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES")):
            return None
        return [device.index for device in devices_named(list(self.devices.values()), pinned)]

    # --- the kernels' secrets ------------------------------------------------------------------

    def token_for(self, kernel_id: str) -> str:
        """The kernel's secret; the same across restarts so a restarted kernel can still ask."""
        with self._tokens_lock:
            token = self._tokens.get(kernel_id)
            if token is None:
                token = self._tokens[kernel_id] = secrets.token_urlsafe(32)
            return token

    def token_matches(self, kernel_id: str, presented: Optional[str]) -> bool:
        with self._tokens_lock:
            expected = self._tokens.get(kernel_id)
        if not (expected and presented):
            return False
        # Bytes: compare_digest refuses non-ASCII str, and a header may carry anything.
        return hmac.compare_digest(expected.encode(), presented.encode("utf-8", "surrogateescape"))


def _one_line(error: BaseException) -> str:
    """An exception as one short line for the log (no traceback: the admin's bug, not ours)."""
    try:
        text = " ".join(str(error).split())
    except Exception:  # the admin's exception may not even print: the line names its class only
        text = ""
    return f"{error.__class__.__name__}: {text[:200]}" if text else error.__class__.__name__
