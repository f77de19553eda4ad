"""The REST API with a real server, real kernels and the fake NVML: what an admin or the sidebar sees."""

import json

import pytest
from tornado.httpclient import HTTPClientError

from gpu_quota_ext.shared.sizes import GiB

from .fake_gpu import POLL, fake_gpu_config, kernel_entry, manager_of, next_samples, status, uses_gpu
from .kernels import execute, shutdown_kernel, start_child_process, start_kernel


@pytest.fixture
def jp_server_config():
    return fake_gpu_config("warn")


def post_usage(jp_fetch, kernel_id: str, body: str, headers=None):
    """A usage report for the kernel (POST .../usage), with the headers given (the test's user token unless they
    say otherwise)."""
    return jp_fetch("api", "gpu-quota", "kernels", kernel_id, "usage", method="POST", body=body, headers=headers)


def put_cap(jp_fetch, kernel_id: str, body=None, headers=None, **kwargs):
    """A cap change for the kernel (PUT .../kernels/<id>): `body`, or what kwargs give tornado (a body_producer)."""
    return jp_fetch("api", "gpu-quota", "kernels", kernel_id, method="PUT", body=body, headers=headers, **kwargs)


async def expect_status(call, *codes):
    with pytest.raises(HTTPClientError) as error:
        await call
    assert error.value.code in codes, error.value
    return error.value


