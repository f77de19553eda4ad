"""RemoteLedger against a small real tornado server that speaks the host service's wire
(host_service/contract.py) over a real socket, in a thread of this process. The stand-in keeps its grants
in a LocalLedger, resolves each user's policy itself and learns the user from the token, as the service
does; the hub is not needed for what is tested here (the real service under a real hub:
tests/hub/test_host_service_e2e.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from typing import Dict, List, Optional

import pytest
from tornado import httpserver, web

from gpu_quota_ext.app import _make_ledger
from gpu_quota_ext.devices import Device
from gpu_quota_ext.ledger import AdmissionRefused, LeaseHooks, Ledger, UnknownKernel
from gpu_quota_ext.ledger.local import LocalLedger
from gpu_quota_ext.ledger.remote import SERVICE_URL_ENV, RemoteLedger
from gpu_quota_ext.parking import HostRooms
from gpu_quota_ext.policy import build_policy, resolve
from gpu_quota_ext.shared.service_contract import (
    GRANTS_PATH,
    LEASE_PATH,
    ROOM_PATH,
    START_RETRIES,
    STATUS_PATH,
)
from gpu_quota_ext.shared.sizes import GiB, PolicyError, parse_cap
from gpu_quota_ext.usage import processes_by_kernel

TOTAL = 80 * GiB
# The service numbers the host's GPUs one way, this server the other: only uuids cross the wire.
HOST_DEVICES = [Device(0, "GPU A", "GPU-aaaa", TOTAL), Device(1, "GPU B", "GPU-bbbb", TOTAL)]
SERVER_DEVICES = [Device(0, "GPU B", "GPU-bbbb", TOTAL), Device(1, "GPU A", "GPU-aaaa", TOTAL)]
TOKENS = {"alice-token": "alice", "bob-token": "bob"}
PREFIX = "/services/gpu-quota/"


class StandIn:
    """The service's side of the wire, as small as it can be; every request body is kept for the tests."""

    def __init__(self):
        self.policy = build_policy("0.5", "0.75", overcommit="1.0", on_full="refuse", placement="pack")
        self.ledger = LocalLedger(HOST_DEVICES, self.policy)
        self.owner: Dict[str, tuple] = {}  # kernel id -> (user, server)
        self.requests: List[tuple] = []  # (method, path, headers, body)
        self.leases: List[dict] = []
        self.lease_seconds = 60
        self.start_grace = 30.0  # as the service: a grant this young is kept though a lease did not list it yet
        self.granted_at: Dict[str, float] = {}
        self.answer_503 = 0  # the next this many grant requests get a proxy's 503
        self.raw_answer: Optional[bytes] = None  # the next grant answer, as is
        self.plain_leases = False  # answer a lease with "park" or "wait" 400, as a service of an older version
        self.refuse_leases = False  # answer every lease 400
        self.park_next: List = []  # the next lease's answer asks this server to park these (at once: no wait)
        self.wake: Optional[asyncio.Event] = None  # ends a lease's wait early (on the stand-in's loop)
        self.rooms: List[dict] = []
        self.room_answer: tuple = (200, {"go": [], "park": [], "waiting": {}, "told": {}})
        self.loop = asyncio.new_event_loop()
        self.port = _free_port()
        self.server: Optional[httpserver.HTTPServer] = None
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{PREFIX}"

    def _on_loop(self, fn):
        done = threading.Event()
        result = []

        def run():
            result.append(fn())
            done.set()

        self.loop.call_soon_threadsafe(run)
        assert done.wait(10)
        return result[0]

    def start(self) -> None:
        def listen():
            app = web.Application([
                (PREFIX + GRANTS_PATH, Grants, {"standin": self}),
                (PREFIX + GRANTS_PATH + r"/(?P<kernel_id>[\w-]+)", OneGrant, {"standin": self}),
                (PREFIX + LEASE_PATH, Lease, {"standin": self}),
                (PREFIX + STATUS_PATH, Status, {"standin": self}),
                (PREFIX + ROOM_PATH, Room, {"standin": self}),
            ])
            self.server = httpserver.HTTPServer(app)
            self.server.listen(self.port, "127.0.0.1")

        self._on_loop(listen)

    def stop(self) -> None:
        """Down: nothing listens on the port any more (connection refused)."""
        self._on_loop(lambda: self.server.stop())

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def last(self, method: str) -> tuple:
        """The last grants request of this method (the lease thread's requests interleave with the test's)."""
        return [r for r in self.requests if r[0] == method and GRANTS_PATH in r[1]][-1]

    def grant_record(self, grant) -> dict:
        record = grant.to_json()
        for entry in record["devices"]:
            entry["uuid"] = HOST_DEVICES[entry["index"]].uuid
        return record


