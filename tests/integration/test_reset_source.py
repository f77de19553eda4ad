"""Issue 10, item 12: a reset records who asked for it, and a clamp says what is true.

Real server, real kernels, the REST API as the sidebar (the server's user) and a kernel (its secret) use it.
"""

import json

import pytest
from traitlets.config import Config

from gpu_quota_ext.shared.contract import KERNEL_TOKEN_HEADER as TOKEN_HEADER
from gpu_quota_ext.shared.sizes import GiB

from .fake_gpu import manager_of
from .kernels import start_kernel, static_devices_config


@pytest.fixture
def jp_server_config():
    # One 80 GiB device, a 40 GiB budget, 20 GiB caps: two kernels fill it.
    return Config(static_devices_config("80GiB", default_cap="0.25", max_cap="0.5", overcommit=0.5))


async def put(jp_fetch, kernel_id, body, token=None):
    headers = {TOKEN_HEADER: token} if token else {}
    response = await jp_fetch(
        "api", "gpu-quota", "kernels", kernel_id, method="PUT", body=json.dumps(body), headers=headers
    )
    return json.loads(response.body)


@pytest.mark.parametrize("who", ["user", "kernel"])
async def test_a_reset_clamped_by_the_budget_says_who_asked_and_what_was_left(jp_fetch, jp_serverapp, who):
    a = await start_kernel(jp_fetch)
    b = await start_kernel(jp_fetch)
    await put(jp_fetch, a, {"cap": "8GiB"})  # a gives 12 GiB back
    await put(jp_fetch, b, {"cap": "0.375"})  # b takes 10 of them: 2 GiB of the budget left
    token = manager_of(jp_serverapp).token_for(a) if who == "kernel" else None

    answer = await put(jp_fetch, a, {"reset": True}, token)

    assert answer["outcome"] == "clamped"
    assert answer["message"] == "clamped to 10.0 GiB: only 2.0 GiB of device 0's budget was left"
    assert answer["kernel"]["source"] == f"{who} request (reset, clamped to the budget)"
    assert answer["kernel"]["devices"][0]["cap"] == 10 * GiB
    # Once the budget has room, a reset is the policy's cap again, whoever asks.
    await put(jp_fetch, b, {"cap": "8GiB"})
    answer = await put(jp_fetch, a, {"reset": True}, token)
    assert (answer["outcome"], answer["kernel"]["source"]) == ("granted", "policy")
    assert answer["kernel"]["devices"][0]["cap"] == 20 * GiB
