"""The service's web app without a hub: what a caller gets when it has no token, or when the hub that
must check the token does not answer. (With a real hub: tests/hub/test_host_service.py.)"""

import asyncio
import concurrent.futures
import json
import time
from dataclasses import replace

import pytest
from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from gpu_quota_ext.hub.service import app as service_app
from gpu_quota_ext.hub.service.app import GpuQuotaService
from gpu_quota_ext.hub.service.auth import Who
from gpu_quota_ext.hub.service.user_policy import user_policy
from gpu_quota_ext.ledger import AdmissionRefused
from gpu_quota_ext.ledger.remote import RemoteLedger
from gpu_quota_ext.shared.service_contract import GRANTS_PATH, STATUS_PATH
from gpu_quota_ext.shared.sizes import parse_cap
from tests.hub.hubtools import listen_here

from .host_service import service_config


def test_no_token_is_401_and_a_hub_that_does_not_answer_is_503_with_nothing_granted(service):
    async def scenario():
        server, port = listen_here(service.web_app("/services/gpu-quota/"))
        try:
            base = f"http://127.0.0.1:{port}/services/gpu-quota/"
            client = AsyncHTTPClient()
            answer = await client.fetch(base + STATUS_PATH, raise_error=False)
            assert answer.code == 401 and "hub token" in json.loads(answer.body)["message"]
            body = json.dumps({"server": "", "kernel_id": "k1", "kernelspec": "python3"})
            answer = await client.fetch(
                base + GRANTS_PATH, method="POST", body=body, headers={"Authorization": "token abc"}, raise_error=False
            )
            assert answer.code == 503 and "hub did not answer" in json.loads(answer.body)["message"]
        finally:
            server.stop()

    asyncio.run(scenario())
    assert service.book.owned() == []


def test_a_token_not_given_access_to_the_service_is_403_before_anything_else(service, monkeypatch):
    """As HubAuthenticated checks hub_scopes: the token's own scopes must include access to this service (any
    user's or service's token is not enough); the admin scope alone is not access."""
    from tornado.web import HTTPError

    monkeypatch.setenv("JUPYTERHUB_SERVICE_NAME", "gpu-quota")
    service.connect_hub()  # HubAuth reads its access scopes from the hub-given environment

    async def who(scopes, kind="user"):
        return await service.who_for_model({"kind": kind, "name": "bob", "scopes": scopes})

    for scopes, kind in (
        (["read:users:name!user=bob"], "user"),  # as the hub expands the token's read:users:name!user
        (["read:users:name!user"], "user"),  # unexpanded: not a scope the hub's parser reads
        (["access:services!service=another"], "user"),
        (["custom:gpu-quota:admin"], "service"),
    ):
        with pytest.raises(HTTPError) as refused:
            asyncio.run(who(scopes, kind))
        assert refused.value.status_code == 403 and "access:services!service=gpu-quota" in refused.value.log_message
    # With access, the next question is the hub's (down here: 503), so the scope check let it through.
    for scopes in (["access:services!service=gpu-quota"], ["access:services"]):
        with pytest.raises(HTTPError) as asked:
            asyncio.run(who(scopes))
        assert asked.value.status_code == 503, scopes


def test_a_start_its_server_gave_up_on_is_not_granted_when_the_hung_service_resumes(service, monkeypatch):
    """A service that hung (SIGSTOP) still has the requests queued meanwhile in its socket's backlog when it
    resumes. The start its server gave up on (refused: "unreachable") must not be granted then: nobody would hold
    that grant, yet it would count in the user's limits. Here the service's socket listens but nothing accepts,
    as in a stopped process, while a real RemoteLedger tries its start; then the service serves the backlog."""

    async def identify(handler):  # the hub's answer for alice's token, without a hub
        return Who("alice", False, {"kind": "user", "name": "alice"})

    async def policy_for(name, directory=None):
        return user_policy(service.caps, service.host_policy, name, [], service.limits)

    monkeypatch.setattr(service, "identify", identify)
    monkeypatch.setattr(service.policies, "policy_for", policy_for)
    answered = []  # (status, method, path) of every request the service answered
    monkeypatch.setattr(
        service_app, "_access_log", lambda h: answered.append((h.get_status(), h.request.method, h.request.path))
    )

    def grant_posts():
        return [code for code, method, path in answered if method == "POST" and path.endswith(GRANTS_PATH)]

    async def scenario():
        sockets = bind_sockets(0, "127.0.0.1")  # listening: the kernel queues connections; nothing accepts
        port = sockets[0].getsockname()[1]
        server = HTTPServer(service.web_app("/services/gpu-quota/"))
        url = f"http://127.0.0.1:{port}/services/gpu-quota/"
        ledger = RemoteLedger(service.devices, url, "alice-token", call_timeout=0.5, start_retries=1, retry_delay=0.01)
        try:
            with pytest.raises(AdmissionRefused, match="is unreachable: timed out"):
                await asyncio.to_thread(ledger.grant, "k1", "alice", "python3", None)
            server.add_sockets(sockets)  # the service resumes
            deadline = time.monotonic() + 30
            while len(grant_posts()) < 2:  # the start's two tries, both queued
                assert time.monotonic() < deadline, f"the queued grant requests were not answered: {answered}"
                await asyncio.sleep(0.02)
            assert grant_posts() == [499, 499]
            assert service.book.owned() == []
            # A caller that waits is served: the next start is granted, and nothing else is held.
            granted = await asyncio.to_thread(ledger.grant, "k2", "alice", "python3", None)
            assert granted.devices == (0,)
            assert [o.grant.kernel_id for o in service.book.owned()] == ["k2"]
        finally:
            await asyncio.to_thread(ledger.close)
            server.stop()

    asyncio.run(scenario())


