"""The server extension: configuration traits and wiring, nothing else.

Every setting can come from an environment variable (what JupyterHub spawners set per user); config
files and the command line override it. Invalid values stop the server at start with one line naming
the setting and the value: a quota extension that failed to load would let kernels start uncapped.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import List, Optional, Tuple

from jupyter_client.provisioning.factory import KernelProvisionerFactory
from jupyter_server.extension.application import ExtensionApp
from traitlets import Any as AnyTrait
from traitlets import TraitError, Type, Unicode, default

from .devices import Device, DeviceInventory, NvmlInventory
from .handlers import HANDLERS
from .hard_cap import HardCapLayer, HardCapUnavailable
from .hard_limit import HardCapSettings, build_hard_cap_settings
from .monitor import Monitor, KernelManagerView
from .nvml import NvmlBackend, PynvmlBackend
from .ledger import Ledger
from .local_ledger import LocalLedger
from .policy import Policy, PolicyError, build_policy
from .remote_ledger import SERVICE_URL_ENV, RemoteLedger
from .provisioner import SETTINGS_KEY
from .manager import GpuQuotaManager
from .watchdog import WatchdogSettings, build_enforcement

PROVISIONER_NAME = "gpu-quota-provisioner"


def kernel_api_url(ip: str, port: int, base_url: str, tls: bool) -> str:
    """Where kernels (processes on this machine) reach the server's API.

    Loopback when the server listens on every address or on a loopback name; else the one address it
    listens on (nothing answers on 127.0.0.1 then). IPv6 addresses go in brackets.
    """
    host = (ip or "").strip("[]")
    if host in ("", "*", "0.0.0.0", "::", "localhost", "127.0.0.1", "::1"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}{base_url}"


def _make_ledger(devices: List[Device], policy: Policy) -> Ledger:
    """The ledger this server's grants go through: the host's quota service when the hub names one
    ($GPU_QUOTA_SERVICE_URL, an environment the hub sets, never a c.GpuQuota setting), else this server's own."""
    try:
        remote = RemoteLedger.from_environment(devices)
    except PolicyError as error:
        raise SystemExit(invalid_configuration(str(error))) from None
    if remote is None:
        return LocalLedger(devices, policy)
    logging.getLogger("gpu_quota_ext").info(
        "gpu-quota-ext: the host's GPU quota service at %s is in charge (%s): it decides every cap and admission; "
        "this server's c.GpuQuota default_cap, max_cap, caps, overcommit, placement and on_full are ignored",
        remote.url, SERVICE_URL_ENV,
    )
    return remote


def _env(name: str, fallback):
    return os.environ.get(name, fallback)


def invalid_configuration(message: str) -> str:
    """The one line a bad setting gives, the same from the server and from `jupyter gpu-quota check`."""
    return f"gpu-quota-ext: invalid configuration: {message}"


