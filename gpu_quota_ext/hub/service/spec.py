"""What jupyterhub_config.py needs to run the service under the hub: its `c.JupyterHub.services` entry,
its role (the scopes it needs of the hub) and the custom admin scope. Pure: builds dicts, imports no hub.

    from gpu_quota_ext.hub.service.spec import register_service
    register_service(c, default={"default_cap": "0.25"}, groups={"staff": {"max_cap": "0.5"}})
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ...shared.env_vars import SERVICE_CAPS as CAPS_ENV
from ...shared.service_contract import ADMIN_SCOPE, SERVICE_NAME
from ..caps import HOST_KEYS, hub_caps

# What the service asks the hub: who owns a token (no scope needed), a user's admin flag and groups,
# a group's properties.
SERVICE_SCOPES = ["read:users", "read:groups"]


def service_entry(
    name: str = SERVICE_NAME,
    port: int = 10101,
    users: Optional[Mapping[str, Any]] = None,
    groups: Optional[Mapping[str, Any]] = None,
    default: Optional[Mapping[str, Any]] = None,
    args: Sequence[str] = (),
    environment: Optional[Mapping[str, str]] = None,
    python: str = sys.executable,
) -> Dict[str, Any]:
    """A hub-managed service entry. The caps mapping is validated here (a bad one stops the hub at start)
    and handed to the service in its environment; `args` are more `--GpuQuotaService.NAME=VALUE`."""
    hub_caps(users=users, groups=groups, default=default, extra_keys=HOST_KEYS)
    env = dict(environment or {})
    env[CAPS_ENV] = json.dumps({"users": users or {}, "groups": groups or {}, "default": default or {}})
    return {
        "name": name,
        "url": f"http://127.0.0.1:{port}",
        "command": [python, "-m", "gpu_quota_ext.hub.service.app", *args],
        "environment": env,
        "oauth_no_confirm": True,
        "oauth_client_allowed_scopes": [ADMIN_SCOPE],
    }


def service_role(name: str = SERVICE_NAME) -> Dict[str, Any]:
    return {"name": f"{name}-service", "scopes": list(SERVICE_SCOPES), "services": [name]}


def admin_scope() -> Dict[str, Dict[str, str]]:
    return {ADMIN_SCOPE: {"description": "See and act on every user's GPU grants in the gpu-quota service"}}


def register_service(c, name: str = SERVICE_NAME, admin_roles: Sequence[str] = (), **entry: Any) -> Dict[str, Any]:
    """Add the service, its role and the admin scope to the hub's config `c` (keeping what is there).
    `admin_roles`: names of roles (defined in c.JupyterHub.load_roles) to give the admin scope to, and access
    to the service (the service accepts no token without it)."""
    hub = c.JupyterHub
    # Only what the config has set: an unset value is a lazy placeholder, not a list.
    existing = lambda key, empty: hub[key] if key in hub else empty  # noqa: E731
    service = service_entry(name=name, **entry)
    hub.services = [s for s in list(existing("services", [])) if s.get("name") != name] + [service]
    roles: List[dict] = [r for r in list(existing("load_roles", [])) if r.get("name") != f"{name}-service"]
    access = f"access:services!service={name}"
    for role in roles:
        if role.get("name") in admin_roles:
            kept = [scope for scope in role.get("scopes", []) if scope not in (ADMIN_SCOPE, access)]
            role["scopes"] = kept + [ADMIN_SCOPE, access]
    hub.load_roles = roles + [service_role(name)]
    hub.custom_scopes = {**dict(existing("custom_scopes", {})), **admin_scope()}
    return service
