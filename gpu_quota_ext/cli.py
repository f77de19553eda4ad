"""`jupyter gpu-quota`: the extension's settings from the command line, without starting a server.

    jupyter gpu-quota --help-all          every setting, with its help and the value it has here
    jupyter gpu-quota --generate-config   a commented `c.GpuQuota` section for jupyter_server_config.py
    jupyter gpu-quota check [--config=FILE] [--GpuQuota.NAME=VALUE ...]
                                          load the configuration as the server would and validate it:
                                          the effective policy, the watchdog, parking, the hard limit,
                                          the ledger and the GPUs seen (or why none); a name that is not
                                          a setting (c.GpuQuota.default_caps) is refused, with the
                                          closest one that is

The settings are the rows of gpu_quota_ext.settings and the GpuQuota traits made from them: nothing here
writes a setting, its help or its default a second time. `check` loads config files, the command line and the
environment through jupyter_server's own loading and builds what the server's start builds with the
extension's own code (GpuQuota.start_parts: the settings, the GPUs, the ledger, the hard-limit layer,
started and stopped again), so whatever would stop the server ends `check` with the very line the server
would print, and exit status 1.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Dict, List, Sequence, Tuple

from jupyter_core.application import JupyterApp
from traitlets import TraitError
from traitlets.utils.text import wrap_paragraphs

from . import __version__
from .app import GpuQuota, StartParts, invalid_configuration
from .devices import StaticInventory
from .hard_limit import HardLimitLayer
from .parking import ParkSettings
from .policy import Policy
from .settings import DEFAULTS, POLICY, SETTINGS, names_of, server_setting_names
from .shared.env_vars import KERNEL_SIDE, SERVICE_CAPS, SERVICE_URL
from .shared.sizes import format_bytes
from .shared.spelling import unknown_settings, unknown_variables
from .usage import WatchdogSettings


def setting_names() -> List[str]:
    return sorted(server_setting_names())  # the host service's limits are its own (jupyter gpu-quota service)


def builtin_defaults() -> Dict[str, object]:
    """Each setting's value with no config and no GPU_QUOTA_* variable: what a fresh install gets."""
    return {name: DEFAULTS[name] for name in server_setting_names()}


def settings_help(current: GpuQuota) -> str:
    """--help-all's settings part: jupyter's own per-trait format, the value here and now included."""
    lines = [
        "GpuQuota settings",
        "-----------------",
        "In jupyter_server_config.py as c.GpuQuota.NAME = VALUE, on the server's command line as",
        "--GpuQuota.NAME=VALUE; a setting that names an environment variable reads it when neither sets it.",
        "",
    ]
    traits = GpuQuota.class_traits()
    for name in setting_names():
        try:
            getattr(current, name)
        except TraitError as error:  # a bad environment variable: say so where its value would be
            lines.append(GpuQuota.class_get_trait_help(traits[name]) + f"\n    Current: invalid ({error})")
            continue
        lines.append(GpuQuota.class_get_trait_help(traits[name], current))
    lines += ["", StaticInventory.class_get_help()]
    return "\n".join(lines)


def generate_config() -> str:
    """Every setting, commented out at its built-in default, with its help: paste into jupyter_server_config.py."""
    defaults = builtin_defaults()
    traits = GpuQuota.class_traits()
    lines = [
        "# gpu-quota-ext: every setting of the server extension, at its built-in default.",
        "# Put these lines in jupyter_server_config.py (in `jupyter --config-dir`, or pass the file with",
        "# --config=FILE) and remove the '#' in front of the settings you change.",
        "# `jupyter gpu-quota check` validates the result without starting a server.",
        "",
        "c = get_config()  # noqa: F821",
        "",
    ]
    for name in setting_names():
        for paragraph in wrap_paragraphs(traits[name].help, 96):
            lines += [f"## {line}" for line in paragraph.splitlines()]
        lines.append(f"# c.GpuQuota.{name} = {defaults[name]!r}")
        lines.append("")
    devices = StaticInventory.class_traits()["devices"]
    lines += [f"## {line}" for paragraph in wrap_paragraphs(devices.help, 96) for line in paragraph.splitlines()]
    lines.append('# c.StaticInventory.devices = [{"name": "Demo GPU", "total": "80GiB"}]')
    return "\n".join(lines) + "\n"