def test_a_cap_change_its_server_gave_up_on_is_not_made_when_the_blocked_service_resumes(service, monkeypatch):
    """The service's loop blocked (a stalled disk) while a server asks for a cap change: the server gives up and
    tells its user the cap stays; the service, running again, must not change it behind their back."""

    async def identify(handler):
        return Who("alice", False, {"kind": "user", "name": "alice"})

    async def policy_for(name, directory=None):
        return user_policy(service.caps, service.host_policy, name, [], service.limits)

    monkeypatch.setattr(service, "identify", identify)
    monkeypatch.setattr(service.policies, "policy_for", policy_for)
    answered = []
    monkeypatch.setattr(
        service_app, "_access_log", lambda h: answered.append((h.get_status(), h.request.method, h.request.path))
    )

    async def scenario():
        server, port = listen_here(service.web_app("/services/gpu-quota/"))
        url = f"http://127.0.0.1:{port}/services/gpu-quota/"
        ledger = RemoteLedger(service.devices, url, "alice-token", call_timeout=0.5, renew_every=3600)
        try:
            granted = await asyncio.to_thread(ledger.grant, "k1", "alice", "python3", None)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                change = pool.submit(ledger.change, "k1", parse_cap("0.1"))
                outcome = change.result(timeout=30)  # the loop blocked here until the server gave up
            assert outcome.status == "refused" and "unreachable" in outcome.message, outcome
            deadline = time.monotonic() + 30
            while not [code for code, method, _ in answered if method == "PUT"]:
                assert time.monotonic() < deadline, f"the queued cap change was not answered: {answered}"
                await asyncio.sleep(0.02)
            assert [code for code, method, _ in answered if method == "PUT"] == [499]
            (held,) = service.book.owned()
            assert held.grant.caps == granted.caps == ledger.get("k1").caps
        finally:
            await asyncio.to_thread(ledger.close)
            server.stop()

    asyncio.run(scenario())


def test_a_lease_does_not_run_out_for_the_time_the_service_itself_did_not_run(service):
    """A service stopped (SIGSTOP) or blocked longer than a lease: on resuming, its first expiry check must not
    release every server's grants for renewals it could not take (they may wait in its backlog); each lease
    gets a full period from then, as after a restart. A server silent while the service ran still loses its."""
    policy = user_policy(service.caps, service.host_policy, "alice", [], service.limits)
    lease_seconds = service.book.lease_seconds
    service.book.grant("alice", "", "k1", "python3", policy, None, time.time() - lease_seconds - 5)
    service.expiry.every = 5.0
    service.expiry.last = time.monotonic() - 30  # the last check: 30 s ago, six periods
    service.expiry.tick()
    assert [o.grant.kernel_id for o in service.book.owned()] == ["k1"]
    (lease,) = service.book.leases()
    assert lease.expires >= time.time() + lease_seconds - 5
    # Checked on time, the same lease run out is the end of its grants.
    service.book.restore((), [replace(lease, expires=time.time() - 1)], 0)
    service.expiry.last = time.monotonic()
    service.expiry.tick()
    assert service.book.owned() == [] and service.book.leases() == []


def test_the_service_says_the_packages_version():
    # `jupyter gpu-quota service --version` printed traitlets' 0.0 before.
    import gpu_quota_ext
    from gpu_quota_ext.hub.service.app import GpuQuotaService

    assert GpuQuotaService.version == gpu_quota_ext.__version__


