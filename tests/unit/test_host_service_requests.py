"""The service's request bodies: what the contract says is accepted; anything else is one clear 400."""

import pytest
from tornado import web

from gpu_quota_ext.hub.service.handlers import (
    parse_change_request,
    parse_grant_request,
    parse_lease_request,
)


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
