"""The server extension: configuration traits and wiring, nothing else.

Every setting can come from an environment variable (what JupyterHub spawners set per user); config
files and the command line override it. Invalid values stop the server at start with one line naming
the setting and the value: a quota extension that failed to load would let kernels start uncapped.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional, Sequence, Tuple, cast

from jupyter_client.provisioning.factory import KernelProvisionerFactory
from jupyter_server.extension.application import ExtensionApp
from traitlets import TraitError, TraitType
from traitlets.config import Config

from .devices import Device, DeviceInventory
from .handlers import HANDLERS
from .hard_limit import (
    HardLimitLayer,
    HardLimitSettings,
    HardLimitUnavailable,
    build_hard_limit_settings,
)
from .ledger import Ledger, LocalLedger, RemoteLedger
from .manager import SETTINGS_KEY, GpuQuotaManager
from .parking import ParkSettings, build_park_settings, on_device_full_for, park_event_logger
from .policy import Policy, build_policy
from .settings import (
    HARD_CAP,
    PARK,
    POLICY,
    SETTINGS,
    WATCHDOG,
    SettingError,
    names_of,
    server_setting_names,
)
from .settings_traits import SettingTrait, setting_trait
from .shared.env_vars import SERVICE_URL as SERVICE_URL_ENV
from .shared.sizes import PolicyError
from .shared.spelling import is_section_key, unknown_settings
from .usage import (
    KernelManagerView,
    WatchdogSettings,
    build_watchdog_settings,
    untrack_kernel_requests,
)

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp

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


def _make_ledger(devices: Sequence[Device], policy: Policy) -> Ledger:
    """The ledger this server's grants go through: the host's quota service when the hub names one
    ($GPU_QUOTA_SERVICE_URL, an environment the hub sets, never a c.GpuQuota setting), else this server's own.
    PolicyError when the hub's variables cannot be used (no token, not a URL)."""
    remote = RemoteLedger.from_environment(devices)
    if remote is None:
        return LocalLedger(devices, policy)
    logging.getLogger("gpu_quota_ext").info(
        "gpu-quota-ext: the host's GPU quota service at %s is in charge (%s): it decides every cap and admission; "
        "this server's c.GpuQuota default_cap, max_cap, caps, overcommit, placement and on_full are ignored",
        remote.url, SERVICE_URL_ENV,
    )
    return remote


def invalid_configuration(message: str) -> str:
    """The one line a bad setting gives, the same from the server and from `jupyter gpu-quota check`."""
    return f"gpu-quota-ext: invalid configuration: {message}"


@dataclass
class StartParts:
    """What the server builds from its configuration before it serves, each part validated (GpuQuota.start_parts)."""

    policy: Policy
    enforcement: WatchdogSettings
    parking: ParkSettings
    inventory: DeviceInventory
    devices: Sequence[Device]
    ledger: Ledger
    hard_layer: HardLimitLayer

    def close(self) -> None:
        """Undo what building them started (`jupyter gpu-quota check`): the hard layer's daemon, the ledger."""
        self.hard_layer.stop_sync()
        self.ledger.close()


