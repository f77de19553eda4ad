"""The host service's broker over HTTP, without a hub: the real service (its web app, book, sampler and room) on a
real socket, NVML the file-driven fake (devices.fake_nvml.FileFakeNvml, the file the test writes), and three users'
servers as real RemoteLedgers asking through parking.HostBroker, their lease threads running their long polls. The
hub's part (who owns a token) is a table here; the same scenario with a real hub, real Unix users and real kernels
is tests/hub/test_host_broker_e2e.py.

Every process is this test's: a `sleep` stands for each user's kernel, and every hub user is this Unix user to the
service (unix_user_template), so that the sampler verifies their PIDs."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import threading
import time

import pytest

from gpu_quota_ext import parking
from gpu_quota_ext.devices import Device
from gpu_quota_ext.hub.service.app import GpuQuotaService
from gpu_quota_ext.hub.service.auth import Who
from gpu_quota_ext.hub.service.user_policy import user_policy
from gpu_quota_ext.ledger import LeaseHooks
from gpu_quota_ext.ledger.remote import RemoteLedger
from gpu_quota_ext.parking import Demand, DeviceView, HostBroker, HostRooms, HostView, KernelView, Round
from gpu_quota_ext.parking.broker import BrokerSettings
from gpu_quota_ext.shared.sizes import GiB
from tests import waiting
from tests.hub.hubtools import listen_here

from .host_service import file_nvml_config

UUID = "GPU-room-0"
TOTAL = 12 * GiB
TOKENS = {"alice-token": "alice", "bob-token": "bob", "carol-token": "carol"}
PREFIX = "/services/gpu-quota/"
LEASE = 8.0  # seconds: renewals (and long polls) every 2 s
DEADLINE = 20.0  # seconds an event may take on a busy 2-core machine (a deadline, not a measurement)


def write_usage(path, usage):
    temporary = f"{path}.tmp"
    with open(temporary, "w") as handle:
        json.dump({str(pid): {UUID: n} for pid, n in usage.items() if n}, handle)
    os.replace(temporary, path)  # the sampler never reads half a file


@pytest.fixture
def service(tmp_path, monkeypatch):
    config, nvml_file = file_nvml_config(tmp_path, monkeypatch, "12GiB", UUID)
    service = config.GpuQuotaService
    service.default = {"default_cap": "0.45", "max_cap": "0.5"}
    service.overcommit = 2.0
    service.lease_seconds = LEASE
    service.park_min_idle = "2s"
    app = GpuQuotaService(config=config)
    app.build()
    app.connect_hub()

    async def identify(handler):
        header = handler.request.headers.get("Authorization", "")
        name = TOKENS[header[len("token "):]]
        return Who(name, False, {"kind": "user", "name": name})

    async def policy_for(name, directory=None):
        return user_policy(app.caps, app.host_policy, name, [], app.limits)

    monkeypatch.setattr(app, "identify", identify)
    monkeypatch.setattr(app.policies, "policy_for", policy_for)
    app.nvml_file = nvml_file
    yield app
    app.store.close()


class Server:
    """One user's server as the service sees it: a RemoteLedger, its kernel (a `sleep`), its park reports."""

    def __init__(self, url: str, token: str, kernel_id: str):
        self.ledger = RemoteLedger([Device(0, "Test GPU", UUID, TOTAL)], url, token, call_timeout=5.0)
        self.kernel_id = kernel_id
        self.process = subprocess.Popen(["sleep", "600"])
        self.report = {"kernel_id": kernel_id, "state": "busy", "idle_for": None, "parkable": False}
        self.asked = []  # the park requests its lease's answers handed over, with when they came
        self.asked_event = threading.Event()
        self.ledger.subscribe(
            LeaseHooks(
                processes=lambda kernel_ids: {k: [self.process.pid] for k in kernel_ids},
                park_report=lambda: [dict(self.report)],
                on_park_requests=self.on_park_requests,
            )
        )

    def on_park_requests(self, kernel_ids):
        self.asked.append((time.monotonic(), list(kernel_ids)))
        self.asked_event.set()

    def reports(self, state, idle_for=None, parkable=False):
        self.report = {"kernel_id": self.kernel_id, "state": state, "idle_for": idle_for, "parkable": parkable}

    def close(self):
        self.ledger.close()
        self.process.kill()
        self.process.wait()