# --- check ---------------------------------------------------------------------------------------------

NO_GPU_HINTS = {
    "LibraryNotFound": "the NVIDIA driver's NVML library (libnvidia-ml.so) is not on this machine: no driver",
    "DriverNotLoaded": "the NVIDIA driver is installed but not loaded (its kernel module is not running)",
    "NoPermission": "this user may not open the GPU devices",
    "not installed": "pip install nvidia-ml-py in the server's environment",
}


def load_like_the_server(argv: List[str]):
    """(server, extension): config files, command line and environment, loaded by jupyter_server's own
    code the way `jupyter server` does before it starts, and linked into a GpuQuota that is never started."""
    from jupyter_server.serverapp import ServerApp

    server = ServerApp()
    # JupyterApp's part of ServerApp.initialize: the command line, then the config files under it. The
    # rest of ServerApp.initialize (ports, web app, kernels) is what this command must not do.
    JupyterApp.initialize(server, argv)
    server.find_server_extensions()  # jpserver_extensions from jupyter_server_config.d/, as the server does
    extension = GpuQuota()
    extension.log_level = logging.ERROR  # the report below says what its warnings would
    extension._link_jupyter_server_extension(server)  # a bad trait type exits here, with the server's line
    return server, extension


def unknown_names(config) -> List[str]:
    """A line for each name, in a config file or on the command line, under a section the extension reads
    (c.GpuQuota, c.StaticInventory) that no setting of it has, with the closest name that is one."""
    lines = GpuQuota.unknown_settings(config)
    section = config["StaticInventory"] if "StaticInventory" in config else {}
    lines += unknown_settings("StaticInventory", section, StaticInventory.class_trait_names(config=True))
    return lines


def setting_source(extension: GpuQuota, name: str) -> str:
    variable = extension.environment_source(name)
    if variable:
        return f"from ${variable}"
    if f"GpuQuota.{name}" in extension.config:
        return "from config"
    return "default"


def check_report(argv: List[str]) -> str:
    """What `jupyter gpu-quota check` prints; SystemExit with the server's one line for a bad config."""
    server, extension = load_like_the_server(argv)
    if server.config_file and not os.path.isfile(server.config_file):
        # The server skips a missing --config file without a word; a check should not.
        raise SystemExit(f"gpu-quota-ext: --config={server.config_file}: no such file (a server would ignore it)")
    unknown = unknown_names(extension.config)
    if unknown:
        # The server only warns (and runs on the defaults the admin meant to change): the check refuses.
        raise SystemExit(invalid_configuration("; ".join(unknown)))
    package_log = logging.getLogger("gpu_quota_ext")
    level = package_log.level
    package_log.setLevel(logging.ERROR)  # what the parts would log, the report below says
    try:
        parts = extension.start_parts(server.runtime_dir)
    finally:
        package_log.setLevel(level)
    try:
        return _report(server, extension, parts, environment_notes(os.environ))
    finally:
        parts.close()


def environment_notes(environ) -> List[str]:
    """A GPU_QUOTA_* variable that nothing reads and that looks like a setting's variable: said, not refused
    (the environment is not only ours to judge: the check still passes)."""
    settings_variables = [row.env for row in SETTINGS.values() if row.env]
    known = [*settings_variables, *KERNEL_SIDE, SERVICE_URL, SERVICE_CAPS]
    return unknown_variables(environ, "GPU_QUOTA_", known, settings_variables)


