"""The extension's settings, one row each: name, environment variable, default, help, kind and how its
value is read.

Everything that needs a setting's name, variable, default or parsing reads it here, so none is written twice:
the GpuQuota traits (app.py, made by settings_traits.py), the builders of the policy, the watchdog's, the hard
limit's and the park settings (`validated`, called by policy.py, usage/, hard_limit/, parking/) and their
dataclasses' defaults, the hub's per-user environment (hub/caps.py) and `jupyter gpu-quota` (cli.py). Pure: no
I/O, standard library only.

To add a setting: a row in SETTINGS (its `part` says which validated object takes it, `attribute` under which
name when not its own, `parser` how its value is read when its kind does not say), a line `name =
setting_trait("name")` in GpuQuota (app.py), the docs' reference follows from the row;
tests/unit/test_settings.py checks that all of these agree. A row of the HOST part is the host service's
instead: a trait of GpuQuotaService (hub/service/app.py) and a key of the hub's mapping.

The host service's own settings (c.GpuQuotaService) are a second table of the same rows, SERVICE_SETTINGS: a
trait each (settings_traits.service_trait builds it from the row, as setting_trait does the server's), none
read from the environment; where the service takes a server setting (the policy's, the broker's, the HOST
rows) its row is the server's, with the service's help. To add one: a row there and a line `name =
service_trait("name")` in GpuQuotaService; tests/unit/test_host_service_settings.py checks that they agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, TypeVar

from .shared.durations import parse_duration
from .shared.service_contract import LEASE_RENEW, LEASE_SECONDS
from .shared.sizes import CapSpec, GiB, PolicyError, format_bytes, parse_cap, shown

# Kinds: what values a setting takes (the trait that holds it, settings_traits.py) and what it must be.
CAP = "cap"  # a fraction, a percentage, a size or bytes: a string or a number
SIZE = "size"  # a size or bytes, never a fraction
SLACK = "slack"  # a size, or a fraction of the kernel's cap
CHOICE = "choice"  # one of `choices`, case-insensitive
SECONDS = "seconds"  # a number from `low` to `high`
FACTOR = "factor"  # a number above `low` up to `high`, or None
TEXT = "text"
RULES = "rules"  # a list of rule dicts, or a callable
CLASS = "class"  # a subclass of `klass`, or its import path
COUNT = "count"  # a whole number from `low` to `high`
# Kinds only the host service's table uses.
FLAG = "flag"  # True or False
MAPPING = "mapping"  # a dict (the hub's mapping: users, groups, default)
RATE = "rate"  # calls a second; 0: no limit

# Parts: which validated object a setting belongs to (its builder takes the setting as an argument, `validated`).
POLICY = "policy"  # policy.build_policy -> Policy
WATCHDOG = "watchdog"  # usage.build_watchdog_settings -> WatchdogSettings
HARD_CAP = "hard_cap"  # hard_limit.build_hard_limit_settings -> HardLimitSettings
PARK = "park"  # parking.build_park_settings -> ParkSettings
PLUGINS = "plugins"  # the classes the extension instantiates
# The host service's limits on each user (hub/service/user_policy.py). The hub's mapping sets them per user
# and group; no user's server reads them (they never reach its environment) and c.GpuQuota has no trait for them.
HOST = "host"
SERVICE = "service"  # the host service's own settings (SERVICE_SETTINGS): c.GpuQuotaService, not a user's server


@dataclass(frozen=True)
class Setting:
    """One row of the table."""

    name: str
    kind: str
    part: str
    default: Any  # as a config file would write it; None (SECONDS, FACTOR, TEXT): the setting may be None
    help: str  # what it does; the variable and the default are added from the row (settings_traits.py)
    env: Optional[str] = None  # the environment variable it is read from when config does not set it
    choices: Tuple[str, ...] = ()  # CHOICE
    low: Optional[float] = None  # SECONDS, FACTOR
    high: Optional[float] = None
    klass: Optional[str] = None  # CLASS: the base class's import path
    per_user: bool = False  # the hub's mapping may set it per user and group (hub/caps.py)
    attribute: Optional[str] = None  # the validated object's attribute that holds it; None: the setting's name
    parser: Optional[Callable[[Any], Any]] = None  # how its value is read, where its kind alone does not say
    nullable: bool = False  # None is a value too, though not the default (the host service's overcommit)

    def parse(self, value: Any) -> Any:
        """The value as its part holds it (choices and ranges from the row); PolicyError says why not."""
        if self.parser is not None:
            return self.parser(value)
        return _KIND_PARSERS[self.kind](self, value)

    @property
    def must(self) -> str:
        """What a valid value is: the end of the one line that refuses another."""
        if self.kind == CHOICE:
            return f"must be one of {', '.join(repr(choice) for choice in self.choices)}"
        if self.kind == SECONDS:
            off = " or None (off)" if self.default is None else ""
            return f"must be a number of seconds from {self.low:g} to {self.high:g}{off}"
        if self.kind == FACTOR:
            return f"must be a positive number up to {self.high:g} (1.0 = never grant more than the device) or None"
        if self.kind == CLASS:
            return f"must be a subclass of {self.klass} (the class or its import path)"
        if self.kind == COUNT and self.low is not None and self.high is not None:
            return f"must be a whole number from {self.low:g} to {self.high:g}"
        return {
            COUNT: "must be a whole number",
            FLAG: "must be True or False",
            MAPPING: "must be a dict",
            RATE: "must be a number of calls a second (0: no limit)",
            CAP: "must be a fraction like '0.25', a percentage like '25%', a size like '12GiB', or bytes",
            SIZE: "must be a size like '640MiB', bytes, or 0",
            SLACK: "must be a size like '1GiB', bytes, or a fraction of the kernel's cap like '10%'",
            TEXT: "must be a string",
            RULES: "must be a list of rules or a callable",
        }[self.kind]


# --- reading a value, by kind ------------------------------------------------------------------------


def _number(value: Any, must: str) -> float:
    if isinstance(value, bool):
        raise PolicyError(must)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PolicyError(must) from None
    if not math.isfinite(number):
        raise PolicyError(must)
    return number


def _bounds(row: Setting) -> Tuple[float, float]:
    assert row.low is not None and row.high is not None, row.name  # a SECONDS or FACTOR row has both
    return row.low, row.high


def _choice(row: Setting, value: Any) -> str:
    if not isinstance(value, str) or value.strip().lower() not in row.choices:
        raise PolicyError(row.must)
    return value.strip().lower()


def _seconds(row: Setting, value: Any) -> Optional[float]:
    if value is None and row.default is None:
        return None
    low, high = _bounds(row)
    seconds = _number(value, row.must)
    if not low <= seconds <= high:
        raise PolicyError(row.must)
    return seconds


def _factor(row: Setting, value: Any) -> Optional[float]:
    """None / "" / "none": off (overcommit: no admission control); else above `low`, at most `high`."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    low, high = _bounds(row)
    factor = _number(value, row.must)
    if factor <= low or factor > high:
        raise PolicyError(row.must)
    return factor


