"""The service's request bodies: what the contract says is accepted; anything else is one clear 400."""

import pytest
from tornado import web

from gpu_quota_ext.hub.service.bodies import (
    MAX_KERNELS,
    parse_change_request,
    parse_grant_request,
    parse_lease_request,
    parse_room_request,
)
from gpu_quota_ext.hub.service.room import ParkReport
from gpu_quota_ext.parking.host_broker import kernel_park
from gpu_quota_ext.shared.service_contract import CONTEXT_ALLOWANCE, LEASE_RENEW


def status_of(call, body):
    with pytest.raises(web.HTTPError) as error:
        call(body)
    return error.value.status_code


def test_a_grant_request_as_the_contract_writes_it():
    body = {"server": "", "kernel_id": "5f1c-ab_9", "kernelspec": "python3", "allowed": ["GPU-a"]}
    assert parse_grant_request(body) == ("", "5f1c-ab_9", "python3", ["GPU-a"])


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        "x",
        {"server": "", "kernel_id": "../etc", "kernelspec": "p"},
        {"server": "", "kernel_id": "k" * 129, "kernelspec": "p"},
        {"server": "", "kernel_id": "x\n", "kernelspec": "p"},  # "$" alone let a final newline through
        {"server": "", "kernel_id": "kérnel", "kernelspec": "p"},  # ASCII only
        {"server": "", "kernel_id": "", "kernelspec": "p"},
        {"server": 3, "kernel_id": "k", "kernelspec": "p"},
        {
            "server": "",
            "kernel_id": "k",
            "kernelspec": "p",
            "user": "root",
        },  # the user is the token's, never the body's
        {"server": "", "kernel_id": "k", "kernelspec": "p", "allowed": "GPU-a"},
        {"server": "", "kernel_id": "k", "kernelspec": "p", "allowed": [1]},
    ],
)
def test_bad_grant_requests_are_400(body):
    assert status_of(parse_grant_request, body) == 400


def test_change_requests():
    assert parse_change_request({"reset": True}) == "reset"
    cap, device = parse_change_request({"cap": "25%", "device": "GPU-a"})
    assert (cap.fraction, device) == (0.25, "GPU-a")
    for body in (
        {"reset": True, "cap": "0.1"},
        {"reset": 1},
        {"cap": "lots"},
        {"cap": "0.1", "device": 0},
        {},
        [],
        {"cap": 1e400},
    ):
        assert status_of(parse_change_request, body) == 400, body


def test_lease_requests():
    assert parse_lease_request({"server": "", "kernels": [{"kernel_id": "k1", "pids": [1234]}]}) == (
        "",
        {"k1": (1234,)},
        None,
        None,
    )
    for kernels in (
        "all",
        [{"kernel_id": "k1", "pids": [True]}],
        [{"kernel_id": "k1", "pids": [-5]}],
        [{"kernel_id": "k1", "pids": [1]}],
        [{"kernel_id": "k1", "pids": list(range(2, 2000))}],
        [{"kernel_id": "k1", "extra": 1}],
        [{"kernel_id": "k1"}] * 5000,
    ):
        assert status_of(parse_lease_request, {"server": "", "kernels": kernels}) == 400, str(kernels)[:80]


PARK = {"kernel_id": "k1", "state": "idle", "idle_for": 12.5, "parkable": True}


def test_a_lease_may_carry_its_kernels_park_states_and_a_bounded_wait():
    body = {"server": "nb", "kernels": [], "park": [PARK], "wait": 15}
    assert parse_lease_request(body) == ("nb", {}, {"k1": ParkReport("idle", 12.5, True)}, 15.0)
    for wait in (-1, LEASE_RENEW + 0.1, True, "5", float("nan"), None):
        assert status_of(parse_lease_request, {**body, "wait": wait}) == 400, wait


def test_a_fast_parked_kernel_may_say_what_its_park_left_on_the_device():
    entry = {**PARK, "state": "parked", "idle_for": None, "parkable": False, "stays": 612 << 20}
    body = {"server": "nb", "kernels": [], "park": [entry]}
    assert parse_lease_request(body)[2] == {"k1": ParkReport("parked", None, False, 612 << 20)}
    assert kernel_park("k1", "parked", None, False, 612 << 20) == entry  # what a server sends, the service reads
    assert "stays" not in kernel_park("k1", "parked", None, False)  # never sent otherwise: older services refuse it


@pytest.mark.parametrize(
    "entry",
    [
        {**PARK, "state": "asleep"},
        {**PARK, "idle_for": -1},
        {**PARK, "idle_for": "long"},
        {**PARK, "idle_for": 1e12},
        {**PARK, "parkable": 1},
        {**PARK, "stays": -1},
        {**PARK, "stays": CONTEXT_ALLOWANCE + 1},
        {**PARK, "stays": True},
        {**PARK, "stays": 612.5},
        {**PARK, "kernel_id": "../x"},
        {**PARK, "extra": 1},
        "k1",
    ],
)
def test_bad_park_reports_are_400(entry):
    assert status_of(parse_lease_request, {"server": "", "kernels": [], "park": [entry]}) == 400
    assert status_of(parse_room_request, {"server": "", "park": [entry], "demands": []}) == 400


