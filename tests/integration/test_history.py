"""The usage history routes on a real server, with real kernels, the fake NVML and the fake checkpoint driver:
each kernel's points follow what NVML and its allocator reports say, against its cap, with its park state;
`since` gives only newer points; the kernel route takes the kernel's own secret and no one else's; bad input
is one clear error; a kernel shut down leaves the history."""

import json
import time

import pytest
from tornado.httpclient import HTTPClientError

from gpu_quota_ext.shared import contract
from gpu_quota_ext.shared.sizes import GiB
from gpu_quota_ext.usage.history import POINTS_MAX

from .fake_gpu import POLL, fake_gpu_config, manager_of, next_samples, uses_gpu, wait_for
from .kernels import execute, shutdown_kernel, start_kernel

WAIT = 30.0  # a deadline on a busy 2-core machine, not a threshold


@pytest.fixture
def jp_server_config():
    return fake_gpu_config("warn", checkpoint_class="gpu_quota_ext.parking.fake_checkpoint.FakeCheckpoint")


async def history(jp_fetch, since=None):
    params = {} if since is None else {contract.HISTORY_SINCE: str(since)}
    return json.loads((await jp_fetch(*contract.HISTORY_PATH.lstrip("/").split("/"), params=params)).body)


async def kernel_history(jp_fetch, kernel_id, since=None, headers=None):
    params = {} if since is None else {contract.HISTORY_SINCE: str(since)}
    path = contract.kernel_path(kernel_id, contract.HISTORY_SUFFIX).lstrip("/").split("/")
    return json.loads((await jp_fetch(*path, params=params, headers=headers or {})).body)


async def error_code(call) -> int:
    with pytest.raises(HTTPClientError) as error:
        await call
    assert json.loads(error.value.response.body)["message"]
    return error.value.code


