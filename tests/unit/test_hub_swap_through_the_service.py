"""A swap on a hub host through the real wire: two users' servers (parking.HostBroker over the real client,
RemoteLedger.room, each with its user's token) and one host service (its web app on a real socket, its book, its
sampler over the file-driven fake NVML, its room). Alice's kernel A, parked by the fast path, waits to come back;
bob's kernel B holds the device and its fast-path park is under way, releasing as it copies. Bob's server tells
the service of that park at once; alice's resume then goes while B still copies, and her answer says what of her
need B is still freeing, keyed by her own device index (Plan.freeing, which her parker's fast restore counts:
tests/unit/test_fast_park_swap.py). Each side alone: tests/unit/test_host_room.py,
test_host_service_swap_wire.py, test_host_broker_swap.py.

The hub's part (who owns a token) is a table here. Each user's kernel is a `sleep` of this test (every hub user is
this Unix user to the service, unix_user_template), registered through a lease POST so that the sampler
attributes its device memory; the servers' lease threads never run (the test posts each renewal itself), so the
service hears of bob's park only from the calls the test makes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from typing import List

import pytest
from tornado.httpclient import AsyncHTTPClient

from gpu_quota_ext.devices import Device
from gpu_quota_ext.hub.service.app import GpuQuotaService
from gpu_quota_ext.hub.service.auth import Who
from gpu_quota_ext.ledger.remote import RemoteLedger
from gpu_quota_ext.parking import (
    BrokerSettings,
    Demand,
    DeviceView,
    HostBroker,
    HostRooms,
    HostView,
    KernelView,
    Plan,
    Round,
)
from gpu_quota_ext.parking.host_broker import kernel_park
from gpu_quota_ext.shared.service_contract import GRANTS_PATH, LEASE_PATH
from gpu_quota_ext.shared.sizes import GiB, MiB
from tests.hub.hubtools import listen_here

from .host_service import PREFIX, file_nvml_config, hub_says

UUID = "GPU-swap-0"
TOTAL = 10 * GiB
MARGIN = 768 * MiB  # the service's park_device_margin
CAP = 5 * GiB  # each kernel's cap: default_cap 0.5
HELD = 5 * GiB  # bob's kernel B on the device, in the service's sample, its park under way
PARKED = 4608 * MiB  # alice's kernel A's parked bytes: her resume's need (with its context, within her budget)
CONTEXT = 300 * MiB  # what A's fast park left on the device (its CUDA context), in the sample
STAYS = 512 * MiB  # what alice's server says A's park left there at most (KERNEL_PARK's "stays")
# Free for a restore now: 10 GiB - 5 GiB - 300 MiB - 768 MiB = 4052 MiB, short of A's 4608 MiB by 556 MiB, which
# B's park is freeing as it copies (5 GiB of it): a swap.
FREEING = PARKED - (TOTAL - HELD - CONTEXT - MARGIN)
TOKENS = {"alice-token": "alice", "bob-token": "bob"}
REFUSED_A = "HTTP 403: kernel A is another user's"


@pytest.fixture
def service(tmp_path, monkeypatch):
    config, nvml_file = file_nvml_config(tmp_path, monkeypatch, "10GiB", UUID)
    settings = config.GpuQuotaService
    settings.default = {"default_cap": "0.5", "max_cap": "0.5"}
    settings.park_device_margin = "768MiB"
    app = GpuQuotaService(config=config)
    app.build()
    app.connect_hub()

    async def identify(token):
        name = TOKENS[token]
        return Who(name, False, {"kind": "user", "name": name})

    hub_says(app, monkeypatch, identify)
    app.nvml_file = nvml_file
    yield app
    app.store.close()


class Counted:
    """A user server's HostRooms: the real client's room call (RemoteLedger.room: HTTP with the user's token), each
    call's body and answer kept, so that the test sees what went over the wire and how often."""

    def __init__(self, ledger: RemoteLedger):
        self.ledger = ledger
        self.bodies: List[dict] = []
        self.answers: List[dict] = []

    @property
    def brokers(self) -> bool:
        return self.ledger.brokers

    def room(self, body: dict) -> dict:
        self.bodies.append(body)
        answer = self.ledger.room(body)
        self.answers.append(answer)
        return answer


class Server:
    """One user's server: its kernel (a `sleep`), its host broker asking the service through the real client."""

    def __init__(self, base: str, token: str, kernel_id: str):
        self.base, self.token, self.kernel_id = base, token, kernel_id
        self.process = subprocess.Popen(["sleep", "600"])
        # Never granted through: its lease thread never starts (the test posts the renewals itself).
        self.ledger = RemoteLedger([Device(0, "Test GPU", UUID, TOTAL)], base, token, call_timeout=10.0)
        self.rooms = Counted(self.ledger)
        self.broker = HostBroker(self.rooms, {0: UUID})

    async def post(self, path: str, body: dict):
        answer = await AsyncHTTPClient().fetch(
            self.base + path, method="POST", body=json.dumps(body), raise_error=False, request_timeout=30,
            headers={"Authorization": f"token {self.token}"},
        )
        return answer.code, json.loads(answer.body or b"{}")

    async def grant(self) -> None:
        body = {"server": "", "kernel_id": self.kernel_id, "kernelspec": "python3", "allowed": None}
        code, answer = await self.post(GRANTS_PATH, body)
        assert code == 201, (code, answer)
        assert [(d["uuid"], d["cap"]) for d in answer["grant"]["devices"]] == [(UUID, CAP)], answer

    async def renew(self, report: dict) -> None:
        """The server's lease renewal: its kernel's PID (the sampler attributes by it) and park state."""
        body = {"server": "", "kernels": [{"kernel_id": self.kernel_id, "pids": [self.process.pid]}], "park": [report]}
        code, answer = await self.post(LEASE_PATH, body)
        assert code == 200 and answer["released"] == [], (code, answer)

    def close(self) -> None:
        self.ledger.close()
        self.process.kill()
        self.process.wait()


def write_usage(path, usage) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w") as handle:
        json.dump({str(pid): {UUID: n} for pid, n in usage.items() if n}, handle)
    os.replace(temporary, path)  # the sampler never reads half a file


def device(used: int) -> DeviceView:
    return DeviceView(0, "GPU 0", TOTAL, used)


def bobs_round(now: float, releasing: bool) -> Round:
    """Bob's server's view as its parker's round() gives it: B's park under way, nothing of his waits."""
    kernel = KernelView("B", "parking", {0: HELD}, {0: CAP}, None, False, "kernel B", releases_as_copied=releasing)
    return Round((device(HELD + CONTEXT),), (kernel,), (), (), HostView(), BrokerSettings(), now)


def alices_round(now: float, stays: int, may_wait: bool) -> Round:
    """Alice's server's view: A parked (by the fast path where `stays` > 0), its cell waiting for its bytes."""
    kernel = KernelView("A", "waiting", {}, {0: CAP}, None, False, "kernel A", stays=stays)
    demand = Demand("A", {0: PARKED}, now, may_wait=may_wait)
    return Round((device(HELD + CONTEXT),), (kernel,), (demand,), (), HostView(), BrokerSettings(), now)


def bobs_park(releasing: bool) -> dict:
    return kernel_park("B", "parking", None, False, releases_as_copied=releasing)


def run(service, scenario, bob_reports: dict, alice_stays: int = STAYS) -> None:
    """`scenario(alice, bob)` once both kernels are granted, their leases name their PIDs and park states (bob's
    `bob_reports`, alice's A waiting with `alice_stays` left on the device) and a sample shows B's memory (and A's
    context where its park was the fast path's)."""

    async def main():
        http, port = listen_here(service.web_app(PREFIX))
        base = f"http://127.0.0.1:{port}{PREFIX}"
        alice, bob = Server(base, "alice-token", "A"), Server(base, "bob-token", "B")
        try:
            assert isinstance(alice.rooms, HostRooms)
            for server in (alice, bob):
                await server.grant()
            await alice.renew(kernel_park("A", "waiting", None, False, alice_stays))
            await bob.renew(bob_reports)
            context = CONTEXT if alice_stays else 0  # the checkpoint path's park leaves nothing on the device
            write_usage(service.nvml_file, {bob.process.pid: HELD, alice.process.pid: context})
            service.sampler._tick()
            used = service.sampler.last.attributed.kernel_used
            expected = {"B": {UUID: HELD}, **({"A": {UUID: context}} if context else {})}
            assert used == expected, used
            await scenario(alice, bob)
        finally:
            for server in (alice, bob):
                server.close()
            http.stop()

    asyncio.run(main())


def test_a_resume_goes_while_another_users_park_still_copies_and_is_told_what_that_park_is_freeing(service):
    async def scenario(alice, bob):
        # B's park began after bob's last lease renewal: his server tells the service at once, once.
        assert await bob.broker.decide(bobs_round(time.time(), releasing=True)) == Plan()
        assert bob.rooms.bodies == [{"park": [bobs_park(True)], "demands": []}]
        assert await bob.broker.decide(bobs_round(time.time(), releasing=True)) == Plan()
        assert len(bob.rooms.bodies) == 1, bob.rooms.bodies  # the same park: nothing more to tell
        heard, waiting, held, _ = service.broker.room.view()
        assert heard["B"].report.releases_as_copied is True and waiting == [] and held == []

        plan = await alice.broker.decide(alices_round(time.time(), STAYS, may_wait=True))
        (body,) = alice.rooms.bodies
        assert body["demands"] == [{"kernel_id": "A", "need": {UUID: PARKED}, "may_wait": True}]
        assert plan.go == ("A",) and plan.park == () and plan.waiting == {}, plan
        assert plan.freeing == {"A": {0: FREEING}} and FREEING == 556 * MiB, plan
        (answer,) = alice.rooms.answers
        assert answer["freeing"] == {"A": {UUID: FREEING}}, answer  # by uuid on the wire; alice's kernel only
        assert answer["go"] == ["A"] and answer["park"] == [] and answer["waiting"] == {}, answer
        heard, waiting, held, _ = service.broker.room.view()
        assert waiting == [] and [(h.kernel_id, h.user, dict(h.held)) for h in held] == [("A", "alice", {UUID: PARKED})]

        # Asked again on the room it holds (as after a lost answer): "go" again, with the same word of what is being
        # freed (alice's server cannot see bob's park).
        plan = await alice.broker.decide(alices_round(time.time(), STAYS, may_wait=True))
        assert plan.go == ("A",) and plan.freeing == {"A": {0: FREEING}}, plan
        assert alice.rooms.answers[-1]["freeing"] == {"A": {UUID: FREEING}}

    run(service, scenario, kernel_park("B", "busy", None, False))


def test_another_user_cannot_make_or_read_a_kernel_s_swap(service):
    async def scenario(alice, bob):
        await bob.broker.decide(bobs_round(time.time(), releasing=True))
        before = service.broker.room.view()
        # Bob names alice's kernel as a fast-path resume of his: refused whole, nothing kept.
        with pytest.raises(OSError, match=REFUSED_A):
            await asyncio.to_thread(
                bob.rooms.room, {"park": [bobs_park(True)], "demands": [
                    {"kernel_id": "A", "need": {UUID: PARKED}, "may_wait": True}]}
            )
        with pytest.raises(OSError, match=REFUSED_A):
            await asyncio.to_thread(
                bob.rooms.room, {"park": [kernel_park("A", "waiting", None, False, STAYS)], "demands": []}
            )
        assert service.broker.room.view() == before
        # Through his host broker (a server that names another user's kernel): the same refusal, told as a wait.
        plan = await bob.broker.decide(alices_round(time.time(), STAYS, may_wait=True))
        assert plan.go == () and REFUSED_A in plan.waiting["A"], plan
        assert service.broker.room.view() == before

        # Alice's swap names only her kernel: what B frees is hers to wait for, B's id and bob's words are not.
        plan = await alice.broker.decide(alices_round(time.time(), STAYS, may_wait=True))
        (answer,) = alice.rooms.answers
        assert plan.go == ("A",) and set(plan.freeing) == {"A"}, plan
        for key in ("go", "park", "waiting", "told", "freeing"):
            assert "B" not in answer[key], answer
        assert "B" not in json.dumps(answer["freeing"]) and "bob" not in json.dumps(answer), answer

    run(service, scenario, kernel_park("B", "busy", None, False))


@pytest.mark.parametrize(
    "bob_releases, alice_stays, may_wait",
    [
        pytest.param(False, STAYS, True, id="bob's park frees nothing before it ends (the checkpoint path's)"),
        pytest.param(True, 0, True, id="alice's kernel parked by the checkpoint path (stays 0) says it may wait"),
        pytest.param(True, STAYS, False, id="alice's resume does not say it may wait"),
    ],
)
def test_without_both_halves_of_a_swap_the_resume_waits_for_the_park_to_end(
    service, bob_releases, alice_stays, may_wait
):
    async def scenario(alice, bob):
        # A park that does not release as it copies is heard by the lease only: nothing is told at once.
        await bob.broker.decide(bobs_round(time.time(), releasing=bob_releases))
        assert len(bob.rooms.bodies) == (1 if bob_releases else 0), bob.rooms.bodies
        heard, _, _, _ = service.broker.room.view()
        assert (heard["B"].report.state, heard["B"].report.releases_as_copied) == ("parking", bob_releases)

        plan = await alice.broker.decide(alices_round(time.time(), alice_stays, may_wait))
        (body,) = alice.rooms.bodies
        assert body["demands"][0].get("may_wait", False) is may_wait, body  # the server's word, sent as said
        assert plan.go == () and plan.freeing == {}, plan
        reason = plan.waiting["A"]
        assert "making room" in reason and "of another user parking" in reason, reason
        assert alice.rooms.answers[-1]["freeing"] == {}
        _, waiting, held, _ = service.broker.room.view()
        assert held == [] and [w.kernel_id for w in waiting] == ["A"]

    run(service, scenario, bobs_park(False) if not bob_releases else kernel_park("B", "busy", None, False), alice_stays)
