"""The status answer of a real server has exactly the fields shared.contract lists, so the contract cannot drift.

Each kernel's "park" object (PARK_FIELDS) is one of them: every kernel has it, with exactly the contract's
fields and states.
"""

import json

import pytest

from gpu_quota_ext.shared import contract

from .fake_gpu import fake_gpu_config
from .kernels import start_kernel

PARK = "park"  # each kernel's park object in the status answer (shared.contract, PARK_FIELDS)


def assert_park_object(park) -> None:
    assert set(park) == set(contract.PARK_FIELDS)
    assert park["state"] in contract.PARK_STATES
    assert isinstance(park["parkable"], bool)


@pytest.fixture
def jp_server_config():
    return fake_gpu_config("warn")


async def test_status_answer_has_exactly_the_contracts_fields(jp_fetch, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    state = json.loads((await jp_fetch(*contract.STATUS_PATH.lstrip("/").split("/"))).body)

    assert set(state) == set(contract.STATUS_FIELDS)
    assert state["devices"], "the fake GPUs are listed"
    for device in state["devices"]:
        assert set(device) == set(contract.STATUS_DEVICE_FIELDS)
    kernels = [k for k in state["kernels"] if k["id"] == kernel_id]
    assert len(kernels) == 1
    for kernel in state["kernels"]:
        assert set(kernel) == set(contract.KERNEL_FIELDS)
        assert kernel["devices"]
        for device in kernel["devices"]:
            assert set(device) == set(contract.KERNEL_DEVICE_FIELDS)


async def test_the_kernel_route_answers_under_the_contracts_path(jp_fetch, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    path = contract.kernel_path(kernel_id).lstrip("/").split("/")
    answer = json.loads((await jp_fetch(*path)).body)
    assert answer["id"] == kernel_id
    assert set(answer) == set(contract.KERNEL_FIELDS)


async def test_park_object_has_exactly_the_contracts_fields(jp_fetch, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    state = json.loads((await jp_fetch(*contract.STATUS_PATH.lstrip("/").split("/"))).body)
    kernels = [k for k in state["kernels"] if k["id"] == kernel_id]
    assert kernels and all(PARK in kernel for kernel in state["kernels"])
    for kernel in state["kernels"]:
        assert_park_object(kernel[PARK])
    assert_park_object(json.loads((await jp_fetch(*contract.kernel_path(kernel_id).lstrip("/").split("/"))).body)[PARK])
