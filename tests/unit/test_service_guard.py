"""The service's per-user limits through its web app, without a hub (the hub's answer for each token is given):
a user over a limit gets 429 with Retry-After and nothing is done, another user is served meanwhile; made-up
tokens stop reaching the hub; a user's long polls are bounded; a listening socket out of file descriptors pauses
and says so in one line instead of a traceback per connection. (With a real hub:
tests/hub/test_host_service_trust.py.)"""

import asyncio
import errno
import json
import logging
import time

import pytest
from tornado import web
from tornado.ioloop import IOLoop

from gpu_quota_ext.hub.service import accept
from gpu_quota_ext.hub.service.app import GpuQuotaService
from gpu_quota_ext.hub.service.auth import Who
from gpu_quota_ext.hub.service.rate import OpenRequests
from gpu_quota_ext.shared.service_contract import GRANTS_PATH, LEASE_PATH, ROOM_PATH, STATUS_PATH

from .host_service import hub_down, hub_says, serve, service_config

USERS = {"bob-token": "bob", "carol-token": "carol"}


@pytest.fixture
def service(tmp_path, monkeypatch):
    hub_down(monkeypatch)
    config = service_config(tmp_path)
    config.GpuQuotaService.room_calls_per_second = 2.0
    config.GpuQuotaService.grant_calls_per_second = 2.0
    config.GpuQuotaService.failed_auth_per_second = 1.0
    config.GpuQuotaService.rate_burst_seconds = 5.0  # bursts of 10 calls, 5 failed authentications
    config.GpuQuotaService.max_long_polls = 2
    config.GpuQuotaService.refusal_hold_seconds = 0.0  # answered at once (holding: its own test)
    config.GpuQuotaService.lease_seconds = 8.0  # long polls wait at most 2 s
    app = GpuQuotaService(config=config)
    app.build()
    app.connect_hub()
    asked = []  # the tokens the "hub" was asked about

    async def identify(token):
        asked.append(token)
        if token not in USERS:
            raise web.HTTPError(403, "the hub does not know this token")
        return Who(USERS[token], False, {"kind": "user", "name": USERS[token]})

    hub_says(app, monkeypatch, identify)
    app.asked_hub = asked
    yield app
    app.store.close()


async def call(client, url, token, body=None, method="POST"):
    answer = await client.fetch(
        url,
        method=method,
        body=None if body is None else json.dumps(body),
        headers={"Authorization": f"token {token}"},
        raise_error=False,
        request_timeout=30,
    )
    return answer.code, answer.headers.get("Retry-After"), json.loads(answer.body or b"{}")


def room_body():
    return {"server": "", "park": [], "demands": []}


