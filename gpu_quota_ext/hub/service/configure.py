"""One call in jupyterhub_config.py that runs the host quota service and makes every user server ask it.

    from gpu_quota_ext.hub.service.configure import configure_host_service

    configure_host_service(c, default={"default_cap": "0.25", "max_cap": "0.5", "on_full": "refuse"})

It registers the service (spec.register_service: its entry, its role, the admin scope) and sets what the
user servers need: the service's URL in their environment ($GPU_QUOTA_SERVICE_URL, which makes their
ledger a RemoteLedger) and access to it for users' and servers' tokens. It lives with the
service, which imports hub/caps.py (the caps mapping's validation); hub/__init__ exports it. Pure: it only edits `c`.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional

from ...shared.env_vars import SERVICE_URL as SERVICE_URL_ENV
from ...shared.service_contract import SERVICE_NAME
from .spec import register_service


def configure_host_service(
    c,
    users: Optional[Mapping[str, Any]] = None,
    groups: Optional[Mapping[str, Any]] = None,
    default: Optional[Mapping[str, Any]] = None,
    name: str = SERVICE_NAME,
    port: int = 10101,
    args: Iterable[str] = (),
    admin_roles: Iterable[str] = (),
    server_url: Optional[str] = None,
) -> Dict[str, Any]:
    """For jupyterhub_config.py: run the host's GPU quota service and make every user server ask it.

    `users`, `groups`, `default` are the mapping configure_hub_caps takes; the service reads it (and the
    groups' properties) and decides every kernel's cap. Registers the service (a hub-managed
    `c.JupyterHub.services` entry listening on 127.0.0.1:`port`, its command `python -m
    gpu_quota_ext.hub.service.app` plus `args`, its role: read users and groups); gives users' tokens
    and their servers' tokens access to it (the `user` and `server` roles get
    `access:services!service=NAME`); and sets $GPU_QUOTA_SERVICE_URL in every server's environment
    (`server_url`, default the service's own URL and prefix: right for servers on the hub's host;
    containers need an address they can reach). `admin_roles`: roles that get the service's admin scope.
    Returns the service's entry.
    """
    entry = register_service(
        c,
        name=name,
        admin_roles=tuple(admin_roles),
        port=port,
        users=users,
        groups=groups,
        default=default,
        args=list(args),
    )
    access = f"access:services!service={name}"
    _add_scope_to_role(c, "user", ["self"], access)
    _add_scope_to_role(c, "server", ["users:activity!user", "access:servers!server"], access)
    if "server_token_scopes" in c.Spawner and isinstance(c.Spawner.server_token_scopes, (list, tuple)):
        # The admin chose the servers' token scopes: the hub uses those instead of the server role's.
        c.Spawner.server_token_scopes = [s for s in c.Spawner.server_token_scopes if s != access] + [access]
    environment = dict(c.Spawner.environment) if "environment" in c.Spawner else {}
    environment[SERVICE_URL_ENV] = server_url or entry["url"].rstrip("/") + f"/services/{name}/"
    c.Spawner.environment = environment
    return entry


def _add_scope_to_role(c, role_name: str, defaults: List[str], scope: str) -> None:
    """Add `scope` to a role of c.JupyterHub.load_roles, creating the role with the hub's own default
    scopes for it when the config does not define it (a role in load_roles replaces the default one)."""
    roles = list(c.JupyterHub.load_roles) if "load_roles" in c.JupyterHub else []
    for role in roles:
        if role.get("name") == role_name:
            role["scopes"] = [s for s in role.get("scopes", []) if s != scope] + [scope]
            break
    else:
        roles.append({"name": role_name, "scopes": defaults + [scope]})
    c.JupyterHub.load_roles = roles
