"""configure_host_service: one call in jupyterhub_config.py gives the hub the quota service and every user
server what it needs to ask it (its URL, token access). A real traitlets Config, as the hub loads it."""

from __future__ import annotations

import pytest
from traitlets.config import Config

from gpu_quota_ext.hub.service.configure import configure_host_service
from gpu_quota_ext.ledger.remote import SERVICE_URL_ENV
from gpu_quota_ext.shared.sizes import PolicyError

ACCESS = "access:services!service=gpu-quota"


def roles(c):
    return {role["name"]: role for role in c.JupyterHub.load_roles}


def test_one_call_registers_the_service_and_points_every_server_at_it():
    c = Config()
    entry = configure_host_service(c, default={"default_cap": "0.25"}, groups={"staff": {"max_cap": "0.5"}}, port=12345)
    assert [s["name"] for s in c.JupyterHub.services] == ["gpu-quota"] and entry["url"] == "http://127.0.0.1:12345"
    assert c.Spawner.environment == {SERVICE_URL_ENV: "http://127.0.0.1:12345/services/gpu-quota/"}
    by_name = roles(c)
    # Users and their servers' tokens may reach the service; the hub's default scopes of both roles stay.
    assert by_name["user"]["scopes"] == ["self", ACCESS]
    assert by_name["server"]["scopes"] == ["users:activity!user", "access:servers!server", ACCESS]
    assert set(by_name["gpu-quota-service"]["scopes"]) >= {"read:users", "read:groups"}


def test_what_the_admin_set_is_kept_and_extended():
    c = Config()
    c.Spawner.environment = {"TZ": "UTC"}
    c.Spawner.server_token_scopes = ["users:activity!user"]
    c.JupyterHub.load_roles = [
        {"name": "user", "scopes": ["self", "read:groups"]},
        {"name": "teachers", "scopes": [], "users": ["t"]},
    ]
    configure_host_service(
        c, name="quota", port=1, server_url="http://hub.internal:1/services/quota/", admin_roles=["teachers"]
    )
    configure_host_service(
        c, name="quota", port=1, server_url="http://hub.internal:1/services/quota/", admin_roles=[]
    )  # twice: no duplicates
    access = "access:services!service=quota"
    assert c.Spawner.environment == {"TZ": "UTC", SERVICE_URL_ENV: "http://hub.internal:1/services/quota/"}
    assert c.Spawner.server_token_scopes == ["users:activity!user", access]
    by_name = roles(c)
    assert by_name["user"]["scopes"] == ["self", "read:groups", access]
    assert "custom:gpu-quota:admin" in by_name["teachers"]["scopes"]
    assert [s["name"] for s in c.JupyterHub.services] == ["quota"]


def test_a_bad_mapping_stops_the_hub_and_changes_nothing():
    c = Config()
    with pytest.raises(PolicyError, match="lots"):
        configure_host_service(c, default={"default_cap": "lots"})
    assert "services" not in c.JupyterHub and "environment" not in c.Spawner