async def test_status_shows_nvml_usage_next_to_the_ledgers_caps(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    pid, device = await uses_gpu(jp_serverapp, kernel_id, 3 * GiB)
    grant = manager_of(jp_serverapp).ledger.get(kernel_id)
    fake_nvml.other_used[f"static-{device}"] = 1 * GiB  # someone else's process on the same GPU
    await next_samples(jp_serverapp)

    state = await status(jp_fetch)
    assert state["monitor"]["state"] == "ok"
    assert state["policy"]["enforce"] == "warn" and state["policy"]["poll_interval"] == POLL
    devices = {d["index"]: d for d in state["devices"]}
    assert devices[device]["used"] == 4 * GiB
    assert devices[1 - device]["used"] == 0
    entry = kernel_entry(state, kernel_id)
    assert entry["kernelspec"] == "python3"
    assert entry["last_action"] is None
    assert entry["devices"] == [
        {
            "index": device,
            "cap": grant.caps[device],
            "max_cap": grant.max_caps[device],
            "policy_cap": grant.policy_caps[device],
            "used": 3 * GiB,
            "allocated": None,
            "reserved": None,
            "peak": None,
            "reported_at": None,
        }
    ]
    # The answer matches the ledger, device by device and kernel by kernel.
    ledger = manager_of(jp_serverapp).ledger
    for row in ledger.device_grants():
        assert {k: devices[row["index"]][k] for k in row} == row
    assert {k["id"] for k in state["kernels"]} == {g.kernel_id for g in ledger.grants()}
    one = json.loads((await jp_fetch("api", "gpu-quota", "kernels", kernel_id)).body)
    assert one == entry
    await shutdown_kernel(jp_fetch, kernel_id)


async def test_a_subprocess_of_the_kernel_counts_for_the_kernel(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    child, _ = await uses_gpu(jp_serverapp, kernel_id, 2 * GiB, pid=await start_child_process(jp_serverapp, kernel_id))
    await next_samples(jp_serverapp)
    entry = kernel_entry(await status(jp_fetch), kernel_id)
    assert entry["devices"][0]["used"] == 2 * GiB
    assert manager_of(jp_serverapp).monitor.latest.pids[kernel_id] == (child,)
    await execute(jp_serverapp, kernel_id, "worker.kill(); worker.wait()")
    await shutdown_kernel(jp_fetch, kernel_id)


async def test_a_kernel_reports_its_allocator_with_its_own_secret(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    manager = manager_of(jp_serverapp)
    device = manager.ledger.get(kernel_id).devices[0]
    body = {"devices": [{"index": device, "allocated": 1000, "reserved": 2048, "peak": 4096}]}
    # The way the kernel-side code sends it: its secret in a header, no user token, no XSRF cookie.
    response = await post_usage(
        jp_fetch, kernel_id, json.dumps(body),
        headers={"X-GPU-Quota-Kernel-Token": manager.token_for(kernel_id), "Authorization": ""},
    )
    assert json.loads(response.body) == {"accepted": 1, "last_action": None}
    entry = kernel_entry(await status(jp_fetch), kernel_id)
    assert (entry["devices"][0]["allocated"], entry["devices"][0]["reserved"], entry["devices"][0]["peak"]) == (
        1000,
        2048,
        4096,
    )
    # The ledger is untouched: a report is usage, never a cap.
    assert entry["devices"][0]["cap"] == manager.ledger.get(kernel_id).caps[device]
    await shutdown_kernel(jp_fetch, kernel_id)


BAD_USAGE_BODIES = [
    "not json",
    "[]",
    "{}",
    '{"devices": {}}',
    '{"devices": [], "extra": 1}',
    '{"devices": [1]}',
    '{"devices": [{"allocated": 5}]}',
    '{"devices": [{"index": true, "allocated": 5}]}',
    '{"devices": [{"index": 7, "allocated": 5}]}',
    '{"devices": [{"index": DEV, "allocated": -1}]}',
    '{"devices": [{"index": DEV, "allocated": 1.5}]}',
    '{"devices": [{"index": DEV, "allocated": "5"}]}',
    '{"devices": [{"index": DEV, "reserved": 1, "color": "red"}]}',
    '{"devices": [{"index": DEV, "peak": 1}, {"index": DEV, "peak": 2}]}',
]


async def test_malformed_usage_reports_are_refused_without_changing_state(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    manager = manager_of(jp_serverapp)
    device = manager.ledger.get(kernel_id).devices[0]
    grant_before = manager.ledger.get(kernel_id)
    for body in BAD_USAGE_BODIES:
        error = await expect_status(post_usage(jp_fetch, kernel_id, body.replace("DEV", str(device))), 400)
        assert error.response.body, body
    assert manager.reports.get(kernel_id) is None
    assert manager.ledger.get(kernel_id) == grant_before
    # Malformed cap changes too.
    for body in ['{"cap": "lots"}', '{"cap": 0}', '{"reset": false}', '{"cap": "0.3", "device": -1}', "[1]"]:
        await expect_status(put_cap(jp_fetch, kernel_id, body), 400)
    assert manager.ledger.get(kernel_id) == grant_before
    await shutdown_kernel(jp_fetch, kernel_id)


async def test_wrong_secret_and_unknown_kernel(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    manager = manager_of(jp_serverapp)
    device = manager.ledger.get(kernel_id).devices[0]
    body = json.dumps({"devices": [{"index": device, "allocated": 1}]})
    other = await start_kernel(jp_fetch)
    # Another kernel's secret is not this kernel's.
    others = {"X-GPU-Quota-Kernel-Token": manager.token_for(other), "Authorization": ""}
    await expect_status(post_usage(jp_fetch, kernel_id, body, headers=others), 403)
    # Nor is a secret no kernel has, in any encoding a header can carry (non-ASCII once gave a 500).
    cap_before = manager.ledger.get(kernel_id).caps[device]
    for forged in ("forged", "é" * 43):
        forging = {"X-GPU-Quota-Kernel-Token": forged, "Authorization": ""}
        await expect_status(put_cap(jp_fetch, kernel_id, json.dumps({"cap": "0.5"}), headers=forging), 403)
    assert manager.ledger.get(kernel_id).caps[device] == cap_before
    await expect_status(post_usage(jp_fetch, "no-such-kernel", body), 404)
    await expect_status(jp_fetch("api", "gpu-quota", "kernels", "no-such-kernel"), 404)
    assert manager.reports.get(kernel_id) is None
    await shutdown_kernel(jp_fetch, kernel_id)
    await shutdown_kernel(jp_fetch, other)


async def test_nothing_answers_an_unauthenticated_request(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    manager = manager_of(jp_serverapp)
    device = manager.ledger.get(kernel_id).devices[0]
    grant_before = manager.ledger.get(kernel_id)
    no_auth = {"Authorization": ""}
    usage = json.dumps({"devices": [{"index": device, "allocated": 1}]})
    calls = [
        jp_fetch("api", "gpu-quota", "status", headers=no_auth),
        jp_fetch("api", "gpu-quota", "kernels", kernel_id, headers=no_auth),
        put_cap(jp_fetch, kernel_id, '{"cap": "0.1"}', headers=no_auth),
        post_usage(jp_fetch, kernel_id, usage, headers=no_auth),
        post_usage(jp_fetch, kernel_id, usage, headers={**no_auth, "X-GPU-Quota-Kernel-Token": "guess"}),
        post_usage(jp_fetch, kernel_id, usage, headers={**no_auth, "X-GPU-Quota-Kernel-Token": ""}),
    ]
    for call in calls:
        error = await expect_status(call, 401, 403)
        assert b"allocated" not in (error.response.body or b"") and b'"kernels"' not in (error.response.body or b"")
    assert manager.ledger.get(kernel_id) == grant_before
    assert manager.reports.get(kernel_id) is None
    await shutdown_kernel(jp_fetch, kernel_id)


async def test_nvml_failing_mid_run_leaves_the_server_and_kernels_up(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    pid, device = await uses_gpu(jp_serverapp, kernel_id, 2 * GiB)
    await next_samples(jp_serverapp)

    fake_nvml.failing = "nvmlDeviceGetMemoryInfo failed (NVMLError_Unknown: Unknown Error)"
    await next_samples(jp_serverapp)
    state = await status(jp_fetch)
    assert state["monitor"]["state"] == "error" and "Unknown Error" in state["monitor"]["message"]
    assert all(d["used"] is None for d in state["devices"])
    assert kernel_entry(state, kernel_id)["devices"][0]["used"] is None  # unknown, not a false 0
    assert (await execute(jp_serverapp, kernel_id, "print(6 * 7)")).strip() == "42"

    fake_nvml.failing = None
    fake_nvml.crashing = True  # an exception no one foresaw
    await next_samples(jp_serverapp)
    assert (await status(jp_fetch))["monitor"]["state"] == "error"

    fake_nvml.crashing = False
    fake_nvml.lost = {f"static-{1 - device}"}  # the other GPU fell off the bus
    await next_samples(jp_serverapp)
    state = await status(jp_fetch)
    assert state["monitor"]["state"] == "degraded"
    assert kernel_entry(state, kernel_id)["devices"][0]["used"] == 2 * GiB

    fake_nvml.lost = set()
    await next_samples(jp_serverapp)
    assert (await status(jp_fetch))["monitor"]["state"] == "ok"
    assert (await execute(jp_serverapp, kernel_id, "print('still here')")).strip() == "still here"
    await shutdown_kernel(jp_fetch, kernel_id)


async def test_monitor_forgets_a_kernel_that_is_gone(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    manager = manager_of(jp_serverapp)
    device = manager.ledger.get(kernel_id).devices[0]
    await post_usage(jp_fetch, kernel_id, json.dumps({"devices": [{"index": device, "reserved": 5}]}))
    assert kernel_id in manager.reports
    await shutdown_kernel(jp_fetch, kernel_id)
    await next_samples(jp_serverapp)
    assert kernel_id not in manager.reports
    assert manager.ledger.get(kernel_id) is None
    assert all(k["id"] != kernel_id for k in (await status(jp_fetch))["kernels"])


@pytest.mark.parametrize(
    "setting, value",
    [
        ("enforce", "explode"),
        ("slack", "lots"),
        ("grace", "-1"),
        ("poll_interval", "0"),
        ("nvml_class", "builtins.dict"),
    ],
)
def test_invalid_watchdog_settings_stop_the_server_with_one_line(jp_configurable_serverapp, setting, value):
    with pytest.raises(SystemExit) as stopped:
        jp_configurable_serverapp(config=fake_gpu_config(**{setting: value}))
    message = str(stopped.value)
    assert message.startswith("gpu-quota-ext: invalid configuration:") and "\n" not in message
    assert setting in message


# --- bodies: size, depth, and the messages of a refusal -------------------------------------------


async def test_a_body_over_64_kib_is_refused_before_it_is_parsed(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    manager = manager_of(jp_serverapp)
    grant_before = manager.ledger.get(kernel_id)
    huge_cap = json.dumps({"cap": "9" * (1 << 20)})  # 1 MiB: valid JSON, a nonsense cap
    error = await expect_status(put_cap(jp_fetch, kernel_id, huge_cap), 413)
    assert len(error.response.body) < 300 and b"64 KiB" in error.response.body

    def chunked(write):  # no Content-Length: the limit holds on what arrives
        for _ in range(10):
            write(b" " * 10_000)
        write(b'{"cap": "0.5"}')

    streamed = put_cap(jp_fetch, kernel_id, body_producer=chunked, headers={"Transfer-Encoding": "chunked"})
    await expect_status(streamed, 413)
    usage = json.dumps({"devices": [{"index": grant_before.devices[0], "allocated": 1}], "pad": "x" * 70_000})
    await expect_status(post_usage(jp_fetch, kernel_id, usage), 413)
    assert manager.ledger.get(kernel_id) == grant_before
    assert manager.reports.get(kernel_id) is None
    # Just under the limit is read (and answered on its merits).
    padded = '{"cap": "0.5"}' + " " * (64 * 1024 - 20)
    assert json.loads((await put_cap(jp_fetch, kernel_id, padded)).body)["outcome"] == "granted"
    await shutdown_kernel(jp_fetch, kernel_id)


async def test_any_unparseable_body_is_a_400(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    manager = manager_of(jp_serverapp)
    grant_before = manager.ledger.get(kernel_id)
    nested = "[" * 30_000 + "]" * 30_000  # 60 kB, deeper than the JSON decoder recurses
    for body in [nested, '{"cap": ' + nested + "}", b"\xff\xfe{", '{"cap": 1' + "0" * 5000 + "}", "{" * 50]:
        for route, method in ((("kernels", kernel_id), "PUT"), (("kernels", kernel_id, "usage"), "POST")):
            error = await expect_status(jp_fetch("api", "gpu-quota", *route, method=method, body=body), 400)
            assert json.loads(error.response.body)["message"]
    assert manager.ledger.get(kernel_id) == grant_before
    await shutdown_kernel(jp_fetch, kernel_id)


async def test_a_refusal_says_its_reason_once_with_the_input_shortened(jp_fetch, jp_serverapp, fake_nvml, caplog):
    kernel_id = await start_kernel(jp_fetch)

    def put(body):
        return put_cap(jp_fetch, kernel_id, json.dumps(body))

    error = await expect_status(put({"cap": "2.5"}), 400)
    message = json.loads(error.response.body)["message"]
    assert "(100%)" in message and "%%" not in message, message
    error = await expect_status(put({"cap": "lots%"}), 400)
    assert "'lots%'" in json.loads(error.response.body)["message"]
    # An echoed value is cut short: the answer and the log stay small whatever was sent.
    caplog.clear()
    long_cap = "x" * 60_000
    error = await expect_status(put({"cap": long_cap}), 400)
    message = json.loads(error.response.body)["message"]
    assert len(message) < 300 and "..." in message, message
    assert max(len(r.getMessage()) for r in caplog.records) < 500
    error = await expect_status(put({"cap": int("9" * 4000)}), 400)
    assert len(json.loads(error.response.body)["message"]) < 300
    error = await expect_status(put({"cap": "0.5", "y" * 10_000: 1}), 400)
    assert len(json.loads(error.response.body)["message"]) < 300
    assert max(len(r.getMessage()) for r in caplog.records) < 500
    error = await expect_status(jp_fetch("api", "gpu-quota", "kernels", "k" * 5000), 404)
    assert len(json.loads(error.response.body)["message"]) < 300
    await shutdown_kernel(jp_fetch, kernel_id)
