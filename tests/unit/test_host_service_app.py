"""The service's web app without a hub: what a caller gets when it has no token, or when the hub that
must check the token does not answer. (With a real hub: tests/hub/test_host_service.py.)"""

import asyncio
import json

import pytest
from tornado.httpclient import AsyncHTTPClient
from traitlets.config import Config

from gpu_quota_ext.hub.service.app import GpuQuotaService
from gpu_quota_ext.shared.service_contract import GRANTS_PATH, STATUS_PATH
from tests.hub.hubtools import free_port


@pytest.fixture
def service(tmp_path, monkeypatch):
    closed = free_port()  # nothing listens there: the hub is down
    monkeypatch.setenv("JUPYTERHUB_API_URL", f"http://127.0.0.1:{closed}/hub/api")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "service-token-for-the-test")
    monkeypatch.setenv("JUPYTERHUB_CLIENT_ID", "service-gpu-quota")
    config = Config()
    config.GpuQuotaService.state_dir = str(tmp_path / "state")
    config.GpuQuotaService.inventory_class = "gpu_quota_ext.devices.StaticInventory"
    config.StaticInventory.devices = [{"total": "80GiB", "uuid": "GPU-a"}]
    app = GpuQuotaService(config=config)
    app.build()
    app.connect_hub()
    yield app
    app.store.close()


def test_no_token_is_401_and_a_hub_that_does_not_answer_is_503_with_nothing_granted(service):
    async def scenario():
        port = free_port()
        server = service.web_app("/services/gpu-quota/").listen(port, "127.0.0.1")
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


def test_the_service_says_the_packages_version():
    # `jupyter gpu-quota service --version` printed traitlets' 0.0 before.
    import gpu_quota_ext
    from gpu_quota_ext.hub.service.app import GpuQuotaService

    assert GpuQuotaService.version == gpu_quota_ext.__version__


def test_a_body_over_the_limit_or_not_json_is_refused_and_nothing_granted(service, monkeypatch):
    """The service's API keeps a body only up to 64 KiB, declared or chunked (413), and refuses one that is not
    JSON, however deep (400). The hub is down here: the token's owner is given."""
    from gpu_quota_ext.hub.service.handlers import Who

    async def identify(handler):
        return Who("alice", False, {"kind": "user", "name": "alice"})

    monkeypatch.setattr(service, "identify", identify)
    grant = {"server": "", "kernel_id": "k1", "kernelspec": "python3"}

    async def scenario():
        port = free_port()
        server = service.web_app("/services/gpu-quota/").listen(port, "127.0.0.1")
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