def test_a_room_request_as_the_contract_writes_it():
    body = {"server": "", "park": [PARK], "demands": [{"kernel_id": "k1", "need": {"GPU-a": 5 << 30}}]}
    assert parse_room_request(body) == (
        "", {"k1": ParkReport("idle", 12.5, True)}, {"k1": {"GPU-a": 5 << 30}}, None, frozenset()
    )
    assert parse_room_request({"server": "x"}) == ("x", {}, {}, None, frozenset())
    asking = {"server": "x", "host_park": {"kernel_id": "k1", "bytes": 56 << 30}}
    assert parse_room_request(asking) == ("x", {}, {}, ("k1", 56 << 30), frozenset())


def test_a_swap_s_two_words_are_optional_booleans_absent_false():
    parking = {**PARK, "state": "parking", "idle_for": None, "parkable": False, "releases_as_copied": True}
    demands = [
        {"kernel_id": "k2", "need": {"GPU-a": 5 << 30}, "may_wait": True},
        {"kernel_id": "k3", "need": {"GPU-a": 1 << 30}, "may_wait": False},
        {"kernel_id": "k4", "need": {"GPU-a": 1 << 30}},
    ]
    body = {"server": "", "park": [parking, {**PARK, "kernel_id": "k5"}], "demands": demands}
    server, reports, needs, _, may_wait = parse_room_request(body)
    assert reports == {"k1": ParkReport("parking", None, False, 0, True), "k5": ParkReport("idle", 12.5, True)}
    assert set(needs) == {"k2", "k3", "k4"} and may_wait == frozenset({"k2"})
    assert parse_room_request({"server": "", "park": [PARK]})[1]["k1"].releases_as_copied is False
    lease = {"server": "", "kernels": [], "park": [parking]}
    assert parse_lease_request(lease)[2] == {"k1": ParkReport("parking", None, False, 0, True)}


@pytest.mark.parametrize("value", [1, 0, "true", None, [], {}])
def test_a_swap_s_words_that_are_not_booleans_are_refused_whole(value):
    entry = {**PARK, "releases_as_copied": value}
    for call, body in (
        (parse_room_request, {"server": "", "park": [entry]}),
        (parse_lease_request, {"server": "", "kernels": [], "park": [entry]}),
    ):
        with pytest.raises(web.HTTPError) as refused:
            call(body)
        assert refused.value.status_code == 400
        assert refused.value.log_message.startswith('"releases_as_copied" of kernel k1 must be true or false, not ')
    demand = {"kernel_id": "k1", "need": {"GPU-a": 1}, "may_wait": value}
    with pytest.raises(web.HTTPError) as refused:
        parse_room_request({"server": "", "demands": [demand]})
    assert refused.value.status_code == 400
    assert refused.value.log_message.startswith('"may_wait" of kernel k1 must be true or false, not ')


@pytest.mark.parametrize(
    "change",
    [
        {"user": "root"},  # the user is the token's
        {"server": None},
        {"demands": {"k1": {}}},
        {"demands": [{"kernel_id": "k1"}]},
        {"demands": [{"kernel_id": "k1", "may_wait": True}]},  # "need" is not optional: only "may_wait" is
        {"demands": [{"kernel_id": "k1", "need": {}, "may_wait": True, "extra": 1}]},  # unknown keys still refused
        {"demands": [{"kernel_id": "k1", "need": {}, "wait": True}]},
        {"demands": [{"need": {}, "may_wait": True}]},
        {"demands": [{"kernel_id": "k1", "need": {"GPU-a": -1}}]},
        {"demands": [{"kernel_id": "k1", "need": {"GPU-a": 1.5}}]},
        {"demands": [{"kernel_id": "k1", "need": {"GPU-a": True}}]},
        {"demands": [{"kernel_id": "k1", "need": {"GPU-a": 1 << 62}}]},
        {"demands": [{"kernel_id": "k1", "need": {f"GPU-{n}": 1 for n in range(65)}}]},
        {"demands": [{"kernel_id": "k1", "need": {}}, {"kernel_id": "k1", "need": {}}]},
        {"demands": [{"kernel_id": f"k{n}", "need": {}} for n in range(MAX_KERNELS + 1)]},
        {"park": [PARK, PARK]},
        {"park": [PARK] * (MAX_KERNELS + 1)},
        {"host_park": {"kernel_id": "k1"}},
        {"host_park": {"kernel_id": "k1", "bytes": -1}},
        {"host_park": {"kernel_id": "k1", "bytes": 1 << 62}},
        {"host_park": {"kernel_id": "k1", "bytes": 1.5}},
        {"host_park": {"kernel_id": "k1", "bytes": True}},
        {"host_park": {"kernel_id": "x\n", "bytes": 1}},
        {"host_park": {"kernel_id": "k1", "bytes": 1, "user": "root"}},
        {"host_park": ["k1", 1]},
    ],
)
def test_bad_room_requests_are_400(change):
    body = {"server": "", "park": [], "demands": [], **change}
    assert status_of(parse_room_request, body) == 400