async def test_points_follow_nvml_and_the_allocator_against_the_cap(jp_fetch, jp_serverapp, fake_driver):
    kernel_id = await start_kernel(jp_fetch)
    manager = manager_of(jp_serverapp)
    grant = manager.ledger.get(kernel_id)
    pid, device = await uses_gpu(jp_serverapp, kernel_id, 3 * GiB)
    await jp_fetch(
        "api", "gpu-quota", "kernels", kernel_id, "usage", method="POST",
        body=json.dumps({"devices": [{"index": device, "allocated": 2 * GiB, "reserved": 5 * GiB // 2, "peak": None}]}),
    )

    def newest():
        points = manager.history.kernel(kernel_id) or []
        return points[-1] if points and points[-1].used == 3 * GiB and points[-1].reserved else None

    await wait_for(newest, timeout=WAIT)
    answer = await history(jp_fetch)
    assert tuple(answer) == contract.HISTORY_FIELDS
    assert answer["interval"] == POLL and answer["points_max"] == POINTS_MAX
    points = answer["kernels"][kernel_id]
    assert all(tuple(p) == contract.HISTORY_POINT_FIELDS for p in points)
    assert [p["t"] for p in points] == sorted(p["t"] for p in points)
    last = points[-1]
    assert last["used"] == 3 * GiB
    assert (last["allocated"], last["reserved"]) == (2 * GiB, 5 * GiB // 2)
    assert last["cap"] == grant.caps[device]
    assert last["hard_limit"] is None  # hard limits are off on this server
    assert last["park"] in ("idle", "busy")
    assert abs(last["t"] - time.time()) < WAIT

    # Incremental: only points after the last one seen, and the kernel still listed when none is newer.
    await next_samples(jp_serverapp, 2)
    newer = (await history(jp_fetch, since=last["t"]))["kernels"][kernel_id]
    assert newer and all(p["t"] > last["t"] for p in newer)
    future = await history(jp_fetch, since=time.time() + 3600)
    assert future["kernels"] == {kernel_id: []}

    # The one-kernel route gives the same points.
    one = await kernel_history(jp_fetch, kernel_id, since=last["t"] - 1e-6)
    assert tuple(one) == contract.KERNEL_HISTORY_FIELDS
    assert one["points"][0] == last
    await shutdown_kernel(jp_fetch, kernel_id)


async def test_park_periods_are_in_the_points(jp_fetch, jp_serverapp, fake_driver):
    kernel_id = await start_kernel(jp_fetch)
    manager = manager_of(jp_serverapp)
    pid, device = await uses_gpu(jp_serverapp, kernel_id, 2 * GiB)
    await wait_for(lambda: pid in manager.monitor.gpu_pids(kernel_id), timeout=WAIT)
    response = await jp_fetch("api", "gpu-quota", "kernels", kernel_id, "park", method="POST", body="{}")
    assert response.code == 202

    def parked_points():
        points = manager.history.kernel(kernel_id) or []
        return [p for p in points if p.park == "parked"]

    await wait_for(parked_points, timeout=WAIT)
    points = (await history(jp_fetch))["kernels"][kernel_id]
    parked = [p for p in points if p["park"] == "parked"]
    before = [p for p in points if p["park"] in ("idle", "busy") and p["used"] == 2 * GiB]
    assert before and parked
    # While parked NVML shows nothing for the process; the grant (the cap) is kept.
    assert all(p["used"] == 0 and p["cap"] == before[-1]["cap"] for p in parked)
    await shutdown_kernel(jp_fetch, kernel_id)


async def test_the_kernel_reads_its_own_history_with_its_secret_and_only_its_own(jp_fetch, jp_serverapp, fake_nvml):
    mine, other = await start_kernel(jp_fetch), await start_kernel(jp_fetch)
    manager = manager_of(jp_serverapp)
    await wait_for(lambda: manager.history.kernel(mine) and manager.history.kernel(other), timeout=WAIT)
    own = {contract.KERNEL_TOKEN_HEADER: manager.token_for(mine), "Authorization": ""}
    answer = await kernel_history(jp_fetch, mine, headers=own)
    assert answer["points"] and answer["points_max"] == POINTS_MAX
    # Its secret opens nothing else: not another kernel's history, not everyone's.
    assert await error_code(kernel_history(jp_fetch, other, headers=own)) == 403
    forged = {contract.KERNEL_TOKEN_HEADER: "forged", "Authorization": ""}
    assert await error_code(kernel_history(jp_fetch, mine, headers=forged)) == 403
    with pytest.raises(HTTPClientError) as everyone:
        await jp_fetch(*contract.HISTORY_PATH.lstrip("/").split("/"), headers=own)
    assert everyone.value.code == 403
    await shutdown_kernel(jp_fetch, mine)
    await shutdown_kernel(jp_fetch, other)


async def test_the_panel_of_the_kernel_charts_its_own_history(jp_fetch, jp_serverapp, fake_nvml):
    # `%gpucap panel` in the kernel reads the server's points with the kernel's own secret and draws them.
    kernel_id = await start_kernel(jp_fetch)
    service = manager_of(jp_serverapp)
    pid, device = await uses_gpu(jp_serverapp, kernel_id, 3 * GiB)
    await wait_for(lambda: any(p.used == 3 * GiB for p in service.history.kernel(kernel_id) or ()), timeout=WAIT)
    drawn = await execute(
        jp_serverapp,
        kernel_id,
        "from gpu_quota_ext.kernel.panel import GpuUsagePanel\n"
        "panel = GpuUsagePanel(start=False)\nprint(panel.chart.value)\npanel.close()",
    )
    assert drawn.count('<svg class="gpu-quota-chart"') == 1, drawn
    assert "NVML used (line): 3.0 GiB now" in drawn and "Cap (dashed): " in drawn
    await shutdown_kernel(jp_fetch, kernel_id)


async def test_bad_input_is_one_clear_error(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    for since in ("yesterday", "nan", "inf", "1e999", "", "1" * 5000):
        assert await error_code(history(jp_fetch, since=since)) == 400, since
        assert await error_code(kernel_history(jp_fetch, kernel_id, since=since)) == 400, since
    assert await error_code(kernel_history(jp_fetch, "no-such-kernel")) == 404
    await shutdown_kernel(jp_fetch, kernel_id)


async def test_a_kernel_shut_down_leaves_the_history(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    manager = manager_of(jp_serverapp)
    await wait_for(lambda: manager.history.kernel(kernel_id), timeout=WAIT)
    await shutdown_kernel(jp_fetch, kernel_id)
    await wait_for(lambda: manager.history.kernel(kernel_id) is None, timeout=WAIT)
    assert kernel_id not in (await history(jp_fetch))["kernels"]
    assert await error_code(kernel_history(jp_fetch, kernel_id)) == 404
