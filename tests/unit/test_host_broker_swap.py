"""A swap on a hub host, as a user server's HostBroker puts it on the wire (shared.service_contract ROOM_PATH,
KERNEL_PARK) and reads the service's answer: a park under way that releases as it copies says so, a fast resume's
demand says it may wait, and a swap's go says what of its need other parks are still freeing (Plan.freeing). The
new keys go only where true: services older than them refuse a key they do not know."""

import asyncio
from types import SimpleNamespace

from gpu_quota_ext.parking import BrokerSettings, Demand, DeviceView, HostBroker, HostView, KernelView, Round
from gpu_quota_ext.parking.host_broker import kernel_park, plan_from, room_request

GiB = 1 << 30
UUIDS = {0: "GPU-0", 1: "GPU-1"}


def round_of(kernels=(), demands=()):
    devices = tuple(DeviceView(i, f"GPU {i}", 140 * GiB, 100 * GiB) for i in UUIDS)
    return Round(devices, tuple(kernels), tuple(demands), (), HostView(), BrokerSettings(), 10.0)


def parking(kernel_id, releases_as_copied=True):
    return KernelView(kernel_id, "parking", {0: 56 * GiB}, {0: 60 * GiB}, releases_as_copied=releases_as_copied)


def test_a_park_under_way_says_it_releases_as_it_copies_only_when_it_does():
    assert kernel_park("k1", "parking", None, False, 0, True) == {
        "kernel_id": "k1", "state": "parking", "idle_for": None, "parkable": False, "releases_as_copied": True,
    }
    assert "releases_as_copied" not in kernel_park("k1", "parking", None, False, 0, False)
    assert "releases_as_copied" not in kernel_park("k1", "parking", None, False)
    assert "releases_as_copied" not in kernel_park("k1", "parked", None, False, 0, True)  # a park under way only


def test_a_room_call_says_which_park_releases_and_which_resume_may_wait_only_where_true():
    body = room_request(
        round_of(
            [parking("V"), parking("W", releases_as_copied=False)],
            [Demand("A", {0: 56 * GiB}, 1.0, may_wait=True), Demand("B", {1: GiB}, 2.0)],
        ),
        UUIDS,
    )
    assert [entry.get("releases_as_copied") for entry in body["park"]] == [True, None]
    assert "releases_as_copied" not in body["park"][1]
    assert body["demands"] == [
        {"kernel_id": "A", "need": {"GPU-0": 56 * GiB}, "may_wait": True},
        {"kernel_id": "B", "need": {"GPU-1": GiB}},
    ]


def test_a_swaps_go_says_what_other_parks_are_still_freeing_by_this_servers_devices():
    answer = {"go": ["A"], "freeing": {"A": {"GPU-0": 30 * GiB, "GPU-1": 0}}}
    assert plan_from(answer, ["A"], UUIDS).freeing == {"A": {0: 30 * GiB}}  # 0 bytes: nothing to wait for
    assert plan_from({"go": ["A"]}, ["A"], UUIDS).freeing == {}  # a go that is no swap


def test_what_is_freeing_is_read_only_for_this_servers_go_and_only_where_it_can_be_true():
    answer = {
        "go": ["A", "B", "Z", 7],
        "freeing": {
            "A": {
                "GPU-0": 5 * GiB,
                "GPU-9": GiB,  # a device this server does not have
                "GPU-1": True,  # not a byte count
            },
            "B": {"GPU-0": -1, "GPU-1": 1 << 60},  # neither can be true
            "C": {"GPU-0": GiB},  # this server's, but not in this answer's go
            "Z": {"GPU-0": GiB},  # another server's kernel
            "D": "30 GiB",
        },
    }
    assert plan_from(answer, ["A", "B", "C", "D"], UUIDS).freeing == {"A": {0: 5 * GiB}}
    for junk in ([], "x", None, {"A": [1]}, {"A": {"GPU-0": 1.5}}, {"A": {"GPU-0": "1"}}, {"A": {"GPU-1": None}}):
        assert plan_from({"go": ["A"], "freeing": junk}, ["A"], UUIDS).freeing == {}, junk


def test_a_park_that_begins_to_release_is_told_to_the_service_at_once_and_once():
    # No demand of this server waits: before, the service heard of the park at the next lease report (up to 15 s
    # later), when a fast park takes 1 to 7 s; another user's resume could not swap with it.
    calls = []
    broker = HostBroker(SimpleNamespace(room=lambda body: calls.append(body) or {}), UUIDS)
    asyncio.run(broker.decide(round_of([parking("W", releases_as_copied=False)])))
    assert calls == []  # a park that frees nothing until it ends: the lease reports it
    asyncio.run(broker.decide(round_of([parking("V")])))
    assert len(calls) == 1 and calls[0]["demands"] == [] and calls[0]["park"][0]["releases_as_copied"] is True
    asyncio.run(broker.decide(round_of([parking("V")])))
    assert len(calls) == 1  # told already
    asyncio.run(broker.decide(round_of([KernelView("V", "parked", {0: GiB})])))
    assert len(calls) == 1  # the park ended: nothing to tell at once
    asyncio.run(broker.decide(round_of([parking("V")])))
    assert len(calls) == 2  # it parks again (a new park): told again


def test_a_releasing_park_is_told_again_when_the_service_did_not_hear_it():
    calls = []

    def down(body):
        calls.append(body)
        raise OSError("connection refused")

    broker = HostBroker(SimpleNamespace(room=down), UUIDS)
    asyncio.run(broker.decide(round_of([parking("V")])))
    broker.rooms = SimpleNamespace(room=lambda body: calls.append(body) or {})
    asyncio.run(broker.decide(round_of([parking("V")])))
    asyncio.run(broker.decide(round_of([parking("V")])))
    assert len(calls) == 2