def test_a_user_flooding_room_calls_gets_429_with_retry_after_and_another_user_is_served(service, caplog):
    async def scenario(base, client):
        codes = [(await call(client, base + ROOM_PATH, "bob-token", room_body()))[0] for _ in range(10)]
        assert codes == [200] * 10  # the burst
        code, retry, data = await call(client, base + ROOM_PATH, "bob-token", room_body())
        assert code == 429 and retry == "1" and "too many room calls" in data["message"]
        assert "2 a second" in data["message"]
        # carol's calls are hers: served while bob waits
        assert (await call(client, base + ROOM_PATH, "carol-token", room_body()))[0] == 200
        grant = {"server": "", "kernel_id": "carol-k", "kernelspec": "python3"}
        assert (await call(client, base + GRANTS_PATH, "carol-token", grant))[0] == 201
        # bob's grants are another route: not refused for his room calls
        grant = {"server": "", "kernel_id": "bob-k", "kernelspec": "python3"}
        assert (await call(client, base + GRANTS_PATH, "bob-token", grant))[0] == 201
        for _ in range(20):
            code, retry, _ = await call(client, base + ROOM_PATH, "bob-token", room_body())
            assert code == 429
        # bob's refused calls were refused before his token was checked: the hub heard of his 11 admitted ones only
        assert service.asked_hub.count("bob-token") == 11

    with caplog.at_level(logging.WARNING, logger="gpu_quota_ext"):
        serve(service, scenario)
    lines = [r.getMessage() for r in caplog.records if "429" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("gpu-quota service: bob: too many room calls"), lines
    assert service.guard.refused == 21
    assert service.guard.open.total() == 0  # every admitted request let go of its count
    assert sorted(o.grant.kernel_id for o in service.book.owned()) == ["bob-k", "carol-k"]


def test_a_grant_refused_for_the_rate_is_not_granted(service):
    async def scenario(base, client):
        for i in range(10):
            body = {"server": "", "kernel_id": f"k{i}", "kernelspec": "python3"}
            assert (await call(client, base + GRANTS_PATH, "bob-token", body))[0] == 201
        body = {"server": "", "kernel_id": "k10", "kernelspec": "python3"}
        code, retry, _ = await call(client, base + GRANTS_PATH, "bob-token", body)
        assert code == 429 and int(retry) >= 1

    serve(service, scenario)
    assert "k10" not in {o.grant.kernel_id for o in service.book.owned()}


def test_a_refused_answer_is_held_and_past_the_held_ones_the_connection_is_closed(service):
    """A flood that calls again as soon as it is answered makes one call per hold; answers held per caller are
    bounded, and past them the 429 comes at once with the connection closed."""
    from dataclasses import replace

    service.guard.settings = replace(service.guard.settings, hold_max=1.0)
    service.guard.held = OpenRequests(2)

    async def scenario(base, client):
        for _ in range(10):
            assert (await call(client, base + ROOM_PATH, "bob-token", room_body()))[0] == 200
        held = [asyncio.ensure_future(call(client, base + ROOM_PATH, "bob-token", room_body())) for _ in range(2)]
        deadline = time.monotonic() + 10
        while service.guard.held.held("bob") < 2:
            assert time.monotonic() < deadline, "the refused answers were not held"
            await asyncio.sleep(0.01)
        assert not any(h.done() for h in held)
        answer = await client.fetch(
            base + ROOM_PATH, method="POST", body=json.dumps(room_body()),
            headers={"Authorization": "token bob-token"}, raise_error=False,
        )
        assert answer.code == 429 and answer.headers["Connection"] == "close"
        assert service.guard.held.held("bob") == 2  # answered at once: the two are still held
        assert [r[0] for r in await asyncio.gather(*held)] == [429, 429]
        assert service.guard.held.held("bob") == 0
        # carol was never held up by bob's held answers
        assert (await call(client, base + ROOM_PATH, "carol-token", room_body()))[0] == 200

    serve(service, scenario)


def test_made_up_tokens_stop_reaching_the_hub_and_a_confirmed_token_still_passes(service):
    async def scenario(base, client):
        assert (await call(client, base + STATUS_PATH, "carol-token", method="GET"))[0] == 200  # confirmed
        codes = [(await call(client, base + STATUS_PATH, f"made-up-{i}", method="GET"))[0] for i in range(30)]
        assert codes[:5] == [403] * 5 and set(codes[5:]) == {429}, codes
        assert sum(token.startswith("made-up") for token in service.asked_hub) == 5
        code, retry, data = await call(client, base + STATUS_PATH, "made-up-x", method="GET")
        assert code == 429 and "failed authentications" in data["message"] and int(retry) >= 1
        # the same address, a token the hub confirmed lately: asked about and served
        assert (await call(client, base + STATUS_PATH, "carol-token", method="GET"))[0] == 200
        # no token at all counts as a failure too, and is refused the same way now
        answer = await client.fetch(base + STATUS_PATH, raise_error=False)
        assert answer.code == 429

    serve(service, scenario)


def test_concurrent_calls_with_one_token_share_one_check_with_the_hub(service, monkeypatch):
    held = asyncio.Event()
    asked = []

    async def identify(token):
        asked.append(token)
        await held.wait()
        return Who(USERS[token], False, {"kind": "user", "name": USERS[token]})

    monkeypatch.setattr(service.auth, "_identify", identify)
    arrived = []  # the guard is asked first, then (with no await between) the check under way is joined
    before_hub = service.guard.before_hub
    monkeypatch.setattr(service.guard, "before_hub", lambda *args: (arrived.append(1), before_hub(*args)))

    async def scenario(base, client):
        calls = [asyncio.ensure_future(call(client, base + STATUS_PATH, "carol-token", method="GET")) for _ in range(8)]
        deadline = time.monotonic() + 10
        while len(arrived) < 8:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        held.set()
        assert [r[0] for r in await asyncio.gather(*calls)] == [200] * 8

    serve(service, scenario)
    assert asked == ["carol-token"]


def test_a_users_long_polls_are_bounded(service):
    lease = {"server": "", "kernels": [], "park": [], "wait": 15}

    async def scenario(base, client):
        waiting = [asyncio.ensure_future(call(client, base + LEASE_PATH, "bob-token", dict(lease, server=s)))
                   for s in ("a", "b")]
        deadline = time.monotonic() + 10
        while service.broker.polls.count() < 2:
            assert time.monotonic() < deadline, "the two long polls never waited"
            await asyncio.sleep(0.01)
        code, retry, data = await call(client, base + LEASE_PATH, "bob-token", dict(lease, server="c"))
        assert code == 429 and "lease renewals waiting" in data["message"]
        assert ("bob", "c") not in {(x.user, x.server) for x in service.book.leases()}  # nothing renewed
        # carol's long poll is not bob's
        carol = asyncio.ensure_future(call(client, base + LEASE_PATH, "carol-token", lease))
        while service.broker.polls.count() < 3:
            assert time.monotonic() < deadline, "carol's long poll was not taken"
            await asyncio.sleep(0.01)
        assert [r[0] for r in await asyncio.gather(*waiting, carol)] == [200, 200, 200]
        assert service.guard.long_polls.total() == 0 and service.guard.open.total() == 0

    serve(service, scenario)


class ExhaustedSocket:
    """A listening socket whose accept() fails as a process out of descriptors sees it fail, `times` times."""

    def __init__(self, times):
        self.times = times
        self.accepted = 0

    def fileno(self):
        return self.fd

    def accept(self):
        if self.times:
            self.times -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        raise BlockingIOError()


def test_out_of_descriptors_the_listening_socket_pauses_and_one_line_is_said(service, caplog, monkeypatch):
    import socket

    monkeypatch.setattr(accept, "PAUSE", 0.01)

    async def scenario():
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        fake = ExhaustedSocket(times=50)
        fake.fd = listener.fileno()
        service.guard.open.enter("bob")
        calls = []
        handlers = {}
        loop = IOLoop.current()
        monkeypatch.setattr(loop, "add_handler", lambda s, h, e: handlers.__setitem__("accept", h))
        monkeypatch.setattr(loop, "remove_handler", lambda s: handlers.pop("accept", None))
        accept.guarded_accept(fake, lambda c, a: calls.append(c), lambda: service.guard.out_of_descriptors(1024))
        resumed = 0
        while fake.times:
            assert "accept" in handlers  # listening again after each pause
            handlers["accept"](fake.fd, 0)
            assert "accept" not in handlers  # set aside: the loop does not spin on a readable socket
            while "accept" not in handlers:
                await asyncio.sleep(0.005)
            resumed += 1
        handlers["accept"](fake.fd, 0)  # nothing left to accept: returns quietly
        listener.close()
        return resumed

    with caplog.at_level(logging.WARNING, logger="gpu_quota_ext"):
        assert asyncio.run(scenario()) == 50
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "out of file descriptors (limit 1024)" in lines[0] and "bob 1" in lines[0], lines
    assert not any(r.exc_info for r in caplog.records)


def test_the_descriptor_limit_is_raised_within_the_hard_limit():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        limit = accept.raise_descriptor_limit(wanted=min(1024, hard))
        assert limit == min(1024, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