def _report(server, extension: GpuQuota, parts: StartParts, notes: Sequence[str] = ()) -> str:
    def row(name: str, shown: object) -> str:
        return f"  {name:<21} {shown!s:<12} ({setting_source(extension, name)})"

    lines = _files_read(server, extension)
    for title, settings in (
        ("policy", _policy_shown(parts.policy)),
        ("watchdog", _watchdog_shown(parts.enforcement)),
        ("parking", _parking_shown(parts.parking)),
        ("hard limit", _hard_limit_shown(parts.hard_layer)),
    ):
        lines.append(f"{title}:")
        lines += [row(name, shown) for name, shown in settings]
    lines.append(_hard_limit_state(parts.hard_layer))
    ledger = parts.ledger.decided_by()
    lines.append(
        f"ledger: {ledger}: it decides every cap and admission; the policy above is not used"
        if ledger
        else "ledger: this server's own (the policy above)"
    )
    lines += _devices_seen(parts)
    lines += [f"environment: {note}" for note in notes]
    lines.append("configuration valid")
    return "\n".join(lines)


def _files_read(server, extension: GpuQuota) -> List[str]:
    """The configuration files read, and whether they enable the extension."""
    files = list(dict.fromkeys(list(server.loaded_config_files) + list(extension.loaded_config_files)))
    lines = ["configuration files read (later ones win):"]
    lines += [f"  {path}" for path in files] or ["  none (built-in defaults and the environment only)"]
    enabled = server.jpserver_extensions.get("gpu_quota_ext")
    lines.append(
        "server extension: enabled"
        if enabled
        else "server extension: NOT enabled in this configuration: a server started with it gives kernels no cap "
        "(jupyter server extension enable gpu_quota_ext)"
    )
    return lines


# Each part's settings as the report shows them: (setting, its value in words), in the report's order.


def _policy_shown(policy: Policy) -> List[Tuple[str, object]]:
    described = policy.describe()
    shown: List[Tuple[str, object]] = [(name, described[name]) for name in names_of(POLICY) if name != "caps"]
    rules = described["rules"]
    return shown + [("caps", "a callable" if rules == "callable" else f"{rules} rule(s)")]


def _watchdog_shown(enforcement: WatchdogSettings) -> List[Tuple[str, object]]:
    return [
        (name, f"{shown} s" if name in ("grace", "poll_interval") else shown)
        for name, shown in enforcement.describe().items()
    ]


def _parking_shown(parking: ParkSettings) -> List[Tuple[str, object]]:
    idle, limit = parking.idle_after, parking.wait_limit
    return [
        ("park_idle_after", "off (on demand only)" if idle is None else f"{idle:g} s"),
        ("park_host_margin", format_bytes(parking.host_margin)),
        ("park_min_idle", f"{parking.min_idle:g} s"),
        ("park_wait_limit", "off (waits without a limit)" if limit is None else f"{limit:g} s"),
        ("park_device_margin", format_bytes(parking.device_margin)),
        ("park_on_device_full", parking.on_device_full),
        ("park_call_timeout", f"{parking.call_timeout:g} s"),
    ]


def _hard_limit_shown(layer: HardLimitLayer) -> List[Tuple[str, object]]:
    settings = layer.settings
    return [
        ("hard_cap", settings.mode),
        ("mps_daemon", settings.daemon),
        ("hard_limit", settings.limit),
        ("mps_context_allowance", format_bytes(settings.context_allowance)),
        ("mps_control", layer.binary or settings.control),
        ("mps_timeout", f"{settings.timeout:g} s"),
    ]


def _hard_limit_state(layer: HardLimitLayer) -> str:
    if layer.state == "on":
        return f"  on: NVIDIA MPS ({layer.settings.daemon} daemon) answered; each kernel gets a hard limit"
    if layer.state == "unavailable":
        return f"  soft caps only: {layer.problem}"
    return "  off: soft caps only (in-process caps and the watchdog)"