def test_each_host_sample_adds_a_point_to_the_users_history_and_a_user_sees_only_their_own(tmp_path):
    import os
    import pwd
    import time

    from gpu_quota_ext.devices.fake_nvml import FakeNvml
    from gpu_quota_ext.hub.service.user_policy import user_policy
    from gpu_quota_ext.shared.sizes import GiB

    app = GpuQuotaService(config=service_config(tmp_path, nvml_class="gpu_quota_ext.devices.fake_nvml.FakeNvml"))
    app.build()
    FakeNvml.reset()
    try:
        me = pwd.getpwuid(os.getuid()).pw_name  # this process is the user's kernel: its uid is the user's
        policy = user_policy(app.caps, app.host_policy, me, [], app.limits)
        app.book.grant(me, "", "k1", "python3", policy, None, time.time())
        app.book.lease(me, "", {"k1": (os.getpid(),)}, time.time())
        FakeNvml.set_usage(os.getpid(), "GPU-a", 3 * GiB)
        for _ in range(2):
            app.sampler._tick()  # one round of the sampler's thread, here
        (points,) = app.user_history(app.status_now(me, False)).values()
        assert len(points) == 2 and points[-1]["used"] == 3 * GiB and points[-1]["cap"] == 20 * GiB
        assert app.user_history(app.status_now("someone-else", False)) == {}
    finally:
        FakeNvml.reset()
        app.store.close()



def test_a_body_over_the_limit_or_not_json_is_refused_and_nothing_granted(service, monkeypatch):
    """The service's API keeps a body only up to 64 KiB, declared or chunked (413), and refuses one that is not
    JSON, however deep (400). The hub is down here: the token's owner is given."""
    from gpu_quota_ext.hub.service.auth import Who

    async def identify(handler):
        return Who("alice", False, {"kind": "user", "name": "alice"})

    monkeypatch.setattr(service, "identify", identify)
    grant = {"server": "", "kernel_id": "k1", "kernelspec": "python3"}

    async def scenario():
        server, port = listen_here(service.web_app("/services/gpu-quota/"))
        try:
            url = f"http://127.0.0.1:{port}/services/gpu-quota/{GRANTS_PATH}"
            client = AsyncHTTPClient()

            async def post(**request):
                answer = await client.fetch(url, method="POST", raise_error=False, **request)
                return answer.code, json.loads(answer.body or b"{}").get("message", "")

            code, message = await post(body=json.dumps({**grant, "pad": "x" * (70 * 1024)}))
            assert code == 413 and "64 KiB" in message

            async def chunks(write):
                for _ in range(70):
                    await write(b"x" * 1024)

            code, message = await post(body_producer=chunks)  # no Content-Length: chunked
            assert code == 413 and "64 KiB" in message
            for raw in (b'{"server": ', b"\xff", b"[" * 30_000 + b"]" * 30_000):
                assert await post(body=raw) == (400, "the body is not JSON"), raw[:10]
        finally:
            server.stop()

    asyncio.run(scenario())
    assert service.book.owned() == []


def test_the_host_brokers_settings_are_the_servers_rows_defaults_and_a_bad_one_is_one_line(tmp_path):
    from gpu_quota_ext.parking import ParkSettings
    from gpu_quota_ext.shared.sizes import PolicyError

    def service(**settings):
        app = GpuQuotaService(config=service_config(tmp_path, **settings))
        try:
            app.build()
        finally:
            store = getattr(app, "store", None)
            if store is not None:
                store.close()
        return app

    assert service().broker_settings == ParkSettings().broker
    chosen = service(park_min_idle="5min", park_wait_limit="off", park_device_margin="2GiB", park_host_margin="0")
    assert (chosen.broker_settings.min_idle, chosen.broker_settings.wait_limit) == (300.0, None)
    assert (chosen.broker_settings.device_margin, chosen.broker_settings.host_margin) == (2 << 30, 0)
    with pytest.raises(PolicyError) as refused:
        service(park_device_margin="lots")
    assert str(refused.value).startswith("c.GpuQuotaService.park_device_margin = 'lots': ")


def test_a_refused_call_keeps_its_connection_for_the_next_call_on_it(service):
    """The hub's proxy pools its connections to the service: a call refused (no token, 401) must not close the
    connection it came on, or the next user's call sent on it meets a reset (the proxy answers 503)."""

    async def scenario():
        server, port = listen_here(service.web_app("/services/gpu-quota/"))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            request = f"GET /services/gpu-quota/{STATUS_PATH} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
            answers = []
            for _ in range(2):  # the second call on the same connection, as a keep-alive pool sends it
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                lines = head.split(b"\r\n")
                length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
                await asyncio.wait_for(reader.readexactly(length), 10)
                answers.append(head.split(b"\r\n")[0])
            writer.close()
            assert answers == [b"HTTP/1.1 401 Unauthorized"] * 2, answers
        finally:
            server.stop()

    asyncio.run(scenario())
