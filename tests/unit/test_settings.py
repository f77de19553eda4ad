"""The one table of settings (gpu_quota_ext/settings.py) and the typed traits made from it: every trait has
a row and every row a trait, each variable is the setting's alone, the hub, the dataclasses and the docs'
generated reference take what the table says, and a bad value is refused in one line naming the setting
(and its variable)."""

import re
import sys
from pathlib import Path

import pytest
from traitlets import TraitError
from traitlets.config import Config

import gpu_quota_ext.hub.caps as hub
from gpu_quota_ext.app import GpuQuota
from gpu_quota_ext.hard_limit import HardLimitSettings, build_hard_limit_settings
from gpu_quota_ext.parking import ParkSettings, build_park_settings
from gpu_quota_ext.policy import Policy, build_policy
from gpu_quota_ext.settings import (
    CAP,
    CHOICE,
    DEFAULTS,
    FACTOR,
    HARD_CAP,
    HOST,
    PARK,
    POLICY,
    SECONDS,
    SETTINGS,
    SIZE,
    SLACK,
    WATCHDOG,
    names_of,
    server_setting_names,
)
from gpu_quota_ext.shared import env_vars
from gpu_quota_ext.shared.sizes import GiB, MiB, PolicyError
from gpu_quota_ext.usage.watchdog_settings import (
    WatchdogSettings,
    build_watchdog_settings,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"
SERVER = {name: SETTINGS[name] for name in server_setting_names()}  # the host service's rows are its own
CHOICES = [name for name, row in SERVER.items() if row.kind == CHOICE]
# A number as an admin writes one in jupyter_server_config.py, for each size or fraction, and what it gives.
NUMBERS = {
    "default_cap": (0.5, lambda policy, watchdog, hard, park: policy.default_cap.fraction == 0.5),
    "max_cap": (1, lambda policy, watchdog, hard, park: policy.max_cap.fraction == 1.0),  # the whole device, as "1"
    "slack": (2**30, lambda policy, watchdog, hard, park: watchdog.slack.nbytes == GiB),
    "mps_context_allowance": (512 * MiB, lambda policy, watchdog, hard, park: hard.context_allowance == 512 * MiB),
    "park_host_margin": (2**30, lambda policy, watchdog, hard, park: park.host_margin == GiB),
    "park_device_margin": (3 * 2**30, lambda policy, watchdog, hard, park: park.device_margin == 3 * GiB),
}


@pytest.fixture(autouse=True)
def no_settings_in_the_environment(monkeypatch):
    for row in SETTINGS.values():
        if row.env:
            monkeypatch.delenv(row.env, raising=False)


def extension(**settings) -> GpuQuota:
    return GpuQuota(config=Config({"GpuQuota": settings}))


def test_every_trait_has_a_row_and_every_row_a_trait_with_its_variable():
    traits = GpuQuota.class_own_traits(config=True)
    assert sorted(traits) == sorted(SERVER)
    assert {name for name, row in SETTINGS.items() if row.part == HOST} == {"max_kernels", "user_budget"}
    for name, trait in traits.items():
        assert trait.metadata.get("env") == SETTINGS[name].env, name
        assert SETTINGS[name].help.split()[0] in trait.help, name


def test_each_environment_variable_is_one_settings_and_none_is_a_kernels():
    variables = [row.env for row in SETTINGS.values() if row.env]
    assert len(variables) == len(set(variables))
    assert all(re.fullmatch(r"GPU_QUOTA_[A-Z_]+", variable) for variable in variables)
    kernel_side = {value for key, value in vars(env_vars).items() if key.isupper()}
    assert not kernel_side & set(variables)


def test_every_part_is_built_from_the_table_and_the_dataclasses_defaults_are_the_tables():
    policy = build_policy(**{name: DEFAULTS[name] for name in names_of(POLICY)})
    assert policy == Policy(policy.default_cap, policy.max_cap)
    assert (str(policy.default_cap), str(policy.max_cap)) == (DEFAULTS["default_cap"], DEFAULTS["max_cap"])
    assert build_watchdog_settings(**{name: DEFAULTS[name] for name in names_of(WATCHDOG)}) == WatchdogSettings()
    assert build_watchdog_settings() == WatchdogSettings()
    assert build_hard_limit_settings(**{name: DEFAULTS[name] for name in names_of(HARD_CAP)}) == HardLimitSettings()
    # A fresh extension (no config, no variable) validates to the same objects.
    assert extension().validated_settings() == (policy, WatchdogSettings(), HardLimitSettings())
    assert (
        build_park_settings(**{name: DEFAULTS[name] for name in names_of(PARK)})
        == ParkSettings()
        == extension().park_settings()
    )


def test_the_hubs_keys_and_variables_are_the_tables_per_user_rows():
    per_user = {name: row.env for name, row in SERVER.items() if row.per_user}
    assert hub.SETTING_ENV == per_user and set(hub.ENV_NAMES) == set(per_user.values())
    host = {name for name, row in SETTINGS.items() if row.per_user and row.part == HOST}
    assert set(hub.HOST_KEYS) == host and not {SETTINGS[name].env for name in host} - {None}
    for name in per_user:
        if DEFAULTS[name] is not None:
            assert hub.caps_environment(hub.hub_caps(default={name: DEFAULTS[name]}), "u") == {
                per_user[name]: str(DEFAULTS[name])
            }
    with pytest.raises(PolicyError, match=r"unknown keys \['enforce'\]"):
        hub.hub_caps(default={"enforce": "kill"})  # a server setting the table does not give the hub


@pytest.mark.parametrize("name", [name for name, row in SERVER.items() if row.kind in (CAP, SIZE, SLACK)])
def test_a_number_in_a_config_file_is_accepted_for_each_size_or_fraction(name):
    number, holds = NUMBERS[name]  # a KeyError here: a new size setting needs its number above
    app = extension(**{name: number})
    assert app.environment_source(name) is None
    assert holds(*app.validated_settings(), app.park_settings())


@pytest.mark.parametrize("name", [name for name, row in SERVER.items() if row.kind in (SECONDS, FACTOR)])
def test_a_number_or_its_text_is_accepted_for_each_number_setting(name):
    row = SETTINGS[name]
    inside = (row.low + row.high) / 2
    assert getattr(extension(**{name: inside}), name) == inside
    assert getattr(extension(**{name: str(inside)}), name) == inside  # as a config file may write it
    with pytest.raises(TraitError) as refused:
        extension(**{name: row.high * 2}).validated_settings()
    assert str(refused.value) == f"c.GpuQuota.{name} = {row.high * 2!r}: {row.must}"
    with pytest.raises(TraitError) as refused:
        extension(**{name: "-1"})  # text, as the command line gives it: refused as written
    assert str(refused.value) == f"c.GpuQuota.{name} = '-1': {row.must}"


NUMERIC = [name for name, row in SERVER.items() if row.kind in (SECONDS, FACTOR, CAP, SIZE, SLACK)]


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("flag", [True, False])
def test_a_boolean_is_no_number_for_any_numeric_setting(name, flag):
    """Issue 19: True was taken as 1 (overcommit 1.0, grace 1 s); False was refused as "0.0"."""
    with pytest.raises((TraitError, PolicyError)) as refused:
        app = extension(**{name: flag})
        app.validated_settings(), app.park_settings()
    assert str(refused.value).startswith(f"c.GpuQuota.{name} = {flag!r}: "), str(refused.value)


@pytest.mark.parametrize("name", [name for name in NUMERIC if SETTINGS[name].env])
@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_a_non_finite_number_from_the_environment_is_refused_as_written_naming_its_variable(name, text, monkeypatch):
    row = SETTINGS[name]
    monkeypatch.setenv(row.env, text)
    with pytest.raises((TraitError, PolicyError)) as refused:
        app = extension()
        app.validated_settings(), app.park_settings()
    assert str(refused.value).startswith(f"c.GpuQuota.{name} = '{text}' (from the environment variable {row.env}): ")


@pytest.mark.parametrize("name", CHOICES)
def test_each_choice_refuses_a_bad_value_in_one_line_naming_the_setting(name, monkeypatch):
    row = SETTINGS[name]
    assert getattr(extension(**{name: f" {row.choices[-1].upper()} "}), name) == row.choices[-1]
    with pytest.raises(TraitError) as refused:
        extension(**{name: "bogus"})
    assert str(refused.value) == f"c.GpuQuota.{name} = 'bogus': {row.must}"
    assert "\n" not in str(refused.value) and all(repr(choice) in str(refused.value) for choice in row.choices)

    monkeypatch.setenv(row.env, "bogus")
    with pytest.raises(TraitError) as refused:
        extension().validated_settings()
    assert str(refused.value) == f"c.GpuQuota.{name} = 'bogus' (from the environment variable {row.env}): {row.must}"


def test_a_value_from_the_environment_is_named_with_its_variable_and_config_wins_over_it(monkeypatch):
    monkeypatch.setenv("GPU_QUOTA_POLL_INTERVAL", "0.01")
    with pytest.raises(
        TraitError, match=r"poll_interval = '0.01' \(from the environment variable GPU_QUOTA_POLL_INTERVAL\)"
    ):
        extension().validated_settings()
    monkeypatch.setenv("GPU_QUOTA_MAX_CAP", "2.0")
    with pytest.raises(
        PolicyError, match=r"^c.GpuQuota.max_cap = '2.0' \(from the environment variable GPU_QUOTA_MAX_CAP\): "
    ):
        extension(poll_interval=1).validated_settings()
    with pytest.raises(PolicyError) as refused:
        extension(poll_interval=1, max_cap="3.0").validated_settings()
    assert str(refused.value).startswith("c.GpuQuota.max_cap = '3.0': ") and "GPU_QUOTA" not in str(refused.value)
    monkeypatch.setenv("GPU_QUOTA_MAX_CAP", "0.5")
    monkeypatch.setenv("GPU_QUOTA_OVERCOMMIT", "none")
    app = extension(poll_interval=1)
    assert app.validated_settings()[0].max_cap.fraction == 0.5 and app.overcommit is None
    assert (app.environment_source("max_cap"), app.environment_source("poll_interval")) == ("GPU_QUOTA_MAX_CAP", None)


def test_caps_takes_a_list_of_rules_or_a_callable_and_nothing_else():
    def rules(user, kernelspec):
        return "0.5" if user == "alice" else None

    assert extension(caps=rules).validated_settings()[0].rules is rules
    assert len(extension(caps=({"user": "alice", "cap": 0.5},)).validated_settings()[0].rules) == 1
    with pytest.raises(TraitError) as refused:
        extension(caps="alice")
    assert str(refused.value) == "c.GpuQuota.caps = 'alice': must be a list of rules or a callable"


def test_the_generated_reference_lists_every_setting_with_its_variable_and_default():
    # The docs' settings reference is generated from SETTINGS at build time (docs/_ext/gpu_quota_docs.py);
    # tests/docs builds it and finds every row in the page.
    sys.path.insert(0, str(DOCS / "_ext"))
    import gpu_quota_docs  # docs/_ext is not a package

    rows = {name: (env, default) for name, env, default, _ in gpu_quota_docs.setting_rows(SETTINGS)}
    assert list(rows) == list(SETTINGS)
    for name, (env, default) in rows.items():
        row = SETTINGS[name]
        assert env == (row.env or ""), name
        assert default == (f'"{row.default}"' if isinstance(row.default, str) else repr(row.default)), name
    parts = (POLICY, WATCHDOG, HARD_CAP, PARK)
    by_part = [name for part in parts for name, *_ in gpu_quota_docs.setting_rows(SETTINGS, part)]
    assert by_part == [name for name in SETTINGS if SETTINGS[name].part in parts]
    # The reference page shows the whole table, not one part's.
    page = DOCS.joinpath("reference", "settings.md").read_text(encoding="utf-8")
    assert re.search(r"^```\{gpu-quota-settings\}\n```$", page, re.M)


def test_a_builder_takes_its_rows_in_the_tables_order_or_by_name_and_nothing_else():
    # Each builder reads its part's rows from the table (settings.validated): positional in the table's order.
    by_position = build_hard_limit_settings(*[DEFAULTS[name] for name in names_of(HARD_CAP)][:-1], "2.5")
    assert by_position == build_hard_limit_settings(mps_timeout="2.5") and by_position.timeout == 2.5
    assert build_policy("0.5", "0.75").default_cap.fraction == 0.5
    with pytest.raises(TypeError, match="the watchdog settings are enforce, slack, grace, poll_interval: 5 given"):
        build_watchdog_settings("warn", "1GiB", 0, 1, "extra")
    with pytest.raises(TypeError, match="the policy setting default_cap given twice"):
        build_policy("0.25", default_cap="0.5")
    with pytest.raises(TypeError, match=r"not a park setting: enforce \(the park settings are park_idle_after, "):
        build_park_settings(enforce="kill")


def test_every_row_reads_its_default_and_its_builder_holds_it_under_its_attribute():
    parts = {POLICY: Policy, WATCHDOG: WatchdogSettings, HARD_CAP: HardLimitSettings, PARK: ParkSettings}
    for name, row in SETTINGS.items():
        row.parse(row.default)  # a default its own row refuses would stop every server
        if row.part in parts:
            assert (row.attribute or name) in parts[row.part].__dataclass_fields__, name


def test_the_checkpoint_calls_timeout_is_a_setting(monkeypatch):
    """Issue 19: the 600 s a park or resume may take before its state says the driver has not returned was a
    constant. It is c.GpuQuota.park_call_timeout, or $GPU_QUOTA_PARK_CALL_TIMEOUT, refused in one line."""
    assert extension().park_settings().call_timeout == 600 == DEFAULTS["park_call_timeout"]
    assert extension(park_call_timeout=30).park_settings().call_timeout == 30
    monkeypatch.setenv("GPU_QUOTA_PARK_CALL_TIMEOUT", "45")
    assert extension().park_settings().call_timeout == 45
    monkeypatch.setenv("GPU_QUOTA_PARK_CALL_TIMEOUT", "0")
    with pytest.raises((TraitError, PolicyError)) as refused:
        extension().park_settings()
    assert str(refused.value) == (
        "c.GpuQuota.park_call_timeout = '0' (from the environment variable GPU_QUOTA_PARK_CALL_TIMEOUT): "
        "must be a number of seconds from 0.1 to 86400"
    )
