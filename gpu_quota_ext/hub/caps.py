"""JupyterHub side: per-user and per-group caps, carried to each user's server through its environment.

The extension in a user's server reads its settings' defaults from environment variables
(GPU_QUOTA_DEFAULT_CAP, GPU_QUOTA_MAX_CAP, ...: the table in gpu_quota_ext/settings.py, whose rows
marked per_user are the keys this mapping takes). Any spawner passes `spawner.environment`
to the server it starts (LocalProcessSpawner, SystemdSpawner, KubeSpawner, DockerSpawner), so the hub
decides a user's caps by filling that dict just before the server starts. In `jupyterhub_config.py`:

    from gpu_quota_ext.hub import configure_hub_caps

    configure_hub_caps(
        c,
        default={"default_cap": "0.25", "max_cap": "0.5", "on_over_max": "refuse"},
        groups={"staff": {"default_cap": "0.5", "max_cap": "1.0"}, "students": {"max_cap": "0.25"}},
        users={"alice": {"max_cap": "0.75"}},
    )

Each setting of a user's server comes from the first of these that sets it:
1. `users[name]`;
2. the user's first group that has settings: groups in the order of the `groups` mapping, then the
   others by name. A group's settings are its `groups` entry updated by its JupyterHub group
   properties under the key "gpu_quota" (JupyterHub >= 3.2, editable live through the hub's REST API:
   `{"gpu_quota": {"default_cap": "0.5", "max_cap": "0.8"}}`);
3. `default`;
4. otherwise nothing is set and the server uses its own config (c.GpuQuota) or built-in defaults.

Everything is validated with the extension's own parsers: a bad value in the mapping stops the hub at
start with a PolicyError naming it; a bad group property (set later, through the API) fails that user's
spawn with the same kind of message, instead of starting a server without the caps the admin meant.

This module does not import jupyterhub: the decision is a pure function of the user's name, their groups
and the mapping (`caps_environment`); the glue (`HubCaps.pre_spawn_hook`) only reads `spawner.user`
and writes `spawner.environment`. On Kubernetes with HAMi, `gpu_quota_ext.hub.kube.configure_kubespawner_gpu`
takes the same mapping with more keys (the pod's GPUs and its share of their memory) and uses the same
layering (`choose_settings`). The host quota service (`configure_host_service`) takes the same mapping with
the host's limits on each user as more keys (`HOST_KEYS`: `max_kernels`, `user_budget`); `configure_hub_caps`
refuses those, since a server alone would not read them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from ..policy import build_policy
from ..settings import DEFAULTS, HOST, POLICY, SETTINGS, as_text, names_of, parse_value
from ..shared.sizes import PolicyError
from ..shared.spelling import did_you_mean

# The keys of the mapping: setting name (as in c.GpuQuota) -> the environment variable the extension reads
# it from. The table's rows marked per_user (gpu_quota_ext.settings).
SETTING_ENV: Dict[str, str] = {name: row.env for name, row in SETTINGS.items() if row.per_user and row.env}
ENV_NAMES = tuple(SETTING_ENV.values())
PROPERTY_KEY = "gpu_quota"

Settings = Dict[str, str]
# Keys a caller adds to the mapping (kube.py: the pod's GPU keys): name -> parser(value) -> normalized
# text, raising PolicyError. They are layered like the server's settings but never reach its environment.
ExtraKeys = Mapping[str, Callable[[Any], str]]


def _host_key(name: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = as_text(value)
        parse_value(name, text)
        return text

    return parse


# The host service's limits on each user (the table's per_user rows of its HOST part): keys of the mapping the
# service takes (configure_host_service), never a server's environment.
HOST_KEYS: ExtraKeys = {name: _host_key(name) for name, row in SETTINGS.items() if row.per_user and row.part == HOST}


@dataclass(frozen=True)
class HubGroup:
    """What the decision needs of a JupyterHub group (jupyterhub.orm.Group has the same attributes)."""

    name: str
    properties: Mapping[str, Any] = field(default_factory=dict)


def parse_settings(entry: Any, where: str, extra_keys: Optional[ExtraKeys] = None) -> Settings:
    """One entry of the mapping, e.g. {"default_cap": "0.25", "max_cap": "50%"} -> {name: text}.

    Each value is checked the way the server will check it; raises PolicyError naming `where`.
    `extra_keys` are accepted too, each checked by its own parser.
    """
    extra_keys = extra_keys or {}
    if not isinstance(entry, Mapping):
        raise PolicyError(f"{where} must be a dict like {{'default_cap': '0.25', 'max_cap': '0.5'}}, not {entry!r}")
    unknown = sorted(str(key) for key in entry if key not in SETTING_ENV and key not in extra_keys)
    host_only = [key for key in unknown if key in HOST_KEYS]
    if host_only:
        raise PolicyError(
            f"{where}: {host_only} {'is a limit' if len(host_only) == 1 else 'are limits'} of the host quota service "
            "(configure_host_service takes the same mapping); a user's server alone does not read it"
        )
    if unknown:
        known = list(SETTING_ENV) + list(extra_keys)
        raise PolicyError(f"{where} has unknown keys {unknown}; known keys are {known}{did_you_mean(unknown, known)}")
    settings: Settings = {}
    for key, value in entry.items():
        if value is None:
            continue  # "not set here": the next source decides
        try:
            if key in extra_keys:
                settings[key] = extra_keys[key](value)
                continue
            text = as_text(value)
            parse_value(key, text)
        except PolicyError as error:
            raise PolicyError(f"{where}[{key!r}] = {value!r}: {error}") from None
        settings[key] = text
    if "default_cap" in settings and "max_cap" in settings:
        _check_combination(settings, where)
    return settings


def server_settings(settings: Mapping[str, str]) -> Settings:
    """Only the keys the user's server reads (from its environment)."""
    return {key: value for key, value in settings.items() if key in SETTING_ENV}