class GpuQuota(ExtensionApp):
    """GPU memory caps for every kernel of this server (config section `c.GpuQuota`)."""

    name = "gpu_quota_ext"
    load_other_extensions = True

    # Every setting's trait, from its row in settings.SETTINGS (type, default, environment variable, help).
    default_cap = setting_trait("default_cap")
    max_cap = setting_trait("max_cap")
    caps = setting_trait("caps")
    overcommit = setting_trait("overcommit")
    placement = setting_trait("placement")
    on_full = setting_trait("on_full")
    on_over_max = setting_trait("on_over_max")
    enforce = setting_trait("enforce")
    slack = setting_trait("slack")
    grace = setting_trait("grace")
    poll_interval = setting_trait("poll_interval")
    hard_cap = setting_trait("hard_cap")
    mps_daemon = setting_trait("mps_daemon")
    hard_limit = setting_trait("hard_limit")
    mps_context_allowance = setting_trait("mps_context_allowance")
    mps_control = setting_trait("mps_control")
    mps_timeout = setting_trait("mps_timeout")
    inventory_class = setting_trait("inventory_class")
    nvml_class = setting_trait("nvml_class")
    park_idle_after = setting_trait("park_idle_after")
    park_host_margin = setting_trait("park_host_margin")
    park_min_idle = setting_trait("park_min_idle")
    park_wait_limit = setting_trait("park_wait_limit")
    park_device_margin = setting_trait("park_device_margin")
    park_on_device_full = setting_trait("park_on_device_full")
    park_call_timeout = setting_trait("park_call_timeout")
    fast_park = setting_trait("fast_park")
    checkpoint_class = setting_trait("checkpoint_class")

    @classmethod
    def unknown_settings(cls, config: Config) -> list:
        """One line per name under c.GpuQuota that is not a setting, with the closest one that is: what
        `jupyter gpu-quota check` refuses and the server warns of (traitlets keeps such a name as config that
        nobody reads, and the server runs on the default the admin meant to change)."""
        section = config[cls.__name__] if cls.__name__ in config else {}
        return unknown_settings(cls.__name__, section, cls.class_trait_names(config=True))

    def _load_config(
        self,
        cfg: Config,
        section_names: Optional[list[str]] = None,
        traits: Optional[dict[str, TraitType]] = None,
    ) -> None:
        # traitlets warns of an unknown name at every load of the config (twice in a server's start), in
        # words that guess between unrelated traits; the names go to it without them, and we say it once.
        lines = self.unknown_settings(cfg)
        if lines:
            told = self.__dict__.setdefault("_told_unknown", set())
            for line in lines:
                if line not in told:
                    told.add(line)
                    self.log.warning("gpu-quota-ext: ignored: %s (jupyter gpu-quota check refuses it)", line)
            known, name = self.class_trait_names(config=True), type(self).__name__
            cfg = copy.copy(cfg)  # the section replaced below, not changed: self.config keeps what was given
            cfg[name] = Config({key: value for key, value in cfg[name].items() if key in known or is_section_key(key)})
        super()._load_config(cfg, section_names=section_names, traits=traits)

    def _link_jupyter_server_extension(self, serverapp: ServerApp) -> None:
        try:
            super()._link_jupyter_server_extension(serverapp)
            # Every value read now, while a TraitError still stops the server: the extension's
            # initialize() reads them all before initialize_settings, where an error would only
            # fail the extension's loading, and the server would run without caps.
            self._setting_values()
        except TraitError as error:
            self._stop_server(str(error))

    def _from_env(self, name: str) -> object:
        """A setting's default: its environment variable when set, read as the command line reads a value;
        else the built-in default. An invalid variable is refused in one line that names it."""
        row = SETTINGS[name]
        if row.env is None or row.env not in os.environ:
            return copy.deepcopy(row.default)
        text = os.environ[row.env]
        trait = cast(SettingTrait, self.traits()[name])  # every setting's trait is made by setting_trait
        try:
            return trait.validate(self, trait.from_string(text))
        except (TraitError, ValueError):
            raise TraitError(str(SettingError(name, text, row.must, row.env))) from None

    def environment_source(self, name: str) -> Optional[str]:
        """The environment variable a setting's value came from; None when config, the command line or
        the built-in default gave it."""
        variable = SETTINGS[name].env
        if not variable or variable not in os.environ or f"GpuQuota.{name}" in self.config:
            return None
        return variable if getattr(self, name) == self._from_env(name) else None

    def _setting_values(self) -> dict:
        """Every setting's value; a bad type, choice or range (config or environment): a TraitError, one line."""
        return {name: getattr(self, name) for name in server_setting_names()}

    def validated_settings(self) -> Tuple[Policy, WatchdogSettings, HardLimitSettings]:
        """The policy, the watchdog's and the hard limit's settings, validated. The server's start and
        `jupyter gpu-quota check` both come here: a SettingError (a PolicyError) or a TraitError names the
        first bad setting, and its environment variable when the value came from there."""
        values = self._setting_values()

        def part(name: str) -> dict:
            return {setting: values[setting] for setting in names_of(name)}

        try:
            return (
                build_policy(**part(POLICY)),
                build_watchdog_settings(**part(WATCHDOG)),
                build_hard_limit_settings(**part(HARD_CAP)),
            )
        except SettingError as error:
            raise self._named_with_its_variable(error) from None

    def park_settings(self) -> ParkSettings:
        """The park settings (the table's PARK rows), validated like the parts above."""
        try:
            return build_park_settings(**{name: getattr(self, name) for name in names_of(PARK)})
        except SettingError as error:
            raise self._named_with_its_variable(error) from None

    def _named_with_its_variable(self, error: SettingError) -> SettingError:
        """The refusal said of the environment variable's text when the value came from there."""
        variable = self.environment_source(error.name)
        return error if variable is None else error.from_environment(variable, os.environ[variable])

    def start_parts(self, runtime_dir: Optional[str] = None) -> StartParts:
        """Everything the server's start builds from its configuration, in the server's order: the settings,
        the GPUs, the ledger (the host service's when the hub names one), the hard-limit layer, started (a
        managed MPS daemon runs from here on: StartParts.close stops it). The server's start and `jupyter
        gpu-quota check` both come here: whatever would stop the server raises SystemExit with its one line."""
        try:
            policy, enforcement, hard_cap = self.validated_settings()
            parking = self.park_settings()
            parking = replace(parking, on_device_full=on_device_full_for(parking.on_device_full, policy.overcommit))
            inventory = self.inventory_class(parent=self)
            devices = inventory.list_devices()
            ledger = _make_ledger(devices, policy)
        except (PolicyError, TraitError) as error:
            self._stop_server(str(error))
        hard_layer = HardLimitLayer(hard_cap, runtime_dir)
        try:
            hard_layer.start(policy, devices)
        except HardLimitUnavailable as error:
            ledger.close()
            self._stop_server(f"c.GpuQuota.hard_cap = 'mps' needs a usable NVIDIA MPS control daemon: {error}")
        return StartParts(policy, enforcement, parking, inventory, devices, ledger, hard_layer)

    def initialize_settings(self) -> None:
        serverapp = self.serverapp
        if serverapp is None:  # jupyter_server links its app to the extension before it initializes the settings
            raise RuntimeError("gpu-quota-ext: the extension's settings are initialized without a server")
        self._log_through_the_server()
        parts = self.start_parts(serverapp.runtime_dir)
        policy, enforcement = parts.policy, parts.enforcement
        kernels = KernelManagerView(serverapp.kernel_manager)
        # The parker's requests on a kernel's control channel are not the user's activity.
        untrack_kernel_requests(serverapp.kernel_manager)
        manager = GpuQuotaManager(
            policy,
            parts.devices,
            parts.ledger,
            kernels,
            self.nvml_class(),
            watchdog_settings=enforcement,
            hard_cap=parts.hard_layer,
            api_url=self._api_url,
            no_gpu_reason=parts.inventory.problem,
            park_settings=parts.parking,
            checkpoint=self.checkpoint_class(),
        )
        self.settings[SETTINGS_KEY] = manager
        manager.parker.send_events(park_event_logger(self.serverapp))  # parking/events.py
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # the usual case: the loop starts later and _start_jupyter_server_extension starts the manager
        else:
            # Embedders that initialize on a running loop (pytest-jupyter) never call that hook.
            manager.start()
        # Every kernelspec without a provisioner stanza of its own now starts through our hook.
        KernelProvisionerFactory.instance().default_provisioner_name = PROVISIONER_NAME
        self.log.info(
            "gpu-quota-ext: default_cap %s, max_cap %s, placement %s, on_full %s, overcommit %s, %d GPU(s)",
            policy.default_cap,
            policy.max_cap,
            policy.placement,
            policy.on_full,
            policy.overcommit,
            len(parts.devices),
        )
        self.log.info(
            "gpu-quota-ext: watchdog enforce %s, slack %s, grace %ss, poll every %ss",
            enforcement.enforce,
            enforcement.slack,
            enforcement.grace,
            enforcement.poll_interval,
        )

    async def _start_jupyter_server_extension(self, serverapp: ServerApp) -> None:
        # The loop runs now: the monitor's and the lifecycle's tasks can start.
        manager = self.settings.get(SETTINGS_KEY)
        if manager is not None:
            manager.start()

    async def stop_extension(self) -> None:
        manager = self.settings.get(SETTINGS_KEY)
        if manager is not None:
            await manager.close()

    def initialize_handlers(self) -> None:
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

    def _api_url(self) -> Optional[str]:
        app = self.serverapp
        if app is None or app.sock:
            return None  # a Unix socket: urllib cannot reach it (%gpucap says so)
        return kernel_api_url(app.ip, app.port, app.base_url, bool(app.certfile))

    def _stop_server(self, message: str) -> None:
        # SystemExit is the one exception jupyter_server does not swallow while loading extensions;
        # Python prints its message, one line, on stderr and exits with status 1.
        raise SystemExit(invalid_configuration(message))