class GpuQuota(ExtensionApp):
    """GPU memory caps for every kernel of this server (config section `c.GpuQuota`)."""

    name = "gpu_quota_ext"
    load_other_extensions = True

    default_cap = Unicode(
        help="""Cap every kernel gets at start, on each GPU it is given: a fraction of the device
        ("0.25"), a percentage ("25%"), a size ("12GiB", "12GB") or bytes. Default: $GPU_QUOTA_DEFAULT_CAP or "0.25".""",
    ).tag(config=True, env="GPU_QUOTA_DEFAULT_CAP")

    @default("default_cap")
    def _default_cap(self):
        return self._from_env("default_cap", "0.25")

    max_cap = Unicode(
        help="""The most a kernel may ask for later with %gpucap or the API, same forms as default_cap.
        Default: $GPU_QUOTA_MAX_CAP or "1.0" (users may opt into the whole device).""",
    ).tag(config=True, env="GPU_QUOTA_MAX_CAP")

    @default("max_cap")
    def _default_max_cap(self):
        return self._from_env("max_cap", "1.0")

    caps = AnyTrait(
        default_value=[],
        help="""Rules that give some kernels another cap, first match wins: a list of dicts with keys
        'user' and 'kernelspec' (glob patterns, default '*'), 'cap', and optional 'max_cap' and 'devices'
        (how many GPUs the kernel gets, default 1). Or a callable (user, kernelspec) -> cap, rule dict or None.""",
    ).tag(config=True)

    overcommit = AnyTrait(
        help="""Admission control: each device's budget is its memory x overcommit; a kernel whose cap does
        not fit on any device is handled by on_full. None = no admission control (never blocks a start).
        Default: $GPU_QUOTA_OVERCOMMIT or None.""",
    ).tag(config=True, env="GPU_QUOTA_OVERCOMMIT")

    @default("overcommit")
    def _default_overcommit(self):
        return self._from_env("overcommit", None)

    placement = Unicode(
        help="""Which GPU a kernel is put on (through CUDA_VISIBLE_DEVICES): "spread" (the least granted),
        "pack" (fill GPU 0 first) or "none" (the kernel sees every GPU, capped on each). Default: $GPU_QUOTA_PLACEMENT or "spread".""",
    ).tag(config=True, env="GPU_QUOTA_PLACEMENT")

    @default("placement")
    def _default_placement(self):
        return self._from_env("placement", "spread")

    on_full = Unicode(
        help="""When no device has budget left: "refuse" (the start fails with a clear message) or
        "cpu-only" (the kernel starts with no GPU visible). Default: $GPU_QUOTA_ON_FULL or "cpu-only".""",
    ).tag(config=True, env="GPU_QUOTA_ON_FULL")

    @default("on_full")
    def _default_on_full(self):
        return self._from_env("on_full", "cpu-only")

    on_over_max = Unicode(
        help="""A cap request above max_cap or the device's budget: "clamp" (grant the most allowed) or
        "refuse". Default: $GPU_QUOTA_ON_OVER_MAX or "clamp".""",
    ).tag(config=True, env="GPU_QUOTA_ON_OVER_MAX")

    @default("on_over_max")
    def _default_on_over_max(self):
        return self._from_env("on_over_max", "clamp")

    inventory_class = Type(
        default_value=NvmlInventory,
        klass=DeviceInventory,
        help="""Where the list of GPUs comes from: NVML (default) or
        gpu_quota_ext.devices.StaticInventory with c.StaticInventory.devices (tests, demos without a GPU).""",
    ).tag(config=True)

    enforce = Unicode(
        help="""What the watchdog does to a kernel whose processes use more GPU memory than its cap plus slack
        (measured by NVML, so CuPy, raw CUDA and subprocesses count): "off", "warn" (log it and show it in the
        status API and sidebar), "interrupt", "restart" or "kill" the kernel. Default: $GPU_QUOTA_ENFORCE or "warn":
        in-process caps already stop the common frameworks cleanly, and a false alarm (a usage spike, a large
        CUDA context) must not cost a user their kernel's state unless the admin chose so.""",
    ).tag(config=True, env="GPU_QUOTA_ENFORCE")

    @default("enforce")
    def _default_enforce(self):
        return self._from_env("enforce", "warn")

    slack = AnyTrait(
        help="""How far over its cap a kernel may go before the watchdog acts: a size ("1GiB", bytes) or a
        fraction of the kernel's cap ("0.1", "10%"). NVML counts the CUDA context (about 600 MiB per process)
        that no in-process cap counts. Default: $GPU_QUOTA_SLACK or "1GiB".""",
    ).tag(config=True, env="GPU_QUOTA_SLACK")

    @default("slack")
    def _default_slack(self):
        return self._from_env("slack", "1GiB")

    grace = AnyTrait(
        help="""Seconds a kernel must stay over cap plus slack before the watchdog acts (0: on the first sample
        over it). Default: $GPU_QUOTA_GRACE or 0.""",
    ).tag(config=True, env="GPU_QUOTA_GRACE")

    @default("grace")
    def _default_grace(self):
        return self._from_env("grace", "0")

    poll_interval = AnyTrait(
        help="""Seconds between two NVML samples of every GPU (0.05 to 60). Default: $GPU_QUOTA_POLL_INTERVAL or 1.""",
    ).tag(config=True, env="GPU_QUOTA_POLL_INTERVAL")

    @default("poll_interval")
    def _default_poll_interval(self):
        return self._from_env("poll_interval", "1")

    nvml_class = Type(
        default_value=PynvmlBackend,
        klass=NvmlBackend,
        help="""Where the monitor reads per-process GPU memory: the driver through nvidia-ml-py (default), or
        gpu_quota_ext.fake_nvml.FakeNvml (tests, benchmarks).""",
    ).tag(config=True)

    hard_cap = Unicode(
        help="""A hard limit at allocation time through NVIDIA MPS, on top of the soft caps: "off", "auto" (MPS
        when a usable MPS control daemon answers; otherwise soft caps only, and the status says why) or "mps"
        (required: the server refuses to start without a usable daemon). Default: $GPU_QUOTA_HARD_CAP or "off".""",
    ).tag(config=True, env="GPU_QUOTA_HARD_CAP")

    @default("hard_cap")
    def _default_hard_cap(self):
        return self._from_env("hard_cap", "off")

    mps_daemon = Unicode(
        help="""Which MPS control daemon kernels use: "managed" (this server starts its own, with pipe and log
        directories under its runtime directory, and stops it at shutdown) or "external" (an admin's, at
        $CUDA_MPS_PIPE_DIRECTORY or /tmp/nvidia-mps). Default: $GPU_QUOTA_MPS_DAEMON or "managed".""",
    ).tag(config=True, env="GPU_QUOTA_MPS_DAEMON")

    @default("mps_daemon")
    def _default_mps_daemon(self):
        return self._from_env("mps_daemon", "managed")

    hard_limit = Unicode(
        help="""Which number a kernel's hard limit is: "max_cap" (%gpucap stays live up to max_cap, nothing ever
        passes it) or "cap" (the cap at kernel start; a raise above it takes effect at the next restart).
        Default: $GPU_QUOTA_HARD_LIMIT or "max_cap".""",
    ).tag(config=True, env="GPU_QUOTA_HARD_LIMIT")

    @default("hard_limit")
    def _default_hard_limit(self):
        return self._from_env("hard_limit", "max_cap")

    mps_context_allowance = AnyTrait(
        help="""Added to each hard limit for the CUDA context, which MPS counts against the limit (about 514 MiB
        measured on an H200): a size or 0. Default: $GPU_QUOTA_MPS_CONTEXT_ALLOWANCE or "640MiB".""",
    ).tag(config=True, env="GPU_QUOTA_MPS_CONTEXT_ALLOWANCE")

    @default("mps_context_allowance")
    def _default_mps_context_allowance(self):
        return self._from_env("mps_context_allowance", "640MiB")

    mps_control = Unicode(
        help="""The MPS control program, a name looked up on PATH and in /usr/local/nvidia/bin, or a path.
        Default: $GPU_QUOTA_MPS_CONTROL or "nvidia-cuda-mps-control".""",
    ).tag(config=True, env="GPU_QUOTA_MPS_CONTROL")

    @default("mps_control")
    def _default_mps_control(self):
        return self._from_env("mps_control", "nvidia-cuda-mps-control")

    mps_timeout = AnyTrait(
        help="""Seconds one call of the MPS control program may take (it is asked before every kernel start;
        a daemon that does not answer in time gives that kernel soft caps only). Default: $GPU_QUOTA_MPS_TIMEOUT or 5.""",
    ).tag(config=True, env="GPU_QUOTA_MPS_TIMEOUT")

    @default("mps_timeout")
    def _default_mps_timeout(self):
        return self._from_env("mps_timeout", "5")

    def _link_jupyter_server_extension(self, serverapp):
        try:
            super()._link_jupyter_server_extension(serverapp)
        except TraitError as error:
            self._stop_server(str(error))

    def _from_env(self, name: str, fallback):
        """A setting's default: its environment variable (the trait's `env` tag) when set, else `fallback`."""
        return _env(self.trait_metadata(name, "env"), fallback)

    def environment_source(self, name: str) -> Optional[str]:
        """The environment variable a setting's value came from; None when config, the command line or
        the built-in default gave it."""
        variable = self.trait_metadata(name, "env")
        if not variable or variable not in os.environ or f"GpuQuota.{name}" in self.config:
            return None
        return variable if getattr(self, name) == os.environ[variable] else None

    def validated_settings(self) -> Tuple[Policy, WatchdogSettings, HardCapSettings]:
        """The policy, the watchdog's and the hard limit's settings, validated. The server's start and `jupyter gpu-quota
        check` both come here: PolicyError names the first bad setting, and its environment variable
        when the value came from there."""
        try:
            policy = build_policy(
                self.default_cap,
                self.max_cap,
                self.caps,
                self.overcommit,
                self.placement,
                self.on_full,
                self.on_over_max,
            )
            enforcement = build_enforcement(self.enforce, self.slack, self.grace, self.poll_interval)
            hard_cap = build_hard_cap_settings(
                self.hard_cap, self.mps_daemon, self.hard_limit, self.mps_context_allowance, self.mps_control, self.mps_timeout
            )
        except PolicyError as error:
            raise PolicyError(self._name_the_environment(str(error))) from None
        return policy, enforcement, hard_cap

    def _name_the_environment(self, message: str) -> str:
        for name in self.class_own_traits(config=True):
            variable = self.environment_source(name)
            written = f"c.GpuQuota.{name} = {getattr(self, name)!r}"
            if variable and message.startswith(written + ": "):
                return f"{written} (from the environment variable {variable}){message[len(written):]}"
        return message

    def initialize_settings(self):
        self._log_through_the_server()
        try:
            policy, enforcement, hard_cap = self.validated_settings()
            inventory = self.inventory_class(parent=self)
            devices = inventory.list_devices()
        except (PolicyError, TraitError) as error:
            self._stop_server(str(error))
        service = GpuQuotaManager(
            policy,
            devices,
            ledger=_make_ledger(devices, policy),
            api_url=self._api_url,
            no_gpu_reason=inventory.problem,
        )
        service.hard_cap = HardCapLayer(hard_cap, self.serverapp.runtime_dir if self.serverapp else None)
        try:
            service.hard_cap.start(policy, devices)
        except HardCapUnavailable as error:
            self._stop_server(f"c.GpuQuota.hard_cap = 'mps' needs a usable NVIDIA MPS control daemon: {error}")
        service.monitor = Monitor(
            devices,
            service.ledger,
            self.nvml_class(),
            KernelManagerView(self.serverapp.kernel_manager),
            enforcement,
            no_gpu_reason=inventory.problem,
            release=service.release,
        )
        self.settings[SETTINGS_KEY] = service
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # the usual case: the loop starts later and _start_jupyter_server_extension starts the monitor
        else:
            # Embedders that initialize on a running loop (pytest-jupyter) never call that hook.
            service.monitor.start()
        # Every kernelspec without a provisioner stanza of its own now starts through our hook.
        KernelProvisionerFactory.instance().default_provisioner_name = PROVISIONER_NAME
        self.log.info(
            "gpu-quota-ext: default_cap %s, max_cap %s, placement %s, on_full %s, overcommit %s, %d GPU(s)",
            policy.default_cap, policy.max_cap, policy.placement, policy.on_full, policy.overcommit, len(devices),
        )
        self.log.info(
            "gpu-quota-ext: watchdog enforce %s, slack %s, grace %ss, poll every %ss",
            enforcement.enforce, enforcement.slack, enforcement.grace, enforcement.poll_interval,
        )

    async def _start_jupyter_server_extension(self, serverapp):
        # The loop runs now: the monitor's task can start.
        service = self.settings.get(SETTINGS_KEY)
        if service is not None and service.monitor is not None:
            service.monitor.start()

    async def stop_extension(self):
        service = self.settings.get(SETTINGS_KEY)
        if service is not None and service.monitor is not None:
            await service.monitor.stop()
        if service is not None:
            await service.hard_cap.stop(self.serverapp.kernel_manager)
            getattr(service.ledger, "close", lambda: None)()  # a RemoteLedger's lease renewals end

    def initialize_handlers(self):
        self.handlers.extend(HANDLERS)

    def _log_through_the_server(self) -> None:
        # The package's module loggers ("gpu_quota_ext", "gpu_quota_ext.*") write through the server's
        # log: its format and timestamps, its level (--debug). Without a parent of the server's they
        # would reach Python's last-resort handler: bare stderr lines, and no INFO at all.
        # jupyter_server hooks tornado's loggers up the same way.
        if self.serverapp is None:
            return
        package_log = logging.getLogger(__package__)
        package_log.parent = self.serverapp.log
        package_log.setLevel(logging.NOTSET)  # the server's level; also clears logging's level cache

    def _api_url(self):
        app = self.serverapp
        if app is None or getattr(app, "sock", ""):
            return None  # a Unix socket: urllib cannot reach it (%gpucap says so)
        return kernel_api_url(app.ip, app.port, app.base_url, bool(app.certfile))

    def _stop_server(self, message: str) -> None:
        # SystemExit is the one exception jupyter_server does not swallow while loading extensions;
        # Python prints its message, one line, on stderr and exits with status 1.
        raise SystemExit(invalid_configuration(message))
