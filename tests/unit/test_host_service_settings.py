"""The host service's settings are the rows of settings.SERVICE_SETTINGS: a trait each (settings_traits.py),
with the row's default and help; none is read from the environment; where the service takes a server setting,
the row is the server's (kind, choices, default) with the service's help."""

import pytest
from traitlets import TraitError
from traitlets.config import Config

from gpu_quota_ext.hub.caps import PROPERTY_KEY
from gpu_quota_ext.hub.service.app import GpuQuotaService
from gpu_quota_ext.hub.service.attribution import UNMANAGED_ACTIONS
from gpu_quota_ext.settings import DEFAULTS, SERVICE, SERVICE_SETTINGS, SETTINGS


def test_every_trait_has_a_row_and_every_row_a_trait_in_the_tables_order():
    traits = GpuQuotaService.class_own_traits(config=True)
    declared = [name for name in vars(GpuQuotaService) if name in traits]
    assert declared == list(SERVICE_SETTINGS)  # the docs' table lists them in this order
    for name, row in SERVICE_SETTINGS.items():
        assert traits[name].help == row.help, name
        assert row.env is None, name  # the service's settings come from its config file and command line


def test_a_fresh_service_has_the_tables_defaults():
    service = GpuQuotaService(config=Config())
    for name, row in SERVICE_SETTINGS.items():
        if name == "state_dir":
            continue  # computed at start: the Jupyter data directory
        value = getattr(service, name)
        if isinstance(value, type):
            value = f"{value.__module__}.{value.__name__}"
            assert value.rpartition(".")[2] == row.default.rpartition(".")[2], name
        else:
            assert value == row.default, name


def test_a_server_setting_the_service_takes_keeps_the_servers_kind_and_choices():
    # poll_interval is the service's own (between host samples), not the server's of the same name.
    shared = [name for name in SERVICE_SETTINGS if name in SETTINGS and name != "poll_interval"]
    assert {"default_cap", "overcommit", "placement", "max_kernels", "park_min_idle"} <= set(shared)
    for name in shared:
        row, server = SERVICE_SETTINGS[name], SETTINGS[name]
        assert (row.kind, row.choices, row.part) == (server.kind, server.choices, SERVICE), name
        assert str(row.default) == str(DEFAULTS[name]) or name == "overcommit", name
    assert SERVICE_SETTINGS["park_min_idle"].help.startswith(SETTINGS["park_min_idle"].help)


def test_the_service_tables_literals_are_the_ones_the_code_reads():
    assert SERVICE_SETTINGS["property_key"].default == PROPERTY_KEY
    assert UNMANAGED_ACTIONS == SERVICE_SETTINGS["unmanaged_action"].choices


@pytest.mark.parametrize(
    "name, value",
    [("placement", "everywhere"), ("max_kernels", 0), ("sampler_enabled", "maybe"), ("users", ["alice"])],
)
def test_a_bad_value_is_refused_by_its_trait(name, value):
    service = GpuQuotaService(config=Config())
    with pytest.raises(TraitError):
        setattr(service, name, value)


def test_none_is_a_value_where_the_row_says_so():
    service = GpuQuotaService(config=Config({"GpuQuotaService": {"overcommit": None, "property_key": None}}))
    assert service.overcommit is None and service.property_key is None
    with pytest.raises(TraitError):
        service.poll_interval = None