def _devices_seen(parts: StartParts) -> List[str]:
    """Each GPU with the caps and budget a kernel gets there; or why there is none, with a hint where one helps."""
    policy, devices, problem = parts.policy, parts.devices, parts.inventory.problem
    lines = [f"devices ({type(parts.inventory).__name__}):"]
    if devices:
        for device in devices:
            budget = (
                format_bytes(int(device.total * policy.overcommit)) if policy.overcommit else ("no admission control")
            )
            lines.append(
                f"  {device.index}: {device.name}, {format_bytes(device.total)} ({device.uuid}): a kernel's cap "
                f"{format_bytes(policy.default_cap.to_bytes(device.total))}, up to "
                f"{format_bytes(policy.max_cap.to_bytes(device.total))} on request; budget {budget}"
            )
    else:
        lines.append(f"  {problem or 'no GPU'}")
        hints = [hint for key, hint in NO_GPU_HINTS.items() if key in (problem or "")]
        lines += [f"  ({hint})" for hint in hints]
        lines.append("  a server with this configuration starts every kernel without a GPU cap (%gpucap says why)")
    return lines


class GpuQuotaCheck(JupyterApp):
    name = "jupyter-gpu-quota-check"
    version = __version__
    description = """Load the configuration the way `jupyter server` and `jupyter lab` do (jupyter_server_config.py
    and .json on the Jupyter config path, jupyter_server_config.d/, the GPU_QUOTA_* environment variables,
    and --config=FILE or --GpuQuota.NAME=VALUE given here), validate it with the server's own code, and
    print the effective policy, the watchdog's settings and the GPUs the extension sees, or why it sees
    none. Starts no server and no kernel. A bad configuration prints the one line the server would and
    exits with status 1."""
    examples = """
    jupyter gpu-quota check
    jupyter gpu-quota check --config=binder/jupyter_server_config.py
    GPU_QUOTA_DEFAULT_CAP=0.1 jupyter gpu-quota check --GpuQuota.max_cap=0.5
    """

    server_argv: List[str] = []

    def initialize(self, argv=None):
        argv = list(sys.argv[1:] if argv is None else argv)
        if {"-h", "--help", "--help-all", "--version"} & set(argv):
            super().initialize(argv)  # prints this command's help (or version) and exits; the server's would not
        self.server_argv = argv

    def start(self):
        print(check_report(self.server_argv))


class GpuQuotaCommand(JupyterApp):
    name = "jupyter-gpu-quota"
    version = __version__  # --version prints it; traitlets' Application says "0.0" otherwise
    description = """gpu-quota-ext's settings without a server: --help-all lists every setting (c.GpuQuota.NAME)
    with its help; --generate-config prints a commented configuration; `check` validates the configuration
    the server would load and shows the GPUs it sees."""
    examples = """
    jupyter gpu-quota --help-all
    jupyter gpu-quota --generate-config > gpu_quota_config.py
    jupyter gpu-quota check --config=gpu_quota_config.py
    """
    subcommands = {
        "check": (
            GpuQuotaCheck,
            "Validate the configuration the server would load; show the policy and the GPUs it sees.",
        ),
        "service": (
            "gpu_quota_ext.hub.service.app.GpuQuotaService",
            "Run the host's quota service (a JupyterHub service): one GPU budget for every user of the host.",
        ),
    }

    def emit_help(self, classes: bool = False):
        yield from self.emit_description()
        yield from self.emit_subcommands_help()
        yield from self.emit_options_help()
        if classes:
            yield settings_help(GpuQuota())
            yield ""
        yield from self.emit_examples()
        yield from self.emit_help_epilogue(classes)

    def write_default_config(self):
        sys.stdout.write(generate_config())

    def start(self):
        super().start()  # a subcommand or --generate-config; they end with NoStart
        self.print_help()


main = launch_new_instance = GpuQuotaCommand.launch_instance

if __name__ == "__main__":
    main()
