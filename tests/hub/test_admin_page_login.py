"""Issue 19, item 4: a person signs in to the host service's admin page, on every JupyterHub major the
`[hub]` extra allows (tests/hub/hub_versions.py: the tests' own JupyterHub, and an environment of its own
for each other major, made by tests/hub/setup.sh).

A real JupyterHub with configurable-http-proxy on loopback, the service set up as an admin does
(configure_host_service), DummyAuthenticator (any password). A client that behaves as a browser
(tests/hub/browser.py: cookies on their paths, every redirect followed, the login form submitted with
its hidden fields) opens
/services/gpu-quota/ and goes the whole way: the service's redirect to the hub's OAuth authorize, the
hub's login page, the form, back through authorize to the service's oauth_callback (the code exchanged
for a token: JupyterHub 6 checks the PKCE code verifier there), to the page. No token is handed over by
the test: what the page shows comes from the login alone. The API side (hub tokens checked by HubAuth)
runs on the same hub.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest
import requests

from gpu_quota_ext.shared.service_contract import GRANTS_PATH, STATUS_PATH

from .browser import Browser, path_of, visited
from .hub_versions import allowed_majors, hub_requirement
from .hubtools import Hub
from .quota_service import quota_service_config

PASSWORD = secrets.token_hex(8)  # DummyAuthenticator takes any; a person types one all the same
# What an admin writes (configure_host_service: the service, its role, users' access to it), and logins.
HUB_CONFIG = """
from gpu_quota_ext.hub.service.configure import configure_host_service

configure_host_service(
    c, default={{"default_cap": "0.25", "max_cap": "0.5"}}, port={port}, args=["--config={service_config}"]
)

c.JupyterHub.authenticator_class = "jupyterhub.auth.DummyAuthenticator"
c.Authenticator.allowed_users = {{"alice", "bob"}}
c.Authenticator.admin_users = {{"carol"}}
# After a plain sign-in the hub's home page, not a spawned server: this test needs no user server.
c.JupyterHub.redirect_to_server = False
"""


def _token(token: str) -> dict:
    return {"Authorization": f"token {token}"}


def _until_answers(url: str, token: str, timeout: float = 40.0) -> None:
    """The hub starts its service and adds its route: wait for the service's answer through the proxy."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = requests.get(url, headers=_token(token), timeout=5)
            if last.status_code == 200:
                return
        except requests.ConnectionError as error:
            last = error
        time.sleep(0.2)
    raise AssertionError(f"the service did not answer at {url} within {timeout} s; last: {last!r}")


@pytest.mark.parametrize("hub_version", allowed_majors(hub_requirement()), indirect=True, ids="jupyterhub{}".format)
@pytest.mark.timeout(180)
def test_a_person_signs_in_to_the_admin_page(hub_version, tmp_path):
    # The service's own settings; no server renews a lease here: the grants must outlive the test.
    _, service = quota_service_config(tmp_path, settings={"lease_seconds": 600.0, "start_grace": 600.0})
    config = HUB_CONFIG.format(port=service.port, service_config=service.config_path)
    hub = Hub(tmp_path, config, python=hub_version.python)
    hub.start()
    try:
        _scenario(hub, service, hub_version.major)
    except BaseException:
        print("---- jupyterhub log (tail) ----\n" + hub.log_tail(12000))
        raise
    finally:
        hub.stop()
    log = hub.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-6000:]
    assert service.pid() is None


async def _hub_ready(hub: Hub) -> tuple:
    """(the hub's version, a hub token of alice's and of bob's)."""
    await hub.wait_until_up()
    _, info = await hub.api("GET", "/hub/api/")
    for user in ("alice", "bob", "carol"):
        await hub.api("POST", f"/hub/api/users/{user}", ok=(201, 409))
    return info["version"], {user: await hub.user_token(user) for user in ("alice", "bob")}


def _scenario(hub: Hub, service, major: int) -> None:
    version, tokens = asyncio.run(_hub_ready(hub))
    assert int(version.split(".")[0]) == major, version  # the hub this run is about
    api = hub.url + service.prefix
    _until_answers(api + STATUS_PATH, tokens["alice"])

    # The API side: a user's hub token gets a grant of its own; HubAuth tells a bad token from none.
    kernels = {}
    for user in ("alice", "bob"):
        kernels[user] = f"{user}-kernel-{secrets.token_hex(3)}"
        answer = requests.post(
            api + GRANTS_PATH, headers=_token(tokens[user]), timeout=10,
            json={"server": "", "kernel_id": kernels[user], "kernelspec": "python3", "allowed": None},
        )
        assert answer.status_code == 201, answer.text
        assert answer.json()["grant"]["user"] == user
    theirs = requests.get(f"{api}{GRANTS_PATH}/{kernels['alice']}", headers=_token(tokens["bob"]), timeout=10)
    assert theirs.status_code == 403, theirs.text
    assert requests.get(api + STATUS_PATH, headers=_token("not-a-hub-token"), timeout=10).status_code == 403
    assert requests.get(api + STATUS_PATH, timeout=10).status_code == 401

    # Signed out: the page sends the browser to the hub's OAuth, and the hub to its login page.
    alice = Browser(hub.url)
    login = alice.open(service.prefix)
    assert login.status_code == 200 and path_of(login.url) == "/hub/login", visited(login)
    assert "/hub/api/oauth2/authorize" in visited(login)
    assert 'name="username"' in login.text and kernels["alice"] not in login.text

    # alice signs in there: back through authorize and the service's callback to the page, her kernels only.
    landed = alice.submit_login(login, "alice", PASSWORD)
    assert landed.status_code == 200, (visited(landed), landed.text[:2000])
    assert path_of(landed.url) == service.prefix, visited(landed)
    assert service.prefix + "oauth_callback" in visited(landed)
    assert "GPU quota of this host" in landed.text and "alice (your kernels only)" in landed.text
    assert f"<td>{kernels['alice']}</td>" in landed.text and kernels["bob"] not in landed.text
    # The login is kept: the next visit is the page at once.
    again = alice.open(service.prefix)
    assert again.status_code == 200 and not again.history and "alice (your kernels only)" in again.text

    # The callback address alice's login went through, replayed by another browser: refused, no login.
    callback = next(r.url for r in landed.history if path_of(r.url) == service.prefix + "oauth_callback")
    assert "code=" in callback and "state=" in callback
    replayed = Browser(hub.url).session.get(callback, allow_redirects=False, timeout=10)
    assert replayed.status_code == 403 and "oauth state does not match" in replayed.text, replayed.text
    forged = Browser(hub.url).open(service.prefix + "oauth_callback?code=forged&state=forged")
    assert forged.status_code == 403 and "GPU quota of this host" not in forged.text

    # carol, a hub admin, signs in at the hub first, then opens the page: every user's kernels.
    carol = Browser(hub.url)
    home = carol.submit_login(carol.open("/hub/login"), "carol", PASSWORD)
    assert home.status_code == 200 and path_of(home.url) == "/hub/home", visited(home)
    admin = carol.open(service.prefix)
    assert admin.status_code == 200 and path_of(admin.url) == service.prefix, visited(admin)
    callback_path = service.prefix + "oauth_callback"
    assert visited(admin) == [service.prefix, "/hub/api/oauth2/authorize", callback_path, service.prefix]
    assert "carol (admin: every user)" in admin.text
    assert all(f"<td>{kernel}</td>" in admin.text for kernel in kernels.values()), admin.text

    # Each login is its own: alice's browser still sees hers only.
    assert kernels["bob"] not in alice.open(service.prefix).text
