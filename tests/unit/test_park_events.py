"""Parking's structured events (gpu_quota_ext/parking/events.py): the pure mapping from two records of a kernel to
an event, driven through the real state machine (states.transition), every event checked against its own schema;
the schemas are ones jupyter_events accepts, shipped beside the module; a bad event is logged, never raised."""

import logging
from pathlib import Path

import jsonschema
import pytest
import yaml
from jupyter_events import EventLogger

from gpu_quota_ext.parking import events
from gpu_quota_ext.parking.events import (
    LOSS,
    PARK,
    REFUSAL,
    RESUME,
    SCHEMA_IDS,
    Seen,
    loss_event,
    park_event_logger,
    schema_path,
    send,
    transition_event,
)
from gpu_quota_ext.parking.states import (
    AskPark,
    AskResume,
    Busy,
    Idle,
    ParkChecked,
    ParkDone,
    ParkRecord,
    RestoreDeferred,
    ResumeDone,
    RoomGranted,
    RoomTold,
    transition,
)

GiB = 1 << 30
K = "kernel-1"
ROOT = Path(__file__).resolve().parents[2]


def schema(schema_id):
    return yaml.safe_load(schema_path(schema_id).read_text(encoding="utf-8"))


def valid(event):
    """The event's data as its schema has them (raises where they are not)."""
    jsonschema.Draft7Validator(schema(event.schema_id)).validate(event.data)
    return event.data


def step(record, event, now, shown_before="idle", shown_after="idle", **seen):
    """One transition and the event it maps to."""
    new, _ = transition(record, event, now)
    return new, transition_event(K, record, new, Seen(shown_before, shown_after, at=now, **seen))


def parked_at(now=100.0, asked_by="user", automatic=False, why="user request", **seen):
    """A kernel parked through the state machine: (record, the park's event)."""
    record, first = step(ParkRecord(since=0.0), AskPark(why, None, False, automatic), 10.0, asked_by=asked_by)
    assert first is None  # asked: nothing has happened yet
    record, checked = step(record, ParkChecked(record.op, (11, 12), {0: 2 * GiB}, None), 11.0, asked_by=asked_by)
    assert checked is None
    return step(record, ParkDone(record.op, None), now, "parking", "parked", asked_by=asked_by, **seen)


def test_a_park_done_is_one_event_with_its_bytes_time_path_and_asker():
    record, event = parked_at()
    assert event.schema_id == PARK
    assert valid(event) == {
        "kernel_id": K, "state": "parked", "path": "checkpoint", "bytes": 2 * GiB, "host_bytes": 2 * GiB,
        "seconds": 90.0, "asked_by": "user", "reason": None,
    }
    assert type(event.data["state"]) is str  # plain JSON words, not the enum


def test_an_automatic_park_says_who_asked_and_the_words_the_status_showed():
    _, event = parked_at(asked_by="timer", automatic=True, why="idle for 600 s")
    assert valid(event)["asked_by"] == "timer" and event.data["reason"] == "idle for 600 s"


def test_a_fast_park_says_its_path_and_the_host_memory_its_arena_took():
    _, event = parked_at(path="pages", host_bytes=0)
    assert valid(event)["path"] == "pages" and event.data["host_bytes"] == 0 and event.data["bytes"] == 2 * GiB


def resumed(record, demand_event, asked_by="user", shown_after="idle", done=None):
    waiting, _ = step(record, demand_event, 200.0, "parked", "waiting", asked_by=asked_by)
    resuming, _ = step(waiting, RoomGranted(), 230.0, "waiting", "resuming", asked_by=asked_by)
    return resuming, step(resuming, done or ResumeDone(resuming.op, None), 232.5, "resuming", shown_after,
                          asked_by=asked_by)


def test_a_resume_a_user_asked_for_says_how_long_it_waited_and_took():
    record, _ = parked_at()
    _, (back, event) = resumed(record, AskResume("user request"))
    assert event.schema_id == RESUME
    assert valid(event) == {
        "kernel_id": K, "state": "idle", "path": "checkpoint", "bytes": 2 * GiB, "seconds": 2.5, "waited": 30.0,
        "asked_by": "user", "reason": None,
    }