class Base(web.RequestHandler):
    def initialize(self, standin: StandIn):
        self.standin = standin

    def prepare(self):
        body = json.loads(self.request.body) if self.request.body else None
        self.standin.requests.append((self.request.method, self.request.path, dict(self.request.headers), body))
        self.body = body
        if self.standin.answer_503 and self.request.path.endswith(GRANTS_PATH):
            self.standin.answer_503 -= 1
            self.set_status(503)
            self.finish("<html>Service Unavailable</html>")
            return
        auth = self.request.headers.get("Authorization", "")
        self.user = TOKENS.get(auth[len("token "):]) if auth.startswith("token ") else None
        if self.user is None:
            self.answer(403, {"message": "no valid hub token"})

    def answer(self, code: int, data: Optional[dict]) -> None:
        self.set_status(code)
        self.finish(json.dumps(data) if data is not None else None)

    def mine(self, kernel_id: str) -> bool:
        owner = self.standin.owner.get(kernel_id)
        if owner is None:
            self.answer(404, {"message": f"no grant for kernel {kernel_id}"})
            return False
        if owner[0] != self.user:
            self.answer(403, {"message": f"kernel {kernel_id} is another user's"})
            return False
        return True


class Grants(Base):
    def post(self):
        s, body = self.standin, self.body
        if s.raw_answer is not None:
            raw, s.raw_answer = s.raw_answer, None
            self.set_status(201)
            return self.finish(raw)
        owner = s.owner.get(body["kernel_id"])
        if owner is not None and owner[0] != self.user:
            return self.answer(403, {"message": f"kernel {body['kernel_id']} is another user's"})
        allowed = None if body["allowed"] is None else [d.index for d in HOST_DEVICES if d.uuid in body["allowed"]]
        try:
            decision = resolve(s.policy, self.user, body["kernelspec"])
            grant = s.ledger.grant(body["kernel_id"], self.user, body["kernelspec"], decision, allowed)
        except AdmissionRefused as refusal:
            return self.answer(409, {"message": str(refusal)})
        s.owner[body["kernel_id"]] = (self.user, body["server"])
        s.granted_at.setdefault(body["kernel_id"], time.monotonic())
        self.answer(200 if owner else 201, {"grant": s.grant_record(grant)})


class OneGrant(Base):
    def put(self, kernel_id):
        if not self.mine(kernel_id):
            return
        ledger = self.standin.ledger
        try:
            if self.body.get("reset"):
                outcome = ledger.reset(kernel_id)
            else:
                device = (
                    None
                    if self.body["device"] is None
                    else next(d.index for d in HOST_DEVICES if d.uuid == self.body["device"])
                )
                outcome = ledger.change(kernel_id, parse_cap(self.body["cap"]), device)
        except PolicyError as error:
            return self.answer(400, {"message": str(error)})
        self.answer(
            200,
            {"status": outcome.status, "message": outcome.message, "grant": self.standin.grant_record(outcome.grant)},
        )

    def delete(self, kernel_id):
        if self.mine(kernel_id):
            self.standin.ledger.release(kernel_id)
            del self.standin.owner[kernel_id]
            self.answer(204, None)


class Lease(Base):
    async def post(self):
        s = self.standin
        if s.refuse_leases or (s.plain_leases and set(self.body) - {"server", "kernels"}):
            return self.answer(400, {"message": "the body must be a JSON object {server, kernels}"})
        s.leases.append(self.body)
        if self.body.get("wait") and not s.park_next:  # the long poll, a quarter lease at most (as the service)
            s.wake = asyncio.Event()
            try:
                await asyncio.wait_for(s.wake.wait(), min(self.body["wait"], s.lease_seconds / 4))
            except asyncio.TimeoutError:
                pass
        listed = {k["kernel_id"] for k in self.body["kernels"]}
        gone = [
            k
            for k, (user, server) in s.owner.items()
            if user == self.user
            and server == self.body["server"]
            and k not in listed
            and time.monotonic() - s.granted_at[k] >= s.start_grace
        ]
        for kernel_id in gone:
            s.ledger.release(kernel_id)
            del s.owner[kernel_id]
        answer = {"lease_seconds": s.lease_seconds, "released": gone}
        if "park" in self.body or "wait" in self.body:
            answer["park"], s.park_next = s.park_next, []
        self.answer(200, answer)


class Room(Base):
    def post(self):
        self.standin.rooms.append(self.body)
        self.answer(*self.standin.room_answer)


class Status(Base):
    def get(self):
        self.answer(200, {"devices": self.standin.ledger.device_grants()})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def standin():
    service = StandIn()
    yield service
    service.close()


