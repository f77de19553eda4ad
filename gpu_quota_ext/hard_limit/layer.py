"""The hard-limit layer as the server uses it: started with the server, asked before each kernel start,
and the record of which layers each kernel got (status API, sidebar, %gpucap, /metrics).

With hard_cap = "off" it does nothing at all. With "auto" or "mps" it finds the control program, starts
the managed daemon (or finds the admin's), and checks that the daemon answers; "mps" stops the server
when it does not. Before each kernel start it asks the daemon again, in a thread of its own with a
timeout, and the kernel gets the hard limit only when the daemon answered and serves our uid.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
from typing import Awaitable, Callable, Dict, Mapping, Optional, Sequence

from ..devices import Device
from ..ledger import Grant
from ..policy import Policy
from ..threads import SerialThread, off_loop
from .decisions import (
    DEFAULT_PIPE_DIRECTORY,
    PIPE_VARIABLE,
    HardLimitSettings,
    KernelLayers,
    Probe,
    Route,
    ceiling_commands,
    ceilings,
    decide,
    layers_summary,
)
from .mps import EXTRA_PATH, ManagedDaemon, MpsError, find_control, make_private, probe

log = logging.getLogger("gpu_quota_ext")

class HardLimitUnavailable(Exception):
    """hard_cap = "mps" (required) and no usable MPS control daemon: the server must not start."""


class HardLimitLayer:
    """The hard limit for this server's kernels: its daemon, its check before each start, and what
    each kernel got (for the status API, the sidebar, %gpucap and /metrics)."""

    def __init__(self, settings: HardLimitSettings, runtime_directory: Optional[str] = None, uid: Optional[int] = None):
        self.settings = settings
        self.runtime_directory = runtime_directory or tempfile.gettempdir()
        self.uid = os.getuid() if uid is None else uid
        self.state = "off"  # "off", "on", "unavailable" (auto without a usable daemon), "stopped"
        self.message: Optional[str] = "hard limits are off on this server (c.GpuQuota.hard_cap)"
        self.problem: Optional[str] = None  # why the layer is not on, for each kernel's status
        self.binary: Optional[str] = None
        self.route = Route(None)
        self.daemon: Optional[ManagedDaemon] = None
        self.last_problem: Optional[str] = None
        self.directory: Optional[str] = None
        self.ceilings: Dict[int, int] = {}  # server device index -> the managed daemon's default limit
        self.ceiling_problem: Optional[str] = None
        self._kernels: Dict[str, KernelLayers] = {}
        self._lock = threading.Lock()
        self._probes: Optional[SerialThread] = None
        self._inflight: Optional[asyncio.Future] = None

    # --- server start and stop ---------------------------------------------------------------------

    def start(self, policy: Optional[Policy] = None, devices: Sequence[Device] = ()) -> None:
        """At server start (blocking, before any kernel). Raises HardLimitUnavailable when hard_cap is
        "mps" and no daemon is usable; with "auto" the layer is "unavailable" and says why.

        A managed daemon also gets, per device, a default limit at the largest hard limit `policy` can
        give (a ceiling for processes that remove or raise their own variable)."""
        settings = self.settings
        if settings.mode == "off":
            return
        self.directory = make_private(os.path.join(self.runtime_directory, f"gpu-quota-mps-{os.getpid()}"))
        no_mps = make_private(os.path.join(self.directory, "none"))  # stays empty: no daemon answers there
        self.binary = find_control(settings.control)
        problem = None
        pipe, logs = os.environ.get(PIPE_VARIABLE) or DEFAULT_PIPE_DIRECTORY, None
        if self.binary is None:
            problem = (
                f"{settings.control!r} (c.GpuQuota.mps_control) was found neither on PATH nor in "
                f"{', '.join(EXTRA_PATH)}"
            )
        elif settings.daemon == "managed":
            daemon = ManagedDaemon(self.binary, self.directory, settings.timeout)
            try:
                daemon.start()
            except MpsError as error:
                problem = f"the managed MPS control daemon did not start: {error}"
                daemon.stop()
            else:
                self.daemon = daemon
                pipe, logs = daemon.pipe_directory, daemon.log_directory
                if policy is not None:
                    self._set_ceilings(daemon, policy, devices)
        if problem is None:
            answer = probe(self.binary, pipe, settings.timeout)
            if not answer.answered:
                problem = f"no usable MPS control daemon: {answer.problem}"
        if problem is not None:
            if settings.mode == "mps":
                self.stop_sync()
                raise HardLimitUnavailable(problem)
            daemon, self.daemon = self.daemon, None
            if daemon is not None:
                daemon.stop()
            # Kernels are still kept out of whatever answers (or hangs) at the default pipe directory.
            self.route = Route(None, None, no_mps)
            self.state, self.problem, self.message = "unavailable", problem, f"soft caps only: {problem}"
            log.warning("gpu-quota-ext: hard_cap = 'auto': %s", self.message)
            return
        self.state, self.message = "on", None
        self.route = Route(pipe, logs, no_mps)
        self._probes = SerialThread("gpu-quota-mps")
        log.info(
            "gpu-quota-ext: hard limits on (NVIDIA MPS, %s daemon, pipe directory %s): each kernel's %s + %d MiB for "
            "its CUDA context",
            settings.daemon,
            pipe,
            settings.limit,
            settings.context_allowance >> 20,
        )

    def _set_ceilings(self, daemon: ManagedDaemon, policy: Policy, devices: Sequence[Device]) -> None:
        by_nvml = ceilings(policy, devices, self.settings.context_allowance)
        refused = daemon.configure(ceiling_commands(by_nvml))
        if refused:
            # Each kernel's own limit still holds; only a process that edits its variable is unbounded.
            self.ceiling_problem = f"no default limit on the daemon ({refused})"
            log.warning("gpu-quota-ext: MPS: %s", self.ceiling_problem)
            return
        for device in devices:
            if device.nvml_number in by_nvml:
                self.ceilings[device.index] = by_nvml[device.nvml_number]

    def stop_sync(self) -> None:
        """Stop the managed daemon (if any) and forget every kernel. Idempotent."""
        daemon, self.daemon = self.daemon, None
        if daemon is not None:
            daemon.stop()
        probes, self._probes = self._probes, None
        if probes is not None:
            probes.finish()
        with self._lock:
            for kernel_id in list(self._kernels):
                self._forget_locked(kernel_id)
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        if self.state == "on":
            self.state, self.problem = "stopped", "the server is stopping"
            self.message = self.problem

    async def stop(self, shutdown_kernels: Optional[Callable[[], Awaitable[object]]] = None) -> None:
        """At shutdown: kernels first (they are the daemon's clients: `shutdown_kernels`, the kernel
        manager's), then the daemon, off the loop."""
        if self.daemon is not None and shutdown_kernels is not None:
            try:
                await shutdown_kernels()
            except Exception as error:  # the daemon must still stop
                log.warning("gpu-quota-ext: shutting kernels down before the MPS daemon: %r", error)
        await off_loop(self.stop_sync, name="gpu-quota-mps-stop")

    # --- before each kernel start ------------------------------------------------------------------

    def probe_sync(self) -> Optional[Probe]:
        if self.state != "on":
            return None
        answer = probe(self.binary, self.route.pipe_directory or DEFAULT_PIPE_DIRECTORY, self.settings.timeout)
        self.last_problem = None if answer.answered else answer.problem
        return answer

    async def probe(self) -> Optional[Probe]:
        """The check before a kernel start, in the layer's own thread. Starts at the same moment share
        one check (the answer is about the daemon, not the kernel)."""
        if self.state != "on" or self._probes is None:
            return None
        if self._inflight is None or self._inflight.done():
            self._inflight = self._probes.submit(asyncio.get_running_loop(), self.probe_sync)
        return await asyncio.shield(self._inflight)

    def decide(
        self,
        kernel_id: str,
        grant: Grant,
        devices: Mapping[int, Device],
        env: Mapping[str, str],
        probe_answer: Optional[Probe] = None,
    ) -> Dict[str, str]:
        """The variables the kernel's environment gets for the hard layer; records its layers."""
        if self.settings.mode == "off":
            return {}
        if probe_answer is None and self.state == "on":
            probe_answer = self.probe_sync()  # callers other than the launch hook (it probes off the loop)
        unavailable = None if self.state == "on" else (self.problem or f"the hard-limit layer is {self.state}")
        layers, variables = decide(grant, devices, env, self.settings, unavailable, probe_answer, self.uid, self.route)
        with self._lock:
            self._forget_locked(kernel_id)
            self._kernels[kernel_id] = layers
        log.info("gpu-quota-ext: kernel %s: %s", kernel_id, layers_summary(layers))
        return variables

    def forget(self, kernel_id: str) -> None:
        with self._lock:
            self._forget_locked(kernel_id)

    def _forget_locked(self, kernel_id: str) -> None:
        self._kernels.pop(kernel_id, None)

    def limits(self) -> Dict[str, Dict[int, int]]:
        """kernel id -> device index -> hard limit, for the kernels that hold one now (/metrics)."""
        with self._lock:
            limits = {kid: {d.index: d.limit for d in layers.limits} for kid, layers in self._kernels.items()}
        return {kid: by_device for kid, by_device in limits.items() if by_device}

    # --- what the API shows ------------------------------------------------------------------------

    def layers(self, kernel_id: str) -> Optional[KernelLayers]:
        with self._lock:
            return self._kernels.get(kernel_id)

    def kernel_json(self, grant: Grant) -> dict:
        layers = self.layers(grant.kernel_id)
        if layers is None:  # the layer is off, stopped, or never saw this kernel start
            reason = self.message or "this kernel started without the hard-limit check"
            layers = KernelLayers(
                bool(grant.devices),
                reason=reason,
                mode=self.settings.mode,
                number=self.settings.limit,
                context_allowance=self.settings.context_allowance,
            )
        return layers.to_json(grant)

    def describe(self) -> dict:
        return {
            **self.settings.describe(),
            "state": self.state,
            "message": self.message,
            "pipe_directory": self.route.pipe_directory,
            "ceiling": {str(index): limit for index, limit in sorted(self.ceilings.items())} if self.daemon else None,
            "ceiling_problem": self.ceiling_problem,
            "last_problem": self.last_problem,
        }