def alices_round(now: float, since: float) -> Round:
    """Alice's server's view: her kernel parked with 5 GiB on the host, its cell waiting for it."""
    kernel = KernelView("ka", "waiting", {}, {0: int(0.45 * TOTAL)}, None, False, "kernel ka")
    return Round(
        devices=(DeviceView(0, "GPU 0", TOTAL, 0),),
        kernels=(kernel,),
        demands=(Demand("ka", {0: 5 * GiB}, since),),
        reservations=(),
        host=HostView(),
        settings=BrokerSettings(),
        now=now,
    )


def ours() -> int:
    """Threads other than asyncio's default executor's workers (this test's asyncio.to_thread calls: the executor
    may start one more for a later call, and keeps it)."""
    return sum(1 for thread in threading.enumerate() if not thread.name.startswith("asyncio_"))


# This file's events: a deadline for a busy 2-core machine, checks that ask a server no faster than this.
wait_for = functools.partial(waiting.wait_for, timeout=DEADLINE, step=0.02)


def test_a_resume_parks_another_users_idle_kernel_through_its_lease_and_nothing_is_left_behind(service):
    async def scenario():
        http, port = listen_here(service.web_app(PREFIX))
        url = f"http://127.0.0.1:{port}{PREFIX}"
        servers = {
            user: Server(url, token, f"k{user[0]}") for token, user in TOKENS.items()
        }
        alice, bob, carol = servers["alice"], servers["bob"], servers["carol"]
        try:
            assert isinstance(alice.ledger, HostRooms)
            for user, server in servers.items():
                grant = await asyncio.to_thread(server.ledger.grant, server.kernel_id, user, "python3", None)
                assert grant.caps == {0: int(0.45 * TOTAL)}
            # Each lease registers its kernel's PID (its renewer's first renewal, or this one).
            for server in servers.values():
                assert await asyncio.to_thread(server.ledger.lease.renew)
            write_usage(service.nvml_file, {bob.process.pid: 5 * GiB, carol.process.pid: 5 * GiB})
            service.sampler._tick()
            used = service.sampler.last.attributed.kernel_used
            assert used == {"kb": {UUID: 5 * GiB}, "kc": {UUID: 5 * GiB}}, used
            # Bob's kernel idle longest, carol's less; both parkable; alice's parked. Their leases say so.
            alice.reports("parked")
            bob.reports("idle", 300.0, True)
            carol.reports("idle", 60.0, True)
            for server in servers.values():
                assert await asyncio.to_thread(server.ledger.lease.renew)
            # Their renewers' long polls wait now.
            await wait_for(lambda: service.broker.polls.count() == 3, "three leases waiting in their long polls")
            fds, threads = len(os.listdir("/proc/self/fd")), ours()

            # Alice's cell: her server asks the host's broker.
            broker = HostBroker(alice.ledger, {0: UUID})
            asked_at = time.monotonic()
            plan = await broker.decide(alices_round(time.time(), time.time()))
            assert plan.go == () and "idle kernel of another user parks now" in plan.waiting["ka"], plan
            await wait_for(bob.asked_event.is_set, "bob's lease answered with his kernel to park")
            (at, kernel_ids), = bob.asked
            assert kernel_ids == ["kb"] and carol.asked == [] and alice.asked == []
            to_bob = at - asked_at
            status = service.status_now("root", True)
            (request,) = status["park_requests"]
            assert (request["kernel_id"], request["for_kernel"], request["taken"]) == ("kb", "ka", True)
            assert [w["kernel_id"] for w in status["waiting"]] == ["ka"]

            # Bob's server parks it: its memory leaves the device, its next renewal (at once) says so.
            bob.reports("parked")
            write_usage(service.nvml_file, {carol.process.pid: 5 * GiB})
            service.sampler._tick()
            await wait_for(lambda: service.status_now("root", True)["kernels"][1]["park"]["state"] == "parked",
                        "bob's renewal after the early answer reporting his kernel parked")
            plan = await broker.decide(alices_round(time.time(), time.time()))
            assert plan.go == ("ka",), plan
            (held,) = service.status_now("root", True)["reservations"]
            assert held["held"] == {UUID: 5 * GiB}
            # Carol's kernel asks while the sample still shows it on the device: not decided, and said so.
            carol.reports("waiting")
            demand = {"park": [carol.report], "demands": [{"kernel_id": "kc", "need": {UUID: 7 * GiB}}]}
            carols = await asyncio.to_thread(carol.ledger.room, demand)
            assert carols["go"] == [] and "still shows this kernel's memory" in carols["waiting"]["kc"]
            # Parked: the reserved room is not hers (12 - 5 reserved - 1 < 7).
            write_usage(service.nvml_file, {})
            service.sampler._tick()
            carols = await asyncio.to_thread(carol.ledger.room, demand)
            assert carols["go"] == [] and "kc" in carols["waiting"]
            # Alice's restore: the next sample shows her memory back, and the reservation ends.
            write_usage(service.nvml_file, {alice.process.pid: 5 * GiB})
            service.sampler._tick()
            assert service.status_now("root", True)["reservations"] == []

            # What the others may not do: bob naming alice's kernel, a device this host does not have.
            with pytest.raises(OSError, match="HTTP 403: kernel ka is another user's"):
                await asyncio.to_thread(bob.ledger.room, {"demands": [{"kernel_id": "ka", "need": {UUID: 1}}]})
            with pytest.raises(OSError, match="HTTP 400: device GPU-elsewhere is not one of this host's GPUs"):
                await asyncio.to_thread(
                    bob.ledger.room, {"demands": [{"kernel_id": "kb", "need": {"GPU-elsewhere": 1}}]}
                )
            assert [w["kernel_id"] for w in service.status_now("root", True)["waiting"]] == ["kc"]

            assert len(os.listdir("/proc/self/fd")) <= fds + 3
            await wait_for(lambda: ours() == threads, "no thread of this test's servers or service left behind")
            started = time.monotonic()
            for server in servers.values():
                await asyncio.to_thread(server.close)
            closing = time.monotonic() - started
            await wait_for(lambda: service.broker.polls.count() == 0, "every long poll ended with its server")
            assert not [t for t in threading.enumerate() if t.name == "gpu-quota-lease"]
            print(f"park request to bob's server {to_bob * 1000:.0f} ms after alice's room call; "
                  f"three servers closed in {closing:.2f} s")
            assert closing < LEASE / 4, "close() waited out the long polls"
        finally:
            for server in servers.values():
                server.close()
            http.stop()

    asyncio.run(scenario())