@pytest.fixture
def make_ledger(standin):
    made = []

    def make(token: str = "alice-token", **options) -> RemoteLedger:
        options.setdefault("retry_delay", 0.01)
        options.setdefault("call_timeout", 5.0)
        ledger = RemoteLedger(SERVER_DEVICES, standin.url, token, server="", **options)
        made.append(ledger)
        return ledger

    yield make
    for ledger in made:
        ledger.close()
    leftover = [t.name for t in threading.enumerate() if t.name == "gpu-quota-lease"]
    assert leftover == [], "a lease thread outlived its ledger"


def wide_open():
    """What the user's own config would give: a whole device, no admission control."""
    return resolve(build_policy("1.0", "1.0"), "alice", "python3")


# --- grants -----------------------------------------------------------------------------------------


def test_a_grant_is_the_services_decision_on_this_servers_device_numbers(standin, make_ledger):
    ledger = make_ledger()
    assert isinstance(ledger, Ledger)
    grant = ledger.grant("k1", "mallory", "python3", wide_open())
    # The service packed it on its device 0, GPU-aaaa: this server's device 1.
    assert grant.devices == (1,)
    assert grant.caps == {1: TOTAL // 2} and grant.max_caps == {1: int(0.75 * TOTAL)}
    assert grant.user == "alice"  # the token's owner, not the name the caller passed
    method, path, headers, body = standin.last("POST")
    assert (method, path) == ("POST", PREFIX + GRANTS_PATH)
    assert headers["Authorization"] == "token alice-token"
    assert body == {"server": "", "kernel_id": "k1", "kernelspec": "python3", "allowed": None}  # no user, no cap
    assert ledger.get("k1") == grant and ledger.grants() == [grant]
    assert [u["granted"] for u in ledger.device_grants()] == [0, TOTAL // 2]


def test_a_restart_keeps_its_grant_without_asking(standin, make_ledger):
    ledger = make_ledger()
    first = ledger.grant("k1", "alice", "python3", wide_open())
    asked = len([r for r in standin.requests if r[0] == "POST" and r[1].endswith(GRANTS_PATH)])
    assert ledger.grant("k1", "alice", "python3", wide_open()) is first
    assert len([r for r in standin.requests if r[0] == "POST" and r[1].endswith(GRANTS_PATH)]) == asked


def test_allowed_devices_go_as_uuids(standin, make_ledger):
    grant = make_ledger().grant("k1", "alice", "python3", wide_open(), allowed=[0])
    assert standin.last("POST")[3]["allowed"] == ["GPU-bbbb"]
    assert grant.devices == (0,)


def test_a_full_budget_is_the_services_refusal_and_nothing_is_held(standin, make_ledger):
    alice, bob = make_ledger(), make_ledger("bob-token")
    for n in range(4):  # 0.5 of each device each: two per device fill the host
        (alice if n % 2 else bob).grant(f"k{n}", "x", "python3", wide_open())
    with pytest.raises(AdmissionRefused, match="no GPU has 0.5 of budget left"):
        alice.grant("k9", "alice", "python3", wide_open())
    assert alice.get("k9") is None and "k9" not in standin.owner
    assert sum(u["granted"] for u in standin.ledger.device_grants()) == 2 * TOTAL


def test_another_users_kernel_id_is_refused_and_not_taken(standin, make_ledger):
    make_ledger().grant("k1", "alice", "python3", wide_open())
    bob = make_ledger("bob-token")
    with pytest.raises(AdmissionRefused, match="403.*another user's"):
        bob.grant("k1", "bob", "python3", wide_open())
    assert bob.get("k1") is None and standin.owner["k1"][0] == "alice"
    with pytest.raises(UnknownKernel):  # bob's server holds nothing of k1: it does not even ask
        bob.change("k1", parse_cap("0.1"))
    with pytest.raises(UnknownKernel):
        bob.reset("k1")
    assert bob.release("k1") is None
    assert standin.owner["k1"][0] == "alice"


def test_a_bad_token_is_a_refusal(standin, make_ledger):
    with pytest.raises(AdmissionRefused, match="403"):
        make_ledger("stolen").grant("k1", "alice", "python3", wide_open())
    assert standin.owner == {}


# --- changes ----------------------------------------------------------------------------------------


def test_change_and_reset_go_through_the_service(standin, make_ledger):
    ledger = make_ledger()
    ledger.grant("k1", "alice", "python3", wide_open())
    outcome = ledger.change("k1", parse_cap("0.6"), device=1)
    assert standin.last("PUT")[3] == {"cap": "0.6", "device": "GPU-aaaa"}
    assert outcome.status == "granted" and outcome.grant.caps == {1: int(0.6 * TOTAL)}
    assert ledger.get("k1").caps == {1: int(0.6 * TOTAL)}
    clamped = ledger.change("k1", parse_cap("0.9"))
    assert clamped.status == "clamped" and clamped.grant.caps == {1: int(0.75 * TOTAL)}
    back = ledger.reset("k1")
    assert standin.last("PUT")[3] == {"reset": True}
    assert back.status == "granted" and ledger.get("k1").caps == {1: TOTAL // 2}
    assert standin.ledger.get("k1").caps == {0: TOTAL // 2}


def test_a_cap_the_service_cannot_take_is_a_policy_error_and_nothing_changes(standin, make_ledger):
    ledger = make_ledger()
    ledger.grant("k1", "alice", "python3", wide_open())
    with pytest.raises(PolicyError, match="at least"):
        ledger.change("k1", parse_cap("0.0000001"))
    with pytest.raises(PolicyError, match="not one of this kernel's devices"):
        ledger.change("k1", parse_cap("0.3"), device=0)
    assert ledger.get("k1").caps == {1: TOTAL // 2} and standin.ledger.get("k1").caps == {0: TOTAL // 2}


def test_a_grant_the_service_no_longer_has_is_unknown(standin, make_ledger):
    ledger = make_ledger()
    ledger.grant("k1", "alice", "python3", wide_open())
    standin.ledger.release("k1")
    del standin.owner["k1"]
    with pytest.raises(UnknownKernel):
        ledger.change("k1", parse_cap("0.3"))
    assert ledger.get("k1") is None


def test_release_frees_the_budget_and_is_idempotent(standin, make_ledger):
    ledger = make_ledger()
    grant = ledger.grant("k1", "alice", "python3", wide_open())
    assert ledger.release("k1") == grant
    assert standin.last("DELETE")[:2] == ("DELETE", PREFIX + GRANTS_PATH + "/k1")
    assert standin.ledger.grants() == [] and ledger.grants() == []
    asked = len([r for r in standin.requests if r[0] == "DELETE"])
    assert ledger.release("k1") is None
    assert len([r for r in standin.requests if r[0] == "DELETE"]) == asked


# --- the service away -------------------------------------------------------------------------------


def test_a_start_while_the_service_is_down_is_refused_after_the_retries_then_it_recovers(standin, make_ledger):
    ledger = make_ledger()
    standin.stop()
    with pytest.raises(
        AdmissionRefused,
        match=r"^the GPU quota service at http://127\.0\.0\.1:\d+/services/gpu-quota/ is unreachable: .*refused",
    ):
        ledger.grant("k1", "alice", "python3", wide_open())
    assert ledger.get("k1") is None
    standin.start()
    assert ledger.grant("k1", "alice", "python3", wide_open()).caps == {1: TOTAL // 2}


def test_a_start_tries_start_retries_more_times_and_gets_through_on_the_last(standin, make_ledger):
    ledger = make_ledger()
    standin.answer_503 = START_RETRIES  # the proxy answers for a service that is not there yet
    assert ledger.grant("k1", "alice", "python3", wide_open()).devices == (1,)
    posts = [r for r in standin.requests if r[0] == "POST" and r[1].endswith(GRANTS_PATH)]
    assert len(posts) == START_RETRIES + 1
    standin.answer_503 = START_RETRIES + 1
    with pytest.raises(AdmissionRefused, match="is unreachable: HTTP 503"):
        ledger.grant("k2", "alice", "python3", wide_open())


def test_a_start_given_up_while_the_service_hung_is_given_back_when_it_answers(standin, make_ledger):
    # A hung service (SIGSTOP) resumed takes the queued requests of starts this server gave up on: what it
    # granted for them must not stay held (it counted in the user's limits) until a lease period passes.
    ledger = make_ledger(renew_every=3600)
    ledger.grant("k1", "alice", "python3", wide_open())
    standin.answer_503 = START_RETRIES + 1
    with pytest.raises(AdmissionRefused, match="is unreachable"):
        ledger.grant("k2", "alice", "python3", wide_open())
    # ... and then the service takes k2's request after all.
    standin.ledger.grant("k2", "alice", "python3", resolve(standin.policy, "alice", "python3"), None)
    standin.owner["k2"] = ("alice", "")
    standin.granted_at["k2"] = time.monotonic()  # young: the service's own lease check would keep it a while
    assert ledger.lease.renew() is True
    assert [g.kernel_id for g in standin.ledger.grants()] == ["k1"]
    deletes = [r for r in standin.requests if r[0] == "DELETE"]
    assert [r[1].rsplit("/", 1)[-1] for r in deletes] == ["k2"]
    assert ledger.lease.renew() is True  # given back once: nothing more to do
    assert len([r for r in standin.requests if r[0] == "DELETE"]) == 1


def test_the_next_start_gives_back_a_start_given_up_before_it_asks_and_fits(standin, make_ledger):
    # The renewal is a lease period away: the user's next start comes first, and must not find the orphan
    # grant still counted (the three-user e2e test's last start was refused for it).
    alice, bob = make_ledger(renew_every=3600), make_ledger("bob-token", renew_every=3600)
    alice.grant("k1", "alice", "python3", wide_open())
    bob.grant("b1", "bob", "python3", wide_open())
    bob.grant("b2", "bob", "python3", wide_open())
    standin.answer_503 = START_RETRIES + 1
    with pytest.raises(AdmissionRefused, match="is unreachable"):
        alice.grant("k2", "alice", "python3", wide_open())
    # The service took k2's request after all, and the host is full (0.5 of each device each, four in all).
    standin.ledger.grant("k2", "alice", "python3", resolve(standin.policy, "alice", "python3"), None)
    standin.owner["k2"], standin.granted_at["k2"] = ("alice", ""), time.monotonic()
    assert sum(u["granted"] for u in standin.ledger.device_grants()) == 2 * TOTAL
    assert alice.grant("k3", "alice", "python3", wide_open()).caps == {0: TOTAL // 2}  # k2's room: GPU-bbbb
    asked = [
        (method, body["kernel_id"] if method == "POST" else path.rsplit("/", 1)[-1])
        for method, path, _, body in standin.requests
        if GRANTS_PATH in path
    ]
    assert asked[-2:] == [("DELETE", "k2"), ("POST", "k3")]
    assert sorted(standin.owner) == ["b1", "b2", "k1", "k3"]
    assert alice.lease.renew() is True
    assert len([r for r in standin.requests if r[0] == "DELETE"]) == 1  # given back once


def test_a_start_given_up_and_asked_again_keeps_what_the_service_granted_it(standin, make_ledger):
    ledger = make_ledger(renew_every=3600)
    standin.answer_503 = START_RETRIES + 1
    with pytest.raises(AdmissionRefused, match="is unreachable"):
        ledger.grant("k1", "alice", "python3", wide_open())
    standin.ledger.grant("k1", "alice", "python3", resolve(standin.policy, "alice", "python3"), None)
    standin.owner["k1"], standin.granted_at["k1"] = ("alice", ""), time.monotonic()
    # The same kernel id asked again (a client-chosen id): the service's answer is its grant, not given back.
    assert ledger.grant("k1", "alice", "python3", wide_open()).caps == {1: TOTAL // 2}
    assert ledger.lease.renew() is True
    assert [r for r in standin.requests if r[0] == "DELETE"] == []
    assert [g.kernel_id for g in standin.ledger.grants()] == ["k1"]


def test_a_change_while_the_service_is_down_is_refused_and_the_cap_stays(standin, make_ledger):
    ledger = make_ledger()
    ledger.grant("k1", "alice", "python3", wide_open())
    standin.stop()
    outcome = ledger.change("k1", parse_cap("0.6"))
    assert outcome.status == "refused" and "is unreachable" in outcome.message
    assert outcome.grant.caps == {1: TOTAL // 2} == ledger.get("k1").caps


def test_a_release_while_the_service_is_down_is_done_by_the_next_lease(standin, make_ledger):
    ledger = make_ledger(renew_every=3600)
    ledger.grant("k1", "alice", "python3", wide_open())
    ledger.grant("k2", "alice", "python3", wide_open())
    standin.granted_at["k1"] = 0  # past the service's start grace: an unlisted k1 is released
    standin.stop()
    ledger.release("k1")
    assert ledger.lease.renew() is False
    standin.start()
    assert ledger.lease.renew() is True
    assert standin.leases[-1]["kernels"] == [{"kernel_id": "k2", "pids": []}]
    assert [g.kernel_id for g in standin.ledger.grants()] == ["k2"]


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"not json", "not JSON"),
        (b'{"grant": {"kernel_id": "k1"}}', "cannot use"),
        (b"x" * (2 * 1024 * 1024), "over"),
    ],
)
def test_an_answer_that_is_no_grant_is_a_refusal(standin, make_ledger, raw, words):
    standin.raw_answer = raw
    with pytest.raises(AdmissionRefused, match=words):
        make_ledger(start_retries=0).grant("k1", "alice", "python3", wide_open())


def test_a_grant_on_a_device_this_server_does_not_see_is_refused_and_given_back_at_once(standin):
    # Issue 19: the refusal said "GPU budget full", and the service kept the grant until the lease ran out.
    ledger = RemoteLedger(SERVER_DEVICES[:1], standin.url, "alice-token", retry_delay=0.01)
    with pytest.raises(AdmissionRefused) as refused:
        ledger.grant("k1", "alice", "python3", wide_open())
    assert refused.value.reason == "GPU quota service has other GPUs"
    assert "granted device 'GPU-aaaa', which this server does not have: it has 'GPU-bbbb'" in str(refused.value)
    assert "given back" in str(refused.value)
    assert ledger.grants() == []
    assert standin.last("DELETE")[1].endswith("/k1") and standin.ledger.grants() == []


# --- the lease ----------------------------------------------------------------------------------------


def wait_for(condition, what: str, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.01)


def test_the_lease_is_renewed_in_a_thread_listing_every_kernel_and_stops_at_close(standin, make_ledger):
    standin.lease_seconds = 0.2  # renewals every lease_seconds / 4
    ledger = make_ledger()
    ledger.grant("k1", "alice", "python3", wide_open())
    ledger.grant("k2", "alice", "python3", wide_open())
    wait_for(lambda: len(standin.leases) >= 3, "three renewals")
    assert {k["kernel_id"] for k in standin.leases[-1]["kernels"]} == {"k1", "k2"}
    ledger.close()
    assert not [t for t in threading.enumerate() if t.name == "gpu-quota-lease"]
    count = len(standin.leases)
    ledger.lease.renew()  # by hand still works; the thread is gone
    assert len(standin.leases) == count + 1


def test_a_restarted_service_relearns_the_kernels_at_the_next_renewal(standin, make_ledger):
    ledger = make_ledger(renew_every=0.05)
    ledger.grant("k1", "alice", "python3", wide_open())
    wait_for(lambda: standin.leases, "the first renewal")
    standin.stop()
    # Connection refused: the renewer keeps trying (retry_delay apart) and says so once.
    time_down = len(standin.leases)
    standin.start()
    wait_for(lambda: len(standin.leases) > time_down, "a renewal after the restart")
    assert standin.leases[-1]["kernels"][0]["kernel_id"] == "k1"
    assert ledger.get("k1") is not None


def test_kernels_the_service_released_are_forgotten(standin, make_ledger):
    ledger = make_ledger(renew_every=3600)
    ledger.grant("k1", "alice", "python3", wide_open())
    standin.owner["k1"] = ("alice", "another server")  # so this server's lease releases nothing
    standin.leases.clear()
    # The service released k1 (its lease ran out while this server was cut off): the lease answer says so.
    original = Lease.post

    def released_k1(handler):
        handler.answer(200, {"lease_seconds": 60, "released": ["k1", "not-mine"]})

    Lease.post = released_k1
    try:
        assert ledger.lease.renew() is True
    finally:
        Lease.post = original
    assert ledger.get("k1") is None


def test_the_lease_names_the_kernels_processes(standin, make_ledger, monkeypatch):
    import subprocess
    import sys

    from gpu_quota_ext.shared.env_vars import KERNEL_ID

    ledger = make_ledger(renew_every=3600)
    roots = {}
    # What the server gives it (manager.py): usage.attribution's finding over the kernels' own processes.
    ledger.subscribe(LeaseHooks(processes=lambda kernel_ids: processes_by_kernel(kernel_ids, roots)))
    ledger.grant("k1", "alice", "python3", wide_open())
    ledger.grant("k2", "alice", "python3", wide_open())
    command = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    by_environment = subprocess.Popen(command, stdin=subprocess.PIPE, env={KERNEL_ID: "k1"})
    by_tree = subprocess.Popen(command, stdin=subprocess.PIPE, env={})  # a kernel's own process: no variable needed
    roots[by_tree.pid] = "k2"
    try:
        assert ledger.lease.renew()
        # (the lease thread's own first renewal may land after this one: look at every renewal)
        listed = [k for lease in standin.leases for k in lease["kernels"]]
        assert {"kernel_id": "k1", "pids": [by_environment.pid]} in listed
        assert {"kernel_id": "k2", "pids": [by_tree.pid]} in listed
    finally:
        for child in (by_environment, by_tree):
            child.stdin.close()
            child.wait(10)


def test_usage_shows_the_hosts_budget_and_every_users_grants_after_a_renewal(standin, make_ledger):
    alice, bob = make_ledger(renew_every=3600), make_ledger("bob-token", renew_every=3600)
    alice.lease.start = lambda: None  # its renewals are this test's own: "before" is before any
    alice.grant("k1", "alice", "python3", wide_open())
    bob.grant("k2", "bob", "python3", wide_open())  # packed on the same device, GPU-aaaa
    # its own, before
    assert [(u["budget"], u["granted"]) for u in alice.device_grants()] == [(None, 0), (None, TOTAL // 2)]
    assert alice.lease.renew()
    assert [(u["uuid"], u["budget"], u["granted"], u["kernels"]) for u in alice.device_grants()] == [
        ("GPU-bbbb", TOTAL, 0, 0),
        ("GPU-aaaa", TOTAL, TOTAL, 2),
    ]


# --- the choice of ledger -------------------------------------------------------------------------------


def test_the_server_asks_the_service_when_the_hub_names_one(standin, monkeypatch, caplog):
    policy = build_policy("1.0", "1.0")
    monkeypatch.delenv(SERVICE_URL_ENV, raising=False)
    assert isinstance(_make_ledger(SERVER_DEVICES, policy), LocalLedger)
    monkeypatch.setenv(SERVICE_URL_ENV, standin.url)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "alice-token")
    with caplog.at_level(logging.INFO, logger="gpu_quota_ext"):
        ledger = _make_ledger(SERVER_DEVICES, policy)
    try:
        assert isinstance(ledger, RemoteLedger)
        assert [r.getMessage() for r in caplog.records if "is in charge" in r.getMessage()] == [
            f"gpu-quota-ext: the host's GPU quota service at {standin.url} is in charge ({SERVICE_URL_ENV}): it "
            "decides "
            "every cap and admission; this server's c.GpuQuota default_cap, max_cap, caps, overcommit, placement and "
            "on_full are ignored"
        ]
        # The local policy says a whole device; the service's says half.
        assert ledger.grant("k1", "alice", "python3", resolve(policy, "alice", "python3")).caps == {1: TOTAL // 2}
    finally:
        ledger.close()


def test_a_service_url_without_a_token_stops_the_server(monkeypatch):
    monkeypatch.setenv(SERVICE_URL_ENV, "http://127.0.0.1:1/services/gpu-quota/")
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
    monkeypatch.delenv("JPY_API_TOKEN", raising=False)
    with pytest.raises(PolicyError, match=r"GPU_QUOTA_SERVICE_URL is set .* no JUPYTERHUB_API_TOKEN"):
        _make_ledger(SERVER_DEVICES, build_policy("0.25", "1.0"))


@pytest.mark.parametrize(
    "url, why",
    [
        ("abc", "it must start with http:// or https://"),
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://quota:99999/", "Port out of range"),
        ("http:///services/gpu-quota/", "it names no host"),
        ("http://quota/services/gpu quota/", "spaces or control characters"),
        ("http://quota/services/gpu-quota/?x=1", "without ? or #"),
    ],
)
def test_a_service_url_that_is_no_url_stops_the_server_even_with_a_token(monkeypatch, url, why):
    """Issue 19: such a URL made every kernel start a 500 with three tracebacks."""
    monkeypatch.setenv(SERVICE_URL_ENV, url)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "a-token")
    with pytest.raises(PolicyError) as refused:
        _make_ledger(SERVER_DEVICES, build_policy("0.25", "1.0"))
    assert str(refused.value).startswith(f"$GPU_QUOTA_SERVICE_URL = {url!r} is not the URL") and why in str(
        refused.value
    )
    monkeypatch.setenv(SERVICE_URL_ENV, "https://[::1]:8443/services/gpu-quota/")
    assert _make_ledger(SERVER_DEVICES, build_policy("0.25", "1.0")).url == "https://[::1]:8443/services/gpu-quota/"


# --- the host's broker: the room call, the lease's park report and long poll ------------------------------


def test_the_ledger_offers_the_host_broker_and_the_room_call_names_this_server(standin, make_ledger):
    ledger = make_ledger()
    assert isinstance(ledger, HostRooms)
    standin.room_answer = (200, {"go": ["k1"], "park": [], "waiting": {}, "told": {}})
    body = {"park": [], "demands": [{"kernel_id": "k1", "need": {"GPU-aaaa": GiB}}]}
    assert ledger.room(body) == {"go": ["k1"], "park": [], "waiting": {}, "told": {}}
    assert standin.rooms == [{**body, "server": ""}]
    standin.room_answer = (403, {"message": "kernel k1 is another user's"})
    with pytest.raises(OSError, match="HTTP 403: kernel k1 is another user's"):
        ledger.room(body)
    standin.stop()
    with pytest.raises(OSError, match="unreachable"):
        ledger.room(body)


def test_the_lease_carries_the_park_report_and_hands_over_the_kernels_the_service_asks_to_park(standin, make_ledger):
    ledger = make_ledger(renew_every=3600)
    ledger.grant("k1", "alice", "python3", wide_open())
    ledger.close()  # its renewer is done: the renewals here are the test's own
    report = [{"kernel_id": "k1", "state": "idle", "idle_for": 61.0, "parkable": True}]
    asked = []
    ledger.subscribe(LeaseHooks(park_report=lambda: report, on_park_requests=asked.append))
    standin.park_next = ["k1", "not-mine", 7, ["k1"], "k1"]
    assert ledger.lease.renew() is True
    assert standin.leases[-1]["park"] == report and "wait" not in standin.leases[-1]
    assert asked == [["k1"]]  # only this server's kernels, once each
    assert ledger.lease.renew() is True and asked == [["k1"]]


def test_the_lease_thread_sends_the_parkers_report_as_the_event_loop_published_it_and_never_runs_its_round(
    standin, make_ledger
):
    # Parker.round() reads what the event loop owns (its records, the last sample, the kernels' activity): only the
    # loop runs it, after each sample; the lease's thread sends the report it published then.
    from gpu_quota_ext.parking import Parker, ParkSettings
    from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
    from gpu_quota_ext.usage import Sample
    from gpu_quota_ext.usage.sampling import DeviceReading

    from .fakes import ParkerKernels, StillMonitor

    standin.lease_seconds = 1  # renewals every 0.25 s
    ledger = make_ledger()
    sample = Sample(
        state="ok", time=time.time(), devices={0: DeviceReading(0, GiB)}, kernels={"k1": {0: GiB}}, pids={"k1": (1,)}
    )
    devices = {d.index: d for d in SERVER_DEVICES}
    parker = Parker(
        ParkSettings(), FakeCheckpoint(), ParkerKernels({"k1": "idle"}, idle_for=600), ledger, devices,
        StillMonitor(sample), host=lambda: (None, None),
        reports_to_host=True,  # as the manager makes it where a lease reads the report
    )
    parker.driver_problem = None
    rounds, reads = [], []
    real_round, real_report = parker.round, parker.host_report

    def round_():
        rounds.append(threading.current_thread().name)
        return real_round()

    def host_report():
        reads.append(threading.current_thread().name)
        return real_report()

    parker.round = round_
    ledger.subscribe(LeaseHooks(park_report=host_report))
    ledger.grant("k1", "alice", "python3", wide_open())  # the lease's thread starts: nothing published yet

    async def one_sample():
        parker.on_sample(sample)  # the loop publishes after its sample
        await parker.stop()

    asyncio.run(one_sample())
    published = parker.host_report()
    assert [k["kernel_id"] for k in published] == ["k1"] and published[0]["idle_for"] >= 600
    wait_for(lambda: any(lease.get("park") == published for lease in standin.leases), "a lease with the report")
    assert "gpu-quota-lease" in reads  # the lease's thread read the report ...
    assert rounds and set(rounds) == {threading.main_thread().name}  # ... and only the loop's thread made it


def test_the_renewer_waits_in_a_long_poll_renews_at_once_after_an_early_answer_and_close_ends_it(
    standin, make_ledger
):
    standin.lease_seconds = 8  # renewals every 2 s: each a long poll of 2 s
    ledger = make_ledger()
    asked = threading.Event()
    ledger.subscribe(LeaseHooks(on_park_requests=lambda kernel_ids: asked.set()))
    ledger.grant("k1", "alice", "python3", wide_open())
    wait_for(lambda: len(standin.leases) >= 2 and standin.wake is not None, "the renewer in its long poll")
    assert standin.leases[-1]["wait"] == 2.0
    count = len(standin.leases)
    started = time.monotonic()
    standin.park_next = ["k1"]
    standin.loop.call_soon_threadsafe(standin.wake.set)  # the service has a kernel of this server to park
    assert asked.wait(5)
    wait_for(lambda: len(standin.leases) >= count + 1, "the next renewal, at once")
    assert time.monotonic() - started < 1.5, "the renewal after an early answer waited out its interval"
    closing = time.monotonic()
    ledger.close()  # in the middle of its next long poll
    assert time.monotonic() - closing < 1.0
    assert not [t for t in threading.enumerate() if t.name == "gpu-quota-lease"]


def test_a_service_without_the_host_broker_gets_plain_renewals(standin, make_ledger, caplog):
    standin.plain_leases = True
    with caplog.at_level(logging.INFO, logger="gpu_quota_ext"):  # the renewer's first renewal may be the one refused
        ledger = make_ledger(renew_every=3600)
        ledger.grant("k1", "alice", "python3", wide_open())
        ledger.close()  # its renewer is done: the renewals here are the test's own
        standin.leases.clear()
        assert ledger.lease.renew() is True
        assert ledger.lease.renew() is True
    assert [set(lease) for lease in standin.leases] == [{"server", "kernels"}] * 2
    assert len([r for r in caplog.records if "does not broker device memory" in r.getMessage()]) == 1


def test_a_lease_refused_for_another_reason_keeps_the_park_states(standin, make_ledger):
    ledger = make_ledger(renew_every=3600)
    ledger.grant("k1", "alice", "python3", wide_open())
    ledger.close()
    standin.refuse_leases = True
    assert ledger.lease.renew() is False  # refused with park states, and without: not a service of an older version
    standin.refuse_leases = False
    standin.leases.clear()
    assert ledger.lease.renew() is True
    assert "park" in standin.leases[-1]