def _check_combination(settings: Mapping[str, str], where: str) -> None:
    """The settings as one server would end up with them (missing ones at the server's defaults)."""
    settings = server_settings(settings)
    merged = {name: settings.get(name, DEFAULTS[name]) for name in names_of(POLICY)}
    try:
        build_policy(**merged)
    except PolicyError as error:
        builtin = [f"{key} {DEFAULTS[key]}" for key in ("default_cap", "max_cap") if key not in settings]
        note = f" (where the mapping sets none, the server's built-in {' and '.join(builtin)} apply)" if builtin else ""
        raise PolicyError(f"{where}: {error}{note}") from None


@dataclass(frozen=True)
class HubCaps:
    """The admin's mapping, validated. Build it with `hub_caps(...)` or `configure_hub_caps(c, ...)`."""

    users: Mapping[str, Settings] = field(default_factory=dict)
    groups: Tuple[Tuple[str, Settings], ...] = ()  # in the admin's order: the first group wins
    default: Settings = field(default_factory=dict)
    property_key: Optional[str] = PROPERTY_KEY  # None: ignore group properties
    extra_keys: ExtraKeys = field(default_factory=dict)

    def environment_for(self, user: str, groups: Iterable[Any] = ()) -> Dict[str, str]:
        return caps_environment(self, user, groups)

    def pre_spawn_hook(self, previous: Optional[Callable] = None) -> Callable:
        """A `c.Spawner.pre_spawn_hook`: runs `previous` (the admin's own hook, if any), then sets the caps."""

        def apply(spawner) -> None:
            groups = getattr(spawner.user, "groups", ())
            set_spawner_environment(spawner, self.environment_for(spawner.user.name, groups))

        return chain_hooks(previous, apply)


def chain_hooks(previous: Optional[Callable], apply: Callable) -> Callable:
    """A spawner hook that runs `previous` (the admin's own, sync or async) first, then `apply`."""
    if previous is None:
        return apply

    async def chained(spawner) -> None:
        result = previous(spawner)
        if inspect.isawaitable(result):
            await result
        apply(spawner)

    return chained


def hub_caps(
    users: Optional[Mapping[str, Any]] = None,
    groups: Optional[Mapping[str, Any]] = None,
    default: Optional[Mapping[str, Any]] = None,
    property_key: Optional[str] = PROPERTY_KEY,
    extra_keys: Optional[ExtraKeys] = None,
) -> HubCaps:
    """Validate the admin's mapping (raises PolicyError naming the first bad entry)."""
    for name, value in (("users", users), ("groups", groups)):
        if value is not None and not isinstance(value, Mapping):
            raise PolicyError(f"{name} must be a dict of name -> settings, not {value!r}")
    extra_keys = dict(extra_keys or {})
    caps = HubCaps(
        users={
            str(name): parse_settings(entry, f"users[{name!r}]", extra_keys) for name, entry in (users or {}).items()
        },
        groups=tuple(
            (str(name), parse_settings(entry, f"groups[{name!r}]", extra_keys))
            for name, entry in (groups or {}).items()
        ),
        default=parse_settings(default or {}, "default", extra_keys),
        property_key=property_key,
        extra_keys=extra_keys,
    )
    # Combinations known now (a user's entry over the default, a group's over the default) fail now,
    # at hub start, rather than at some user's spawn.
    _check_combination(caps.default, "default")
    for name, settings in caps.groups:
        _check_combination({**caps.default, **settings}, f"groups[{name!r}] with default")
    for name, settings in caps.users.items():
        _check_combination({**caps.default, **settings}, f"users[{name!r}] with default")
    return caps


