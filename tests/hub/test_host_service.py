"""Issue 14: the host quota service under a real JupyterHub and configurable-http-proxy.

The hub starts `gpu_quota_ext.hub.service` as a hub-managed service (its own role, the admin scope);
every call below goes through the hub's proxy to /services/gpu-quota/ with a token the hub issued.
Users alice and bob hold grants on one 80 GiB device (budget 80 GiB, each kernel 0.5 of it by the
hub's mapping, a full host refuses); carol is a hub admin. The user-server side (RemoteLedger) is not
here: tests/hub/test_host_service_e2e.py starts kernels through it.

Install what it needs with `bash tests/hub/setup.sh`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
import time

import pytest
from tornado.httpclient import AsyncHTTPClient

from gpu_quota_ext.shared.service_contract import (
    GRANTS_PATH,
    LEASE_PATH,
    METRICS_PATH,
    STATUS_PATH,
)
from gpu_quota_ext.shared.sizes import GiB

from .hubtools import Hub
from .quota_service import quota_service_config

LEASE = 4.0  # seconds: short, so that a server that stops renewing loses its grants within the test




@pytest.mark.timeout(200)
def test_one_budget_for_every_user_of_the_hub(setup_ok, tmp_path):
    lines, service = quota_service_config(
        tmp_path,
        default={"default_cap": "0.5", "max_cap": "1.0", "on_full": "refuse"},
        groups={"small": {"default_cap": "0.25", "max_cap": "0.25"}},
        # start_grace: a renewal sent while a grant is on its way does not list it yet; it must not release it.
        # idle_held "keep": the servers here are this test, whose leases name no process; their grants stay,
        # shown as idle-held (tests/hub/test_host_service_trust.py: released, the default).
        settings={"lease_seconds": LEASE, "start_grace": 3.0, "idle_held": "keep"},
        admin_roles=["hub-test-admin"],
    )
    hub = Hub(tmp_path, textwrap.dedent(lines) + '\nc.Authenticator.admin_users = {"carol"}\n')
    hub.start()
    try:
        asyncio.run(_scenario(hub, service))
    except BaseException:
        print("---- jupyterhub log (tail) ----\n" + hub.log_tail(12000))
        raise
    finally:
        hub.stop()
    assert service.pid() is None  # the hub stopped its service with itself


async def _until(check, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = await check()
            if last:
                return last
        except (AssertionError, ConnectionError) as error:
            last = error
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what} not met within {timeout} s; last: {last!r}")


async def _scenario(hub: Hub, service) -> None:
    await hub.wait_until_up()
    for user in ("alice", "bob", "carol", "dana"):
        await hub.api("POST", f"/hub/api/users/{user}", ok=(201, 409))
    await hub.api("POST", "/hub/api/groups/small", {"users": ["dana"]})
    tokens = {user: await hub.user_token(user) for user in ("alice", "bob", "carol", "dana")}
    grants, status = service.path(GRANTS_PATH), service.path(STATUS_PATH)

    async def call(method, path, user, body=None, ok=(200, 201, 204)):
        if user == "":  # no token at all
            response = await AsyncHTTPClient().fetch(hub.url + path, follow_redirects=False, raise_error=False)
            assert response.code in ok, (response.code, response.body[:500])
            assert "/hub/api/oauth2/authorize" in response.headers.get("Location", ""), response.headers
            return response.code, None
        return await hub.api(method, path, body, token=tokens[user] if user in tokens else user, ok=ok)

    await _until(lambda: call("GET", status, "alice"), what="the service answering through the proxy")

    # Leases: alice's and bob's servers renew theirs, as a user server does, listing what they run.
    running = {"alice": set(), "bob": set()}

    async def renew_forever():
        while True:
            for user, kernels in running.items():
                try:
                    await call(
                        "POST",
                        service.path(LEASE_PATH),
                        user,
                        {"server": "", "kernels": [{"kernel_id": k, "pids": []} for k in kernels]},
                    )
                except (AssertionError, ConnectionError):
                    pass  # the service restarting: a server tries again at its next renewal, so does this
            await asyncio.sleep(LEASE / 4)

    renewer = asyncio.ensure_future(renew_forever())
    try:
        # Six kernel starts at once from two users on a host that holds two: two granted, four refused.
        async def start(user, kernel_id):
            code, data = await call(
                "POST",
                grants,
                user,
                {"server": "", "kernel_id": kernel_id, "kernelspec": "python3", "allowed": None},
                ok=(201, 409),
            )
            if code == 201:
                running[user].add(kernel_id)
            return code, data

        answers = await asyncio.gather(*(start(user, f"{user}-{i}") for i in range(3) for user in ("alice", "bob")))
        codes = sorted(code for code, _ in answers)
        assert codes == [201, 201, 409, 409, 409, 409], answers
        refused = [data["message"] for code, data in answers if code == 409]
        # A user's second kernel passes their user_budget (half the device) before the device's budget is full.
        assert all("no GPU has" in m or "(user_budget 0.5)" in m for m in refused), refused
        assert any("no GPU has" in m for m in refused) or sorted(len(k) for k in running.values()) == [1, 1], refused
        _, admin_view = await call("GET", status, "carol")
        (device,) = admin_view["devices"]
        assert device["granted"] == 80 * GiB <= device["budget"]

        mine = {user: sorted(running[user]) for user in ("alice", "bob")}
        holder = "alice" if mine["alice"] else "bob"
        other = "bob" if holder == "alice" else "alice"
        kernel = mine[holder][0]
        _, own = await call("GET", f"{grants}/{kernel}", holder)
        assert own["grant"]["user"] == holder and own["grant"]["devices"][0]["uuid"] == "GPU-hubtest-0"

        # Another user's kernel: 403 for every verb, nothing changed; an unknown one: 404.
        for method, body in (("GET", None), ("PUT", {"cap": "0.1"}), ("DELETE", None)):
            code, answer = await call(method, f"{grants}/{kernel}", other, body, ok=(403,))
            assert kernel in answer["message"]
        await call("POST", grants, other, {"server": "", "kernel_id": kernel, "kernelspec": "python3"}, ok=(403,))
        await call("GET", f"{grants}/no-such-kernel", holder, ok=(404,))
        _, again = await call("GET", f"{grants}/{kernel}", holder)
        assert again == own
        # Bad bodies: 400; a huge one: 413; no token: 401; a token the hub does not know: 403.
        await call("PUT", f"{grants}/{kernel}", holder, {"cap": "lots"}, ok=(400,))
        await call("POST", grants, holder, {"kernel_id": "../x", "server": "", "kernelspec": "p"}, ok=(400,))
        await call("POST", service.path(LEASE_PATH), holder, {"server": "", "kernels": "all"}, ok=(400,))
        await call("PUT", f"{grants}/{kernel}", holder, {"cap": "0.1", "pad": "x" * (70 * 1024)}, ok=(413,))
        await call("GET", status, "not-a-token", ok=(403,))
        await call(
            "GET", f"{grants}/{kernel}?token={tokens[other]}", other, ok=(403,)
        )  # a token in a URL is logged nowhere

        # Each user sees their own grants; the hub admin (carol) and the admin-scoped service see all.
        _, listed = await call("GET", grants, holder)
        assert {g["user"] for g in listed["grants"]} == {holder}
        _, listed = await call("GET", grants, other)
        assert all(g["user"] == other for g in listed["grants"])
        for admin in ("carol", hub.admin_token):
            _, listed = await call("GET", grants, admin)
            assert sorted(g["kernel_id"] for g in listed["grants"]) == sorted(mine["alice"] + mine["bob"])
        # A service may look with the admin scope, never hold a grant.
        await call(
            "POST", grants, hub.admin_token, {"server": "", "kernel_id": "svc-0", "kernelspec": "python3"}, ok=(403,)
        )
        _, seen = await call("GET", status, other)
        assert all(k["user"] == other for k in seen["kernels"]) and [u["name"] for u in seen["users"]] == [other]
        await call("GET", service.path(METRICS_PATH), other, ok=(403,))
        _, metrics = await call("GET", service.path(METRICS_PATH), "carol")
        assert (
            f'gpu_quota_host_kernel_cap_bytes{{device="GPU-hubtest-0",kernel_id="{kernel}",user="{holder}"}}' in metrics
        )

        # The admin's page: behind the hub's OAuth (a browser without a login is sent to the hub) ...
        code, _ = await call("GET", service.prefix, "", ok=(302,))
        # ... every user's kernels for the admin, one's own for a user.
        _, page = await call("GET", service.prefix, "carol")
        assert all(f"<td>{k}</td>" in page for k in mine["alice"] + mine["bob"]), page
        _, page = await call("GET", service.prefix, other)
        assert f"<td>{kernel}</td>" not in page and "your kernels only" in page

        # Caps come from the hub's mapping by the user's hub group: dana (group "small") gets 0.25;
        # the budget is full, and "small" does not say refuse, so the default's refuse applies.
        await call("POST", grants, "dana", {"server": "", "kernel_id": "dana-0", "kernelspec": "python3"}, ok=(409,))
        # The holder lowers their cap: room for dana's quarter.
        _, changed = await call("PUT", f"{grants}/{kernel}", holder, {"cap": "0.25"})
        assert changed["status"] == "granted" and changed["grant"]["devices"][0]["cap"] == 20 * GiB
        _, dana = await call(
            "POST", grants, "dana", {"server": "dana-srv", "kernel_id": "dana-0", "kernelspec": "python3"}
        )
        assert dana["grant"]["devices"][0]["cap"] == 20 * GiB and "group 'small'" in dana["grant"]["source"]
        # dana's server never renews its lease: within the lease, her grant is released.
        await _until(
            lambda: _gone(call, f"{grants}/dana-0", "dana"),
            timeout=LEASE * 4,
            what="dana's expired lease releasing her grant",
        )

        # Kept though no process of theirs ever held them (idle_held "keep"): shown as idle-held.
        async def shown_idle_held():
            _, seen = await call("GET", status, "carol")
            return seen["kernels"] and all(k["idle_held"] for k in seen["kernels"])

        await _until(shown_idle_held, timeout=LEASE * 4, what="grants no process held shown as idle-held")
        _, page = await call("GET", service.prefix, "carol")
        assert "idle-held" in page

        # The service restarted (killed: the hub starts it again) keeps every grant, caps as changed.
        _, before = await call("GET", grants, "carol")
        old_pid = service.pid()
        os.kill(old_pid, signal.SIGKILL)
        await _until(lambda: _new_pid(service, old_pid), what="the hub restarting its service")
        _, after = await _until(lambda: call("GET", grants, "carol"), what="the restarted service answering")
        assert sorted(after["grants"], key=lambda g: g["kernel_id"]) == sorted(
            before["grants"], key=lambda g: g["kernel_id"]
        )

        # A kernel its server no longer lists is released at the server's next renewal.
        running[holder].discard(kernel)
        await _until(
            lambda: _gone(call, f"{grants}/{kernel}", holder), timeout=LEASE * 4, what="the unlisted kernel released"
        )
    finally:
        renewer.cancel()
    # No user's token in any log (the hub's, the proxy's and the service's all go to the hub's log).
    log = hub.log_path.read_text(errors="replace")
    assert not [user for user, token in tokens.items() if token in log]
    # Nothing secret on disk: no token of the hub's, the service's or a user's in the state directory.
    state = b"".join(p.read_bytes() for p in service.state_dir.iterdir())
    for token in list(tokens.values()) + [hub.admin_token]:
        assert token.encode() not in state


async def _gone(call, path, user):
    code, _ = await call("GET", path, user, ok=(200, 404))
    return code == 404


async def _new_pid(service, old_pid):
    pid = service.pid()
    return pid is not None and pid != old_pid