def test_a_resume_a_cell_asked_for_says_cell_and_the_kernel_busy():
    record, _ = parked_at()
    _, (_, event) = resumed(record, Busy(), asked_by="timer", shown_after="busy")  # the park's asker is not its
    assert valid(event)["asked_by"] == "cell" and event.data["state"] == "busy"


def test_a_resume_of_processes_that_exited_moves_nothing_and_says_why():
    record, _ = parked_at()
    resuming, _ = resumed(record, AskResume("user request"))
    _, (_, event) = resumed(record, AskResume(), done=ResumeDone(resuming.op, None, gone=True))
    assert valid(event)["bytes"] == 0 and event.data["reason"] == "its processes exited while it was parked"


def test_a_background_resume_for_host_memory_says_so():
    record, _ = parked_at()
    _, (_, event) = resumed(record, AskResume("host memory is short"), asked_by="host_memory")
    assert valid(event)["asked_by"] == "host_memory"


def test_a_failed_restore_is_a_loss():
    record, _ = parked_at()
    resuming, _ = resumed(record, AskResume())
    lost, event = step(resuming, ResumeDone(resuming.op, "its GPU memory could not be brought back"), 240.0,
                       "resuming", "lost")
    assert event.schema_id == LOSS
    assert valid(event) == {
        "kernel_id": K, "cause": "restore_failed", "state": "lost", "reason": lost.reason, "bytes": 2 * GiB,
        "exit_code": None,
    }


def test_a_held_kernel_whose_process_died_is_a_loss_with_its_exit_status():
    record, _ = parked_at()
    event = loss_event(K, record, "its process ended while parked (killed by SIGKILL: ...)", -9)
    assert valid(event) == {
        "kernel_id": K, "cause": "process_ended", "state": "parked",
        "reason": "its process ended while parked (killed by SIGKILL: ...)", "bytes": 2 * GiB, "exit_code": -9,
    }


def test_a_park_refused_at_once_is_a_refusal_said_once_until_the_kernel_has_run_a_cell():
    refused, event = step(ParkRecord(since=0.0), AskPark("user request", "no CUDA process", False), 5.0,
                          asked_by="user")
    assert event.schema_id == REFUSAL
    assert valid(event) == {
        "kernel_id": K, "action": "park", "state": "idle", "reason": "no CUDA process", "asked_by": "user",
        "seconds": 0.0, "bytes": None,
    }
    again, event = step(refused, AskPark("user request", "no CUDA process", False), 6.0, asked_by="user")
    assert event is None  # the same words, nothing run since
    ran, _ = step(again, Busy(), 7.0, shown_after="busy")
    _, event = step(ran, AskPark("user request", "no CUDA process", False), 8.0, asked_by="user")
    assert event is not None


def test_a_park_that_failed_in_the_driver_is_a_refusal_with_the_time_it_took():
    record, _ = step(ParkRecord(since=0.0), AskPark("idle for 600 s", None, False, True), 10.0, asked_by="timer")
    record, _ = step(record, ParkChecked(record.op, (11,), {0: GiB}, None), 11.0)
    _, event = step(record, ParkDone(record.op, "did not park: the driver said no"), 13.0, "parking", "idle",
                    asked_by="timer")
    assert valid(event)["action"] == "park" and event.data["seconds"] == 3.0 and event.data["asked_by"] == "timer"
    assert event.data["reason"] == "did not park: the driver said no"


def test_a_park_called_off_by_a_cell_is_no_event():
    record, _ = step(ParkRecord(since=0.0), AskPark("user request", None, False), 10.0)
    record, _ = step(record, Busy(), 10.5)
    _, event = step(record, ParkChecked(record.op, (11,), {0: GiB}, None), 11.0, "parking", "pending")
    assert event is None