def caps_environment(caps: HubCaps, user: str, groups: Iterable[Any] = ()) -> Dict[str, str]:
    """The environment variables for `user`'s server: {"GPU_QUOTA_DEFAULT_CAP": "0.5", ...}.

    `groups`: group names, HubGroup, or jupyterhub.orm.Group objects (anything with .name and
    .properties). Pure. Raises PolicyError (naming the user and the source) when the result is invalid.
    """
    chosen, sources = choose_settings(caps, user, groups)
    return environment_of(chosen, sources, user)


def environment_of(chosen: Mapping[str, str], sources: Mapping[str, str], user: str) -> Dict[str, str]:
    """The server's environment from `choose_settings`' result, its combination checked."""
    chosen = server_settings(chosen)
    if chosen:
        where = f"caps for user {user!r} (" + ", ".join(f"{k} from {sources[k]}" for k in chosen) + ")"
        _check_combination(chosen, where)
    return {SETTING_ENV[key]: value for key, value in chosen.items()}


def choose_settings(caps: HubCaps, user: str, groups: Iterable[Any] = ()) -> Tuple[Settings, Dict[str, str]]:
    """Every key's value for `user` (their entry, else their first group with settings, else default)
    and where each came from ({"max_cap": "users['alice']", ...}). Pure."""
    group_name, group_settings = _first_group_settings(caps, list(groups))
    layers: List[Tuple[str, Settings]] = [
        (f"users[{user!r}]", caps.users.get(user, {})),
        (f"group {group_name!r}", group_settings),
        ("default", caps.default),
    ]
    chosen: Settings = {}
    sources: Dict[str, str] = {}
    for source, settings in layers:
        for key, value in settings.items():
            if key not in chosen:
                chosen[key] = value
                sources[key] = source
    return chosen, sources


def _first_group_settings(caps: HubCaps, groups: List[Any]) -> Tuple[Optional[str], Settings]:
    by_name = {}
    for group in groups:
        name = group if isinstance(group, str) else getattr(group, "name", None)
        if name is not None:
            by_name[str(name)] = group
    mapping = dict(caps.groups)
    ordered = [name for name, _ in caps.groups if name in by_name]
    ordered += sorted(name for name in by_name if name not in mapping)
    for name in ordered:
        settings = dict(mapping.get(name, {}))
        settings.update(_property_settings(caps, name, by_name[name]))
        if settings:
            return name, settings
    return None, {}


def _property_settings(caps: HubCaps, name: str, group: Any) -> Settings:
    if caps.property_key is None or isinstance(group, str):
        return {}
    properties = getattr(group, "properties", None) or {}
    if caps.property_key not in properties:
        return {}
    return parse_settings(
        properties[caps.property_key], f"group {name!r} property {caps.property_key!r}", caps.extra_keys
    )


def set_spawner_environment(spawner, env: Mapping[str, str]) -> None:
    """Put `env` into `spawner.environment`, taking back what an earlier spawn of this spawner set.

    A spawner object lives as long as the hub and spawns the same server again; a user who left a group
    since must not keep that group's caps. Values the admin put in c.Spawner.environment come back.
    """
    environment = dict(spawner.environment or {})
    original = getattr(spawner, "_gpu_quota_original_env", None)
    if original is None:
        original = {name: environment[name] for name in ENV_NAMES if name in environment}
        spawner._gpu_quota_original_env = original
    for name in ENV_NAMES:
        environment.pop(name, None)
    environment.update(original)
    environment.update(env)
    spawner.environment = environment


def configure_hub_caps(
    c,
    users: Optional[Mapping[str, Any]] = None,
    groups: Optional[Mapping[str, Any]] = None,
    default: Optional[Mapping[str, Any]] = None,
    property_key: Optional[str] = PROPERTY_KEY,
) -> HubCaps:
    """For jupyterhub_config.py: validate the mapping and set `c.Spawner.pre_spawn_hook`.

    A pre_spawn_hook already set in `c` (on c.Spawner or on a spawner class's own section, such as
    c.KubeSpawner, which would otherwise win over c.Spawner) still runs, first. Call this after any
    line that sets a pre_spawn_hook. Returns the validated HubCaps.
    """
    caps = hub_caps(users=users, groups=groups, default=default, property_key=property_key)
    sections = {"Spawner"} | {
        name
        for name in list(c.keys())
        if name.endswith("Spawner") and hasattr(c[name], "keys") and "pre_spawn_hook" in c[name]
    }
    for name in sorted(sections):
        section = c[name]
        previous = section.pre_spawn_hook if "pre_spawn_hook" in section else None
        section.pre_spawn_hook = caps.pre_spawn_hook(previous if callable(previous) else None)
    return caps
