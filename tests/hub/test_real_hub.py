"""Issue 6: per-user caps set in a real JupyterHub's config reach each user's kernels.

A real `jupyterhub` (PyPI) with a real configurable-http-proxy (npm), on loopback, spawning real
single-user servers with SimpleLocalProcessSpawner. The hub's config calls the extension's helper,
`gpu_quota_ext.hub.configure_hub_caps`: alice gets her caps from the helper's group mapping, bob from
his JupyterHub group's properties. Each starts a server and a kernel through the hub's REST API and
proxy, the way JupyterLab would, and we look at what each kernel got and what `%gpucap` answers.

Install what it needs with `bash tests/hub/setup.sh` (CI does, before pytest).
"""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

from gpu_quota_ext.shared.sizes import GiB

from .hubtools import Hub

TOTAL = 80 * GiB




SINGLE_USER_CONFIG = """
# The users' servers: the extension on, one 80 GiB static device (CI has no GPU).
c.ServerApp.jpserver_extensions = {"gpu_quota_ext": True}
c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"
c.StaticInventory.devices = [{"name": "Hub test GPU", "total": "80GiB"}]
"""

HUB_CONFIG = """
c.Spawner.args = ["--allow-root", "--config={single_user_config}"]
c.JupyterHub.load_groups = {{
    "gpu-staff": {{"users": ["alice"]}},
    # Caps as JupyterHub group properties (editable live with PUT /hub/api/groups/students/properties).
    "students": {{"users": ["bob"], "properties": {{"gpu_quota": {{"default_cap": "0.1", "max_cap": "0.2"}}}}}},
}}

from gpu_quota_ext.hub import configure_hub_caps

configure_hub_caps(
    c,
    default={{"on_over_max": "refuse"}},
    groups={{"gpu-staff": {{"default_cap": "0.5", "max_cap": "0.75"}}}},
)
"""

# What each user's kernel must get on the 80 GiB device.
EXPECTED = {
    "alice": {"cap": int(0.5 * TOTAL), "max_cap": int(0.75 * TOTAL)},
    "bob": {"cap": int(0.1 * TOTAL), "max_cap": int(0.2 * TOTAL)},
}

SHOW_ENV = (
    "import os, json; print(json.dumps({n: os.environ.get(n) for n in ['GPU_QUOTA_DEVICES', 'JUPYTERHUB_USER']}))"
)


@pytest.mark.timeout(150)
def test_each_users_kernel_carries_its_own_cap_and_gpucap_above_max_is_refused(setup_ok, tmp_path):
    single_user_config = tmp_path / "single_user_config.py"
    single_user_config.write_text(SINGLE_USER_CONFIG)
    hub = Hub(tmp_path, textwrap.dedent(HUB_CONFIG.format(single_user_config=single_user_config)))
    hub.start()
    try:
        asyncio.run(_scenario(hub))
    except BaseException:
        print("---- jupyterhub log (tail) ----\n" + hub.log_tail())
        raise
    finally:
        hub.stop()


async def _scenario(hub: Hub) -> None:
    await hub.wait_until_up()
    users = ("alice", "bob")
    # Both servers spawn at once, as on a real hub at 9 am.
    await asyncio.gather(*(hub.start_server(user) for user in users))
    await asyncio.gather(*(hub.wait_for_server(user) for user in users))
    tokens = {user: await hub.user_token(user) for user in users}

    kernels = {}
    for user in users:
        _, kernel = await hub.api("POST", f"/user/{user}/api/kernels", {"name": "python3"}, token=tokens[user])
        kernels[user] = kernel["id"]
    # On IPC sockets, as every test's kernel (tests/kernel_transport.py).
    assert {k: hub.kernel_transports().get(k) for k in kernels.values()} == {k: "ipc" for k in kernels.values()}

    for user in users:
        token, kernel_id, want = tokens[user], kernels[user], EXPECTED[user]
        # The server's ledger (what the sidebar shows) ...
        _, grant = await hub.api("GET", f"/user/{user}/api/gpu-quota/kernels/{kernel_id}", token=token)
        assert grant["user"] == user
        assert [(d["cap"], d["max_cap"]) for d in grant["devices"]] == [(want["cap"], want["max_cap"])], grant
        # ... and the kernel's own process agree.
        ran = await hub.execute(user, token, kernel_id, SHOW_ENV)
        assert ran["status"] == "ok", ran
        env = json.loads(ran["stdout"].strip().splitlines()[-1])
        assert env["JUPYTERHUB_USER"] == user
        (device,) = json.loads(env["GPU_QUOTA_DEVICES"])
        assert (device["cap"], device["max_cap"]) == (want["cap"], want["max_cap"])

    # A user cannot see another user's kernel: the hub's proxy and auth keep servers apart.
    await hub.api(
        "GET", f"/user/alice/api/gpu-quota/kernels/{kernels['alice']}", token=tokens["bob"], ok=(302, 403, 404)
    )

    # bob asks for more than his group's max_cap (0.2): the hub set on_over_max=refuse, so it is refused,
    # by the server his kernel reached on loopback under the hub's /user/bob/ prefix.
    ran = await hub.execute("bob", tokens["bob"], kernels["bob"], "%gpucap 0.5")
    assert ran["status"] == "ok", ran
    assert "refused by the server" in ran["stderr"], ran
    _, grant = await hub.api("GET", f"/user/bob/api/gpu-quota/kernels/{kernels['bob']}", token=tokens["bob"])
    assert grant["devices"][0]["cap"] == EXPECTED["bob"]["cap"]

    # Within his max_cap, the same magic is granted and the ledger changes.
    ran = await hub.execute("bob", tokens["bob"], kernels["bob"], "%gpucap 0.15")
    assert ran["status"] == "ok", ran
    assert "granted" in ran["stdout"], ran
    _, grant = await hub.api("GET", f"/user/bob/api/gpu-quota/kernels/{kernels['bob']}", token=tokens["bob"])
    assert grant["devices"][0]["cap"] == int(0.15 * TOTAL)

    # alice's max_cap (0.75) is hers: 0.7 is granted to her where bob's 0.5 was refused.
    ran = await hub.execute("alice", tokens["alice"], kernels["alice"], "%gpucap 0.7")
    assert "granted" in ran["stdout"], ran
    _, grant = await hub.api("GET", f"/user/alice/api/gpu-quota/kernels/{kernels['alice']}", token=tokens["alice"])
    assert grant["devices"][0]["cap"] == int(0.7 * TOTAL)
