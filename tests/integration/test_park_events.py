"""Parking's structured events on a real server (issue 32): an admin's listener on jupyter_server's event logger
hears a park and a resume asked through the REST routes, a park refused, and a parked kernel lost when its process
is killed, each with its fields, each valid against its schema; the driver faked (fake_checkpoint, fake NVML)."""

import os
import signal

import jsonschema
import pytest
import yaml

from gpu_quota_ext.parking.events import LOSS, PARK, REFUSAL, RESUME, SCHEMA_IDS, schema_path
from gpu_quota_ext.shared.sizes import GiB

from .fake_gpu import fake_gpu_config, wait_for
from .kernels import execute, start_kernel
from .test_park import FAKE_DRIVER, WAIT, holding_gpu, post, post_error, wait_state
from .test_park_lost import new_process


@pytest.fixture
def jp_server_config():
    config = fake_gpu_config("warn", checkpoint_class=FAKE_DRIVER)
    config.KernelRestarter.time_to_dead = 0.5  # the restarter finds a dead process within a second
    return config


@pytest.fixture
def heard(jp_serverapp):
    """Every park event the server emits while the test runs, as (schema id, data), through a listener."""
    events = []

    async def listener(logger, schema_id, data):
        events.append((schema_id, data))

    for schema_id in SCHEMA_IDS:
        jp_serverapp.event_logger.add_listener(schema_id=schema_id, listener=listener)
    yield events
    for schema_id in SCHEMA_IDS:
        jp_serverapp.event_logger.remove_listener(schema_id=schema_id, listener=listener)


def valid(schema_id, data):
    schema = yaml.safe_load(schema_path(schema_id).read_text(encoding="utf-8"))
    jsonschema.Draft7Validator(schema).validate(data)
    return data


async def one(heard, schema_id, kernel_id):
    """The one event of `schema_id` for the kernel, once it has come."""
    def found():
        matching = [data for sid, data in heard if sid == schema_id and data["kernel_id"] == kernel_id]
        return matching or None

    matching = await wait_for(found, f"a {schema_id} event", timeout=WAIT)
    assert len(matching) == 1, matching
    return valid(schema_id, matching[0])


async def test_a_park_and_a_resume_through_the_routes_are_heard_with_their_fields(
    jp_fetch, jp_serverapp, fake_driver, heard
):
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "x = 41")
    await holding_gpu(jp_serverapp, kernel_id, 2 * GiB)

    assert (await post(jp_fetch, kernel_id, "park"))[0] == 202
    parked = await wait_state(jp_fetch, kernel_id, "parked")
    park = await one(heard, PARK, kernel_id)
    assert park == {
        "kernel_id": kernel_id, "state": "parked", "path": "checkpoint", "bytes": 2 * GiB,
        "host_bytes": parked["host_bytes"], "seconds": park["seconds"], "asked_by": "user", "reason": None,
    }
    assert 0 <= park["seconds"] < WAIT

    assert (await post(jp_fetch, kernel_id, "resume"))[0] == 202
    await wait_state(jp_fetch, kernel_id, "idle")
    resume = await one(heard, RESUME, kernel_id)
    assert resume["state"] == "idle" and resume["bytes"] == 2 * GiB and resume["asked_by"] == "user"
    assert resume["path"] == "checkpoint" and resume["reason"] is None and resume["waited"] >= 0
    assert [sid for sid, data in heard if data["kernel_id"] == kernel_id] == [PARK, RESUME]


async def test_a_park_refused_is_heard_with_the_words_the_answer_gives(jp_fetch, jp_serverapp, fake_driver, heard):
    kernel_id = await start_kernel(jp_fetch)  # holds no GPU memory: nothing to park
    code, answer = await post_error(jp_fetch, kernel_id, "park")
    assert code == 409
    refusal = await one(heard, REFUSAL, kernel_id)
    assert refusal["action"] == "park" and refusal["asked_by"] == "user" and refusal["state"] == "idle"
    assert refusal["reason"] == answer["message"] and refusal["bytes"] is None


async def test_a_parked_kernel_killed_is_heard_as_a_loss(jp_fetch, jp_serverapp, fake_driver, heard):
    kernel_id = await start_kernel(jp_fetch)
    pid = await holding_gpu(jp_serverapp, kernel_id, 2 * GiB)
    await post(jp_fetch, kernel_id, "park")
    await wait_state(jp_fetch, kernel_id, "parked")
    os.kill(pid, signal.SIGKILL)  # what the host's out-of-memory killer does
    loss = await one(heard, LOSS, kernel_id)
    assert loss["cause"] == "process_ended" and loss["state"] == "parked" and loss["bytes"] == 2 * GiB
    assert loss["reason"].startswith("its process ended while parked") and loss["exit_code"] == -9
    restarted = lambda: new_process(jp_serverapp, kernel_id, pid)  # noqa: E731
    await wait_for(restarted, "the restarter started a new process", timeout=WAIT)  # before the server stops