def test_a_resume_the_room_was_gone_for_is_a_refusal_and_the_kernel_waits():
    record, _ = parked_at()
    waiting, _ = step(record, AskResume(), 200.0)
    resuming, _ = step(waiting, RoomGranted(), 230.0)
    _, event = step(resuming, RestoreDeferred(resuming.op, "GPU 0 has 1 GiB free right now"), 231.0,
                    "resuming", "waiting", asked_by="user")
    assert valid(event) == {
        "kernel_id": K, "action": "resume", "state": "waiting", "reason": "GPU 0 has 1 GiB free right now",
        "asked_by": "user", "seconds": 1.0, "bytes": 2 * GiB,
    }


def test_a_wait_that_reached_the_limit_is_a_refusal_whatever_waited():
    record, _ = parked_at()
    for demand, shown, asked_by in ((AskResume(), "parked", "user"), (Busy(), "waiting", "cell")):
        waiting, _ = step(record, demand, 200.0)
        told, event = step(waiting, RoomTold("waited 600 s for room: ..."), 800.0, "waiting", shown,
                           asked_by="user")
        assert valid(event) == {
            "kernel_id": K, "action": "wait", "state": shown, "reason": "waited 600 s for room: ...",
            "asked_by": asked_by, "seconds": 600.0, "bytes": 2 * GiB,
        }
        if shown == "waiting":
            _, event = step(told, Idle(), 801.0, "waiting", "parked")
            assert event is None  # the cell gave up: told already


def test_changes_that_are_no_park_resume_refusal_or_loss_map_to_none():
    record, _ = parked_at()
    waiting, event = step(record, AskResume(), 200.0, "parked", "waiting")
    assert event is None
    _, event = step(waiting, RoomGranted(), 230.0, "waiting", "resuming")
    assert event is None


# --- the schemas and the I/O ------------------------------------------------------------------------


def test_every_schema_is_one_jupyter_events_registers_and_ships_in_the_package():
    logger = EventLogger()
    for schema_id in SCHEMA_IDS:
        assert schema(schema_id)["$id"] == schema_id
        logger.register_event_schema(schema_path(schema_id))
        assert schema_path(schema_id).is_relative_to(ROOT / "gpu_quota_ext")
    assert set(SCHEMA_IDS) <= set(logger.schemas.schema_ids)


def test_the_server_s_event_logger_gets_the_schemas_once_and_a_server_without_one_gets_nothing():
    class Server:
        event_logger = EventLogger()

    server = Server()
    assert park_event_logger(server) is server.event_logger
    assert park_event_logger(server) is server.event_logger  # again (a second extension app): no error
    assert set(SCHEMA_IDS) <= set(server.event_logger.schemas.schema_ids)
    assert park_event_logger(object()) is None
    send(None, parked_at()[1])  # nothing to send to: nothing happens


async def test_an_event_reaches_a_listener_and_a_bad_one_is_logged_not_raised(caplog):
    logger = EventLogger()
    park_event_logger(type("Server", (), {"event_logger": logger})())
    heard = []

    async def listener(logger, schema_id, data):
        heard.append((schema_id, data))

    logger.add_listener(schema_id=PARK, listener=listener)
    _, event = parked_at()
    send(logger, event)
    await logger.gather_listeners()
    assert heard == [(PARK, event.data)]

    bad = events.ParkEvent(PARK, dict(event.data, bytes=-1))
    with caplog.at_level(logging.ERROR, logger="gpu_quota_ext"):
        send(logger, bad)
    assert "do not match its schema" in caplog.text


def test_the_reference_page_names_every_event_and_field():
    page = (ROOT / "docs" / "reference" / "events.md").read_text(encoding="utf-8")
    for schema_id in SCHEMA_IDS:
        assert schema_id in page
        for field in schema(schema_id)["properties"]:
            assert f"`{field}`" in page, (schema_id, field)


@pytest.mark.parametrize("schema_id", SCHEMA_IDS)
def test_each_schema_requires_the_kernel_and_says_what_every_field_means(schema_id):
    loaded = schema(schema_id)
    assert "kernel_id" in loaded["required"]
    assert all(field.get("description") for field in loaded["properties"].values())