def test_two_users_parks_in_the_same_second_get_the_hosts_memory_from_one_account(service, monkeypatch):
    # Bob's and carol's idle timers fire together, each server asking the service before its driver call. The host
    # (as the service reads it: a CI machine cannot be made to run short) has room for one of their parks.
    monkeypatch.setattr(parking, "host_room", lambda: (9 * GiB, None))

    async def scenario():
        http, port = listen_here(service.web_app(PREFIX))
        url = f"http://127.0.0.1:{port}{PREFIX}"
        servers = {user: Server(url, token, f"k{user[0]}") for token, user in TOKENS.items()}
        bob, carol = servers["bob"], servers["carol"]
        try:
            for user, server in servers.items():
                await asyncio.to_thread(server.ledger.grant, server.kernel_id, user, "python3", None)
                assert await asyncio.to_thread(server.ledger.lease.renew)
            write_usage(service.nvml_file, {bob.process.pid: 5 * GiB, carol.process.pid: 5 * GiB})
            service.sampler._tick()
            brokers = {user: HostBroker(servers[user].ledger, {0: UUID}) for user in ("bob", "carol")}
            empty = Round((DeviceView(0, "GPU 0", TOTAL, 10 * GiB),), (), (), (), HostView(), BrokerSettings(), 0.0)
            answers = await asyncio.gather(
                brokers["bob"].promise_host(empty, "kb", 5 * GiB),
                brokers["carol"].promise_host(empty, "kc", 5 * GiB),
            )
            refused = [words for words, _ in answers if words is not None]
            assert len(refused) == 1, answers  # 9 GiB: one park of 5 GiB and the 2 GiB margin, not two
            assert "parks under way will still bring 5.0 GiB" in refused[0], refused
            assert service.broker.room.host_promised() == 5 * GiB
            # Carol names bob's kernel: 403, nothing promised.
            words, _ = await brokers["carol"].promise_host(empty, "kb", GiB)
            assert words is not None and "another user's" in words, words
            assert service.broker.room.host_promised() == 5 * GiB
            # The park that got its promise reports itself parked: the promise ends, the next park may have it.
            promised = "bob" if answers[0][0] is None else "carol"
            servers[promised].reports("parked")
            assert await asyncio.to_thread(servers[promised].ledger.lease.renew)
            assert service.broker.room.host_promised() == 0
        finally:
            for server in servers.values():
                server.close()
            http.stop()

    asyncio.run(scenario())