def parse_slack(value: Any) -> CapSpec:
    """Slack over the cap: bytes ("1GiB", 1073741824), a fraction of the kernel's cap ("0.1", "10%") or 0."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return CapSpec(nbytes=0, text="0")
    if isinstance(value, str) and value.strip() in ("0", "0B", "0b", "0%"):
        return CapSpec(nbytes=0, text=value.strip())
    return parse_cap(value)


def _size(row: Setting, value: Any) -> int:
    """Bytes from a size or 0; never a fraction (of what? these sizes do not grow with the device)."""
    nbytes = 0 if str(value).strip() in ("0", "0B") else parse_cap(value).nbytes
    if nbytes is None:
        raise PolicyError(f"must be a size like {row.default} (not a fraction)")
    return nbytes


def _rules(row: Setting, value: Any) -> Any:
    """A callable as it is, a list of rules as a tuple (policy.py reads each rule)."""
    if callable(value):
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise PolicyError(row.must)
    return tuple(value)


def _text(row: Setting, value: Any) -> Optional[str]:
    if value is None and row.default is None:
        return None
    if not isinstance(value, str):
        raise PolicyError(row.must)
    return value


def _count(row: Setting, value: Any) -> int:
    low, high = _bounds(row)
    number = _number(value, row.must)
    if number != int(number) or not low <= number <= high:
        raise PolicyError(row.must)
    return int(number)


def parse_user_budget(value: Any) -> Optional[CapSpec]:
    """The most one user's grants may add up to on a device: a cap's forms, or "none" (the device's budget only)."""
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    return parse_cap(value)


def _as_given(row: Setting, value: Any) -> Any:
    return value  # CLASS: the trait (traitlets' Type) has checked and imported it


def _of_type(*types: type) -> Callable[[Setting, Any], Any]:
    """A value taken as it is when it has one of `types` (the host service's own kinds: its traits check them)."""

    def parse(row: Setting, value: Any) -> Any:
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise PolicyError(row.must)
        return value

    return parse


_KIND_PARSERS: Dict[str, Callable[[Setting, Any], Any]] = {
    CHOICE: _choice,
    SECONDS: _seconds,
    FACTOR: _factor,
    CAP: lambda row, value: parse_cap(value),
    SLACK: lambda row, value: parse_slack(value),
    SIZE: _size,
    RULES: _rules,
    TEXT: _text,
    CLASS: _as_given,
    COUNT: _count,
    FLAG: _of_type(bool),
    MAPPING: _of_type(dict),
    RATE: _of_type(int, float),
}


# --- rows whose value means more than their kind says -----------------------------------------------

MAX_CONTEXT_ALLOWANCE = 16 * GiB


def parse_context_allowance(value: Any) -> int:
    """A size ("640MiB", bytes) or 0; never a fraction (the context does not grow with the device)."""
    if isinstance(value, str) and value.strip().lower() in ("0", "0b", "0mib"):
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return 0
    spec = parse_cap(value)
    if spec.nbytes is None:
        raise PolicyError("must be a size like 640MiB (the CUDA context's memory), not a fraction")
    if spec.nbytes > MAX_CONTEXT_ALLOWANCE:
        raise PolicyError(f"must be at most {format_bytes(MAX_CONTEXT_ALLOWANCE)} (a CUDA context takes about 0.5 GiB)")
    return spec.nbytes


def _mps_control_program(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise PolicyError("must be the name or path of nvidia-cuda-mps-control")
    return value.strip()


# --- the table -----------------------------------------------------------------------------------------


def _table(*rows: Setting) -> Dict[str, Setting]:
    return {row.name: row for row in rows}


SETTINGS: Dict[str, Setting] = _table(
    # --- policy: who gets which cap ---------------------------------------------------------------------
    Setting(
        "default_cap",
        CAP,
        POLICY,
        "0.25",
        env="GPU_QUOTA_DEFAULT_CAP",
        per_user=True,
        help="""Cap every kernel gets at start, on each GPU it is given: a fraction of the device
        ("0.25" or 0.25), a percentage ("25%"), a size ("12GiB", "12GB") or bytes.""",
    ),
    Setting(
        "max_cap",
        CAP,
        POLICY,
        "1.0",
        env="GPU_QUOTA_MAX_CAP",
        per_user=True,
        help="""The most a kernel may ask for later with %gpucap or the API, same forms as default_cap
        (the built-in default lets users opt into the whole device).""",
    ),
    Setting(
        "caps",
        RULES,
        POLICY,
        [],
        attribute="rules",
        help="""Rules that give some kernels another cap, first match wins: a list of dicts with keys
        'user' and 'kernelspec' (glob patterns, default '*'), 'cap', and optional 'max_cap' and 'devices'
        (how many GPUs the kernel gets, default 1). Or a callable (user, kernelspec) -> cap, rule dict or None.""",
    ),
    Setting(
        "overcommit",
        FACTOR,
        POLICY,
        None,
        env="GPU_QUOTA_OVERCOMMIT",
        low=0,
        high=1000,
        per_user=True,
        help="""Admission control: each device's budget is its memory x overcommit; a kernel whose cap does
        not fit on any device is handled by on_full. None = no admission control (never blocks a start).""",
    ),
    Setting(
        "placement",
        CHOICE,
        POLICY,
        "spread",
        env="GPU_QUOTA_PLACEMENT",
        choices=("spread", "pack", "none"),
        per_user=True,
        help="""Which GPU a kernel is put on (through CUDA_VISIBLE_DEVICES): "spread" (the least granted),
        "pack" (fill GPU 0 first) or "none" (the kernel sees every GPU, capped on each).""",
    ),
    Setting(
        "on_full",
        CHOICE,
        POLICY,
        "cpu-only",
        env="GPU_QUOTA_ON_FULL",
        choices=("refuse", "cpu-only"),
        per_user=True,
        help="""When no device has budget left: "refuse" (the start fails with HTTP 503 and the reason, through
        POST /api/kernels and JupyterLab's POST /api/sessions alike: JupyterLab's "Error Starting Kernel" dialog
        shows it) or "cpu-only" (the kernel starts with no GPU visible).""",
    ),
    Setting(
        "on_over_max",
        CHOICE,
        POLICY,
        "clamp",
        env="GPU_QUOTA_ON_OVER_MAX",
        choices=("clamp", "refuse"),
        per_user=True,
        help="""A cap request above max_cap or the device's budget: "clamp" (grant the most allowed) or
        "refuse".""",
    ),
    # --- the watchdog --------------------------------------------------------------------------------
    Setting(
        "enforce",
        CHOICE,
        WATCHDOG,
        "warn",
        env="GPU_QUOTA_ENFORCE",
        choices=("off", "warn", "interrupt", "restart", "kill"),
        help="""What the watchdog does to a kernel whose processes use more GPU memory than its cap plus slack
        (measured by NVML, so CuPy, raw CUDA and subprocesses count): "off", "warn" (log it and show it in the
        status API and sidebar), "interrupt", "restart" or "kill" the kernel. The built-in "warn":
        in-process caps already stop the common frameworks cleanly, and a false alarm (a usage spike, a large
        CUDA context) must not cost a user their kernel's state unless the admin chose so.""",
    ),
    Setting(
        "slack",
        SLACK,
        WATCHDOG,
        "1GiB",
        env="GPU_QUOTA_SLACK",
        help="""How far over its cap a kernel may go before the watchdog acts: a size ("1GiB", bytes) or a
        fraction of the kernel's cap ("0.1", "10%"). NVML counts the CUDA context (about 600 MiB per process)
        that no in-process cap counts.""",
    ),
    Setting(
        "grace",
        SECONDS,
        WATCHDOG,
        0,
        env="GPU_QUOTA_GRACE",
        low=0,
        high=3600,
        help="""Seconds a kernel must stay over cap plus slack before the watchdog acts (0: on the first sample
        over it).""",
    ),
    Setting(
        "poll_interval",
        SECONDS,
        WATCHDOG,
        1,
        env="GPU_QUOTA_POLL_INTERVAL",
        low=0.05,
        high=60,
        help="""Seconds between two NVML samples of every GPU (0.05 to 60).""",
    ),
    # --- the hard limit (MPS) ------------------------------------------------------------------------
    Setting(
        "hard_cap",
        CHOICE,
        HARD_CAP,
        "off",
        attribute="mode",
        env="GPU_QUOTA_HARD_CAP",
        choices=("off", "auto", "mps"),
        help="""A hard limit at allocation time through NVIDIA MPS, on top of the soft caps: "off", "auto" (MPS
        when a usable MPS control daemon answers; otherwise soft caps only, and the status says why) or "mps"
        (required: the server refuses to start without a usable daemon).""",
    ),
    Setting(
        "mps_daemon",
        CHOICE,
        HARD_CAP,
        "managed",
        attribute="daemon",
        env="GPU_QUOTA_MPS_DAEMON",
        choices=("managed", "external"),
        help="""Which MPS control daemon kernels use: "managed" (this server starts its own, with pipe and log
        directories under its runtime directory, and stops it at shutdown) or "external" (an admin's, at
        $CUDA_MPS_PIPE_DIRECTORY or /tmp/nvidia-mps).""",
    ),
    Setting(
        "hard_limit",
        CHOICE,
        HARD_CAP,
        "max_cap",
        attribute="limit",
        env="GPU_QUOTA_HARD_LIMIT",
        choices=("max_cap", "cap"),
        help="""Which number a kernel's hard limit is: "max_cap" (%gpucap stays live up to max_cap, nothing ever
        passes it) or "cap" (the cap at kernel start; a raise above it takes effect at the next restart).""",
    ),
    Setting(
        "mps_context_allowance",
        SIZE,
        HARD_CAP,
        "640MiB",
        attribute="context_allowance",
        parser=parse_context_allowance,
        env="GPU_QUOTA_MPS_CONTEXT_ALLOWANCE",
        help="""Added to each hard limit for the CUDA context, which MPS counts against the limit (about 514 MiB
        measured on an H200, docs/measurements.md): a size or 0.""",
    ),
    Setting(
        "mps_control",
        TEXT,
        HARD_CAP,
        "nvidia-cuda-mps-control",
        attribute="control",
        parser=_mps_control_program,
        env="GPU_QUOTA_MPS_CONTROL",
        help="""The MPS control program, a name looked up on PATH and in /usr/local/nvidia/bin, or a path.""",
    ),
    Setting(
        "mps_timeout",
        SECONDS,
        HARD_CAP,
        5,
        attribute="timeout",
        env="GPU_QUOTA_MPS_TIMEOUT",
        low=0.1,
        high=120,
        help="""Seconds one call of the MPS control program may take (it is asked before every kernel start;
        a daemon that does not answer in time gives that kernel soft caps only).""",
    ),
    # --- parking idle kernels ----------------------------------------------------------------------
    Setting(
        "park_idle_after",
        TEXT,
        PARK,
        "off",
        attribute="idle_after",
        parser=parse_duration,
        env="GPU_QUOTA_PARK_IDLE_AFTER",
        help="""Park a kernel that holds GPU memory and has been idle this long (jupyter_server's own view of
        its activity): seconds ("1800") or a duration ("30min", "2h"); "off" never parks by itself (the park
        route and %gpucap park still do).""",
    ),
    Setting(
        "park_host_margin",
        SIZE,
        PARK,
        "2GiB",
        attribute="host_margin",
        env="GPU_QUOTA_PARK_HOST_MARGIN",
        help="""Host memory that must stay available beyond a kernel's GPU bytes for it to park (its GPU state
        goes to its own host memory; the server's memory cgroup counts too): a size or 0.""",
    ),
    Setting(
        "park_min_idle",
        TEXT,
        PARK,
        "60s",
        attribute="min_idle",
        parser=lambda value: parse_duration(value) or 0.0,
        env="GPU_QUOTA_PARK_MIN_IDLE",
        help="""How long a kernel must have been idle before the broker may park it to make room for another
        kernel's resume: seconds or a duration; 0 or "off": any idle kernel. Least recently active first.""",
    ),
    Setting(
        "park_wait_limit",
        TEXT,
        PARK,
        "5min",
        attribute="wait_limit",
        parser=parse_duration,
        env="GPU_QUOTA_PARK_WAIT_LIMIT",
        help="""How long a parked kernel's cell waits for device memory to come back to before it is told
        why and its cell ends (nothing is lost: it stays parked, and the next cell asks again): seconds or
        a duration; "off" waits without a limit.""",
    ),
    Setting(
        "park_device_margin",
        SIZE,
        PARK,
        "1GiB",
        attribute="device_margin",
        env="GPU_QUOTA_PARK_DEVICE_MARGIN",
        help="""Device memory kept free beyond what a restore brings back: a restore runs only when the GPU
        has the kernel's parked bytes plus this margin free and claimed by nobody (a restore that finds the
        device full loses the kernel's GPU state for good).""",
    ),
    Setting(
        "park_on_device_full",
        CHOICE,
        PARK,
        "auto",
        choices=("auto", "on", "off"),
        attribute="on_device_full",
        env="GPU_QUOTA_PARK_ON_DEVICE_FULL",
        help="""When a kernel is short of room below its own cap because idle kernels hold the GPU, "on" makes the
        broker park idle kernels to give it room up to its cap: before a cell runs where the server saw the
        shortage (the cell waits, says why, can be interrupted) and after an out-of-memory error it could not
        see coming (the kernel says so under the failed cell). "off" leaves it to the user. "auto" (the default)
        is "on" where caps can add up to more than a GPU (overcommit above 1, or none) and "off" otherwise.""",
    ),
    Setting(
        "fast_park",
        CHOICE,
        PARK,
        "auto",
        choices=("off", "on", "auto"),
        env="GPU_QUOTA_FAST_PARK",
        help="""Park torch kernels at the link's speed: "on" starts Python kernels with the fast park library
        (LD_PRELOAD; it serves torch's cudaMalloc from CUDA virtual memory) and parks each kernel it fits by
        copying its pages to a pinned host arena; every other kernel parks through the driver's checkpoint
        calls, as with "off". "auto" (the default) is "on" for every Python kernel but those under an MPS hard
        limit (an MPS client is never parked, so the library would only cost it). The status says which path a
        kernel takes and why (docs/admin/fast-park.md).""",
    ),
    Setting(
        "park_call_timeout",
        SECONDS,
        PARK,
        600,
        attribute="call_timeout",
        env="GPU_QUOTA_PARK_CALL_TIMEOUT",
        low=0.1,
        high=86400,
        help="""Seconds one checkpoint driver call (a park or a resume) may take before the kernel's park state
        says the driver has not returned (the server keeps waiting for it: a process the driver holds cannot be
        taken back). The built-in 600 s is ample for a whole GPU's memory to move to host memory.""",
    ),
    # --- the host service's limits on each user ---------------------------------------------------
    Setting(
        "max_kernels",
        COUNT,
        HOST,
        16,
        low=1,
        high=1024,
        per_user=True,
        help="""The most kernels one user may hold grants for on the host at once (every server of theirs
        together, CPU-only kernels included); the next start is refused (409), whatever on_full says. The
        built-in 16 is more notebooks than a person keeps running, and bounds what a burst of starts from one
        user's token can leave in the service's memory and on its disk.""",
    ),
    Setting(
        "user_budget",
        CAP,
        HOST,
        "0.5",
        per_user=True,
        parser=parse_user_budget,
        help="""The most one user's grants may add up to on each device: a fraction of the device ("0.5"), a
        percentage, a size or bytes, or "none" (only the device's budget). A start that would pass it is
        handled by on_full, a cap raise by on_over_max. The built-in "0.5" leaves at least half of every GPU
        to the other users whatever one user starts, while one kernel of that user can still get half a
        device; give a user or group that needs whole GPUs more in the mapping.""",
    ),
    # --- pluggable parts -----------------------------------------------------------------------------
    Setting(
        "inventory_class",
        CLASS,
        PLUGINS,
        "gpu_quota_ext.devices.NvmlInventory",
        klass="gpu_quota_ext.devices.DeviceInventory",
        help="""Where the list of GPUs comes from: NVML (default) or
        gpu_quota_ext.devices.StaticInventory with c.StaticInventory.devices (tests, demos without a GPU).""",
    ),
    Setting(
        "nvml_class",
        CLASS,
        PLUGINS,
        "gpu_quota_ext.devices.nvml.PynvmlBackend",
        klass="gpu_quota_ext.devices.nvml.NvmlBackend",
        help="""Where the monitor reads per-process GPU memory: the driver through nvidia-ml-py (default), or
        gpu_quota_ext.devices.fake_nvml.FakeNvml (tests, benchmarks).""",
    ),
    Setting(
        "checkpoint_class",
        CLASS,
        PLUGINS,
        "gpu_quota_ext.parking.checkpoint.CudaCheckpointDriver",
        klass="gpu_quota_ext.parking.checkpoint.CheckpointDriver",
        help="""What parks kernels: the CUDA driver's checkpoint API through ctypes (default), or
        gpu_quota_ext.parking.fake_checkpoint.FakeCheckpoint (tests, with the fake NVML).""",
    ),
)

DEFAULTS: Dict[str, Any] = {name: row.default for name, row in SETTINGS.items()}


# --- the host service's own settings (c.GpuQuotaService) -------------------------------------------------

BROKER_HELP = " Here: for every user's kernels at once, on the host's broker."


def _on_the_host(name: str, help: str, **changes: Any) -> Setting:
    """A server row as the host service takes it: the same kind, choices and default, the service's help, never
    read from the environment (the service's settings come from its config file and command line only)."""
    return replace(SETTINGS[name], part=SERVICE, env=None, help=help, **changes)


SERVICE_SETTINGS: Dict[str, Setting] = _table(
    Setting("config_file", TEXT, SERVICE, "", help="A Python config file with c.GpuQuotaService settings."),
    # Its default is computed at start (the Jupyter data directory): GpuQuotaService._state_dir.
    Setting(
        "state_dir",
        TEXT,
        SERVICE,
        "",
        help="Where the ledger's database lives (created 0700, owned by the service's user).",
    ),
    Setting("users", MAPPING, SERVICE, {}, help="Per-user settings, as configure_hub_caps takes them."),
    Setting(
        "groups",
        MAPPING,
        SERVICE,
        {},
        help="Per-group settings (first group in this order wins), as configure_hub_caps.",
    ),
    Setting("default", MAPPING, SERVICE, {}, help="Settings for everyone else, as configure_hub_caps."),
    # hub/caps.py's PROPERTY_KEY (a test checks they agree: settings.py imports nothing of hub/).
    Setting(
        "property_key",
        TEXT,
        SERVICE,
        "gpu_quota",
        nullable=True,
        help="Group property read for live settings; None: ignore properties.",
    ),
    _on_the_host("default_cap", "A kernel's cap where the mapping sets none."),
    _on_the_host("max_cap", "The most a kernel may ask for where the mapping sets none."),
    _on_the_host(
        "overcommit",
        "Budget per device = its memory × this; None: no admission control.",
        default=1.0,
        nullable=True,
        low=None,
        high=None,
    ),
    _on_the_host("placement", "How kernels are placed on the host's GPUs."),
    _on_the_host("on_full", "A full host: refuse the kernel, or start it CPU-only (per user in the mapping)."),
    _on_the_host("on_over_max", "A request above max_cap: clamp it or refuse it."),
    _on_the_host("inventory_class", "The host's GPUs (StaticInventory for tests)."),
    _on_the_host("nvml_class", "NVML for the host watchdog (FakeNvml for tests)."),
    Setting("poll_interval", SECONDS, SERVICE, 5.0, help="Seconds between host samples."),
    Setting("stall_after", SECONDS, SERVICE, 10.0, help="A sample out longer than this: the watchdog is 'stalled'."),
    _on_the_host("max_kernels", SETTINGS["max_kernels"].help + " Where the mapping sets none."),
    _on_the_host("user_budget", SETTINGS["user_budget"].help + " Where the mapping sets none."),
    Setting(
        "idle_held",
        CHOICE,
        SERVICE,
        "release",
        choices=("release", "keep"),
        help="""A grant that no live process of its user (a PID its server registered, verified by its uid) has
        held for a lease period: release it, or keep it and show it as idle-held on the admin's page. A lease
        renewed with empty PID lists keeps nothing under "release".""",
    ),
    # The choices are hub/service/attribution.py's UNMANAGED_ACTIONS (it reads them here).
    Setting(
        "unmanaged_action",
        CHOICE,
        SERVICE,
        "warn",
        choices=("warn", "kill"),
        help="GPU memory outside every grant: warn, or kill the process after unmanaged_grace.",
    ),
    Setting("unmanaged_grace", SECONDS, SERVICE, 30.0, help="Seconds an unmanaged process is seen before 'kill' acts."),
    Setting(
        "unix_user_template",
        TEXT,
        SERVICE,
        "{username}",
        help="A hub user's Unix user name ('jupyter-{username}' on TLJH).",
    ),
    Setting(
        "lease_seconds",
        SECONDS,
        SERVICE,
        float(LEASE_SECONDS),
        help="A server not heard of this long loses its grants.",
    ),
    Setting(
        "start_grace",
        SECONDS,
        SERVICE,
        30.0,
        help="A grant this young is kept even when its server's lease does not list it yet.",
    ),
    Setting(
        "hub_cache_seconds", SECONDS, SERVICE, 10.0, help="How long the hub's answers (tokens, users, groups) are kept."
    ),
    Setting("sampler_enabled", FLAG, SERVICE, True, help="Run the host watchdog."),
    Setting(
        "room_calls_per_second",
        RATE,
        SERVICE,
        20.0,
        help="""Room calls (api/room) one user's servers may make a second, together (0: no limit). A server calls
        once a sample while a kernel of its waits, and once per park; more is answered 429 with Retry-After.""",
    ),
    Setting(
        "grant_calls_per_second",
        RATE,
        SERVICE,
        20.0,
        help="Grant calls (api/grants: starts, cap changes, releases, lists) one user may make a second (0: no limit).",
    ),
    Setting(
        "lease_calls_per_second",
        RATE,
        SERVICE,
        5.0,
        help=f"""Lease renewals (api/lease) one user's servers may make a second, together (0: no limit); a server
        renews every {LEASE_RENEW} s.""",
    ),
    Setting(
        "status_calls_per_second",
        RATE,
        SERVICE,
        10.0,
        help="Status and metrics calls one user (or service) may make a second (0: no limit).",
    ),
    Setting(
        "page_loads_per_second",
        RATE,
        SERVICE,
        1.0,
        help="Loads of the admin's page one user may make a second (0: no limit); past it, 429.",
    ),
    Setting(
        "failed_auth_per_second",
        RATE,
        SERVICE,
        2.0,
        help="""Failed authentications (no token, a token the hub does not know or that was not given access)
        taken a second from one address; past it, a token the hub has not confirmed in the last hour is answered
        429 without asking the hub (0: no limit).""",
    ),
    Setting(
        "rate_burst_seconds",
        SECONDS,
        SERVICE,
        5.0,
        help="Each of the limits above lets this many seconds' worth of calls through at once.",
    ),
    Setting(
        "max_open_requests",
        COUNT,
        SERVICE,
        64,
        help="Requests of one user open at once, long polls included (0: no limit); past it, 429.",
    ),
    Setting(
        "refusal_hold_seconds",
        SECONDS,
        SERVICE,
        15.0,
        help="""A call answered 429 gets its answer after up to the time it was told to wait, at most this long (1024
        held at once per caller; past that, answered at once and disconnected): a client that calls again as soon
        as it is answered makes one call per connection per hold. 0: answered at once.""",
    ),
    Setting(
        "max_long_polls",
        COUNT,
        SERVICE,
        16,
        help="Lease renewals of one user waiting at once (one per server is what servers make; 0: no limit).",
    ),
    Setting(
        "unparkable_idle",
        CHOICE,
        SERVICE,
        "count",
        choices=("count", "show"),
        help="""GPU memory of a kernel idle at least park_min_idle that cannot be parked (its server reports it not
        parkable, or it declined a park request): "count" it, for its user, against the user's user_budget once
        more, on top of the grant that holds it (for their new kernels, raised caps and resumes), so that memory
        nobody else can get back costs its keeper; or only "show" it on the admin's page.""",
    ),
    Setting(
        "page_cache_seconds",
        SECONDS,
        SERVICE,
        2.0,
        help="""The admin's page is built (in a thread of its own, off the path that answers grants) at most once
        this often per view; every load meanwhile gets that build. 0: built for each load.""",
    ),
    # The host's broker: the server's settings of the same name, as text (parsed as the server parses them).
    *(
        _on_the_host(name, SETTINGS[name].help + BROKER_HELP, default=str(DEFAULTS[name]))
        for name in ("park_min_idle", "park_wait_limit", "park_device_margin", "park_host_margin")
    ),
)


def names_of(part: str) -> Tuple[str, ...]:
    """The settings one builder takes, in the table's order."""
    return tuple(name for name, row in SETTINGS.items() if row.part == part)


def parse_value(name: str, value: Any) -> Any:
    """One setting's value read the way the server reads it; PolicyError says why not. The server's
    settings and the hub's per-user mapping both come here."""
    return SETTINGS[name].parse(value)


def default_of(name: str) -> Any:
    """A setting's built-in default as its part holds it (the dataclasses' defaults)."""
    return SETTINGS[name].parse(SETTINGS[name].default)


def server_setting_names() -> Tuple[str, ...]:
    """The settings of a user's server (c.GpuQuota, `jupyter gpu-quota`): every row but the host service's."""
    return tuple(name for name, row in SETTINGS.items() if row.part != HOST)


class SettingError(PolicyError):
    """A setting's value that cannot be used: one line naming the setting, the value and, when the value came
    from there, the environment variable: `c.GpuQuota.NAME = VALUE (from the environment variable X): why`."""

    def __init__(self, name: str, value: Any, reason: str, variable: Optional[str] = None):
        self.name, self.value, self.reason, self.variable = name, value, reason, variable
        source = f" (from the environment variable {variable})" if variable else ""
        super().__init__(f"c.GpuQuota.{name} = {shown(value)}{source}: {reason}")

    def from_environment(self, variable: str, text: str) -> "SettingError":
        """The same refusal, said of the environment variable's text."""
        return SettingError(self.name, text, self.reason, variable)


def as_text(value: Any) -> str:
    """A setting's value as its environment variable carries it (0.5 -> "0.5", 2**30 -> "1073741824"): a number
    in a config file or the hub's mapping is read exactly as the same text on the command line would be
    (so `c.GpuQuota.max_cap = 1` is the whole device, as "1" is, not one byte)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise PolicyError(f"{shown(value)} is not a setting value; use a string like '0.25' or '12GiB', or a number")
    return repr(value) if isinstance(value, float) else str(value).strip()


T = TypeVar("T")


def parsed(name: str, parse: Callable[[Any], T], value: Any) -> T:
    """`parse(value)`; its PolicyError becomes a SettingError naming the setting and the value."""
    try:
        return parse(value)
    except SettingError:
        raise
    except PolicyError as error:
        raise SettingError(name, value, str(error)) from None


def validated(part: str, args: Sequence[Any] = (), given: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Every setting of one part read by its row, keyed by the attribute that holds it: what a builder
    passes to its dataclass. `args` come in the table's order and `given` by name (a builder's own
    arguments); a setting neither gives has the table's default. A SettingError names the first bad one.
    A wrong call (too many, twice, unknown names) is a TypeError, as a Python signature would raise."""
    names = names_of(part)
    if len(args) > len(names):
        raise TypeError(f"the {part} settings are {', '.join(names)}: {len(args)} given")
    values = dict(given or {})
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise TypeError(f"not a {part} setting: {', '.join(unknown)} (the {part} settings are {', '.join(names)})")
    for name, value in zip(names, args):
        if name in values:
            raise TypeError(f"the {part} setting {name} given twice")
        values[name] = value
    held = {}
    for name in names:
        row = SETTINGS[name]
        held[row.attribute or name] = parsed(name, row.parse, values.get(name, row.default))
    return held
