"""A kernel's parking as a state machine (parking/states.py), pure: random sequences of what can happen to a kernel,
with the parker's answers to its effects played back as events. Properties: a restore is asked only right after
the broker granted room, once per park; a lost kernel is never restored again; stale driver outcomes change
nothing; the record's fields agree with its state."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpu_quota_ext.parking.states import (
    CELL,
    LOST,
    REQUEST,
    RUNNING,
    STATES,
    AskPark,
    AskResume,
    AskRoom,
    Busy,
    Checkpoint,
    Decide,
    Idle,
    ParkChecked,
    ParkDone,
    ParkRecord,
    Restore,
    RestoreDeferred,
    ResumeDone,
    RoomGranted,
    RoomTold,
    RoomWait,
    Sampled,
    StartPark,
    Stuck,
    transition,
)

GiB = 1 << 30

events = st.one_of(
    st.just(Busy()),
    st.just(Idle()),
    st.builds(
        AskPark, why=st.just("user request"), problem=st.sampled_from([None, None, "no GPU"]), busy=st.booleans()
    ),
    st.just(AskResume()),
    st.just(RoomGranted()),
    st.just(RoomWait("making room")),
    st.just(RoomTold("waited 300 s")),
    st.builds(Sampled, taken=st.floats(0, 2000)),
    st.just(AskRoom({0: GiB})),
    st.just("stale"),
)
# How the parker's calls turn out, drawn with each event: every outstanding call is answered this way after it
# (or left out, for "later"), so that sequences reach deep states (parked, waiting, resuming, lost) often.
outcomes = st.sampled_from(["ok", "ok", "ok", "refused", "failed", "gone", "deferred", "later"])


def run(sequence):
    """Play (event, outcome) pairs; after each event the parker's outstanding calls are answered with the
    outcome. Yields (before, event, after, effects) for every event applied, answers included."""
    record = ParkRecord(since=0.0)
    now = 0.0
    outstanding = []
    for item, answer in sequence:
        now += 1.0
        queue = [stale(record) if item == "stale" else item]
        while queue:
            event = queue.pop(0)
            before = record
            record, effects = transition(record, event, now)
            yield before, event, record, effects
            outstanding.extend(e for e in effects if not isinstance(e, Decide))
            if answer != "later":
                queue.extend(reply(e, answer) for e in outstanding)
                outstanding = []


def stale(record):
    return ResumeDone(record.op - 1, "late answer of an older call")


def reply(effect, answer):
    if isinstance(effect, StartPark):
        refused = "did not park: the host is full" if answer == "refused" else None
        return ParkChecked(effect.op, (11, 12), {} if refused else {0: 2 * GiB}, refused)
    if isinstance(effect, Checkpoint):
        return ParkDone(effect.op, "did not park: CUDA_ERROR_TIMEOUT" if answer == "failed" else None)
    assert isinstance(effect, Restore)
    if answer == "failed":
        return ResumeDone(effect.op, "cuCheckpointProcessRestore failed: CUDA_ERROR_OUT_OF_MEMORY (2)")
    if answer == "deferred":
        return RestoreDeferred(effect.op, "the room was taken meanwhile")
    return ResumeDone(effect.op, None, gone=answer == "gone")


sequences = st.lists(st.tuples(events, outcomes), max_size=40)


PARK = AskPark(why="user request", problem=None, busy=False)
# Sequences of the same words as the generated ones that surely reach the deep states: every property below runs
# them too (@example), whatever hypothesis draws.
DEEP = {
    "lost": [(PARK, "ok"), (Busy(), "ok"), (RoomGranted(), "failed"), (AskResume(), "ok"), (RoomGranted(), "ok")],
    "resumed then parked again": [(PARK, "ok"), (AskResume(), "ok"), (RoomGranted(), "ok"), (PARK, "ok")],
    "deferred then told": [(PARK, "ok"), (Busy(), "ok"), (RoomGranted(), "deferred"), (RoomTold("late"), "ok")],
    "waiting ends": [(PARK, "ok"), (Busy(), "ok"), (RoomWait("room"), "ok"), (Idle(), "ok"), ("stale", "ok")],
    "pending": [(AskPark(why="user", problem=None, busy=True), "ok"), (Idle(), "later"), (Busy(), "ok")],
    "room asked": [(AskRoom({0: GiB}), "ok"), (RoomWait("making room"), "ok"), (RoomGranted(), "ok"), (Busy(), "ok")],
}


def test_the_deep_sequences_reach_every_state():
    reached = {after.state for sequence in DEEP.values() for _, _, after, _ in run(sequence)}
    assert reached == set(STATES)


def deep_examples(test):
    for sequence in DEEP.values():
        test = example(sequence)(test)
    return test


@settings(max_examples=500, deadline=None)
@given(sequences)
@deep_examples
def test_a_restore_is_asked_only_when_room_was_granted_and_once_per_park(sequence):
    driver_restores = 0  # Restore effects whose precondition check let the driver's restore run
    for before, event, after, effects in run(sequence):
        restores = [e for e in effects if isinstance(e, Restore)]
        if restores:
            assert isinstance(event, RoomGranted) and before.state == "waiting", (before, event)
            assert after.state == "resuming" and after.room == before.parked
            assert driver_restores == 0  # never a second restore of the same park
        if isinstance(event, ResumeDone) and event.op == before.op and before.state == "resuming":
            driver_restores += 1
        if isinstance(event, ParkDone) and event.op == before.op and event.error is None:
            driver_restores = 0  # a new park is done (parked, or straight to waiting when a cell wanted it back)


@settings(max_examples=500, deadline=None)
@given(sequences)
@deep_examples
def test_a_lost_kernel_stays_lost_and_is_never_restored_again(sequence):
    lost = False
    for _, event, after, effects in run(sequence):
        if lost:
            assert after.state == LOST and not [e for e in effects if isinstance(e, (Restore, StartPark))]
        if after.state == LOST:
            assert isinstance(event, ResumeDone) or lost
            assert after.reason  # what is lost, and what the user can do, is said
            lost = True


@settings(max_examples=500, deadline=None)
@given(sequences)
@deep_examples
def test_fields_agree_with_the_state(sequence):
    for _, _, after, effects in run(sequence):
        assert after.state in STATES
        if after.state in ("parked", "waiting", "resuming"):
            assert after.parked  # what is on the host is known
        if after.state in ("waiting", "resuming"):
            assert after.demand in (CELL, REQUEST) and after.waiting_since is not None
        else:
            assert after.demand is None
        if after.state == RUNNING:
            assert not after.parked and after.resume_wanted is None
        if after.room and after.room_until is None:
            assert after.state == "resuming"  # held for a restore under way ...
        if after.room_until is not None:
            assert after.room  # ... or for one that ended, until a sample taken after it has seen its bytes
        if after.room_need or after.room_outcome:
            # Only a kernel on the device asks for room (running, or parking after its current cell).
            assert after.state in (RUNNING, "pending") and after.room_asked is not None
        if after.deferred_at is not None:
            assert after.state == "waiting" and not after.room  # a deferred restore waits for a newer reading
        if after.state not in ("parking", "resuming"):
            assert after.stuck is None  # only a driver call under way can be stuck
        for effect in effects:
            assert isinstance(effect, (StartPark, Checkpoint, Restore, Decide))


@settings(max_examples=300, deadline=None)
@given(sequences)
@deep_examples
def test_an_outcome_of_an_older_call_changes_nothing(sequence):
    for before, event, after, effects in run(sequence):
        if isinstance(event, (ParkChecked, ParkDone, ResumeDone)) and event.op != before.op:
            assert after == before and effects == ()


# --- examples a person can read ---------------------------------------------------------------------------


def step(record, event, now=1.0):
    return transition(record, event, now)


def test_the_common_path_park_then_a_cell_brings_it_back_through_the_broker():
    record, effects = step(ParkRecord(), AskPark("user request", None, busy=False))
    assert record.state == "parking" and effects == (StartPark(1),)
    record, effects = step(record, ParkChecked(1, (7,), {0: 2 * GiB}, None))
    assert effects == (Checkpoint(1, (7,)),)
    record, effects = step(record, ParkDone(1, None))
    assert record.state == "parked" and effects == (Decide(),)
    record, effects = step(record, Busy(), 5.0)
    assert record.state == "waiting" and record.demand == CELL and effects == (Decide(),)
    record, effects = step(record, RoomGranted(), 6.0)
    assert record.state == "resuming" and effects == (Restore(2, (7,)),) and record.room == {0: 2 * GiB}
    record, effects = step(record, ResumeDone(2, None), 8.0)
    assert record.state == RUNNING and record.room_until == 8.0  # held until a later sample has seen it
    record, _ = step(record, Sampled(7.5))
    assert record.room
    record, effects = step(record, Sampled(8.5))
    assert not record.room and effects == (Decide(),)


def test_a_cell_that_ends_while_waiting_calls_off_the_wait_and_the_kernel_stays_parked():
    waiting = ParkRecord(state="waiting", parked={0: GiB}, pids=(7,), demand=CELL, waiting_since=1.0)
    record, _ = step(waiting, RoomTold("waited 300 s"))
    assert record.state == "waiting" and record.told
    record, effects = step(record, Idle())
    assert record.state == "parked" and record.reason == "waited 300 s" and effects == (Decide(),)
    assert record.told  # said until its next wait begins
    record, _ = step(record, Busy())
    assert record.state == "waiting" and not record.told


def test_a_requested_resume_that_passes_the_limit_ends_parked():
    waiting = ParkRecord(state="waiting", parked={0: GiB}, pids=(7,), demand=REQUEST, waiting_since=1.0)
    record, _ = step(waiting, RoomTold("waited 300 s"))
    assert record.state == "parked" and record.reason == "waited 300 s" and record.told


def test_a_failed_restore_is_lost_with_what_the_user_can_do():
    resuming = ParkRecord(state="resuming", parked={0: GiB}, pids=(7,), op=3, room={0: GiB})
    record, effects = step(resuming, ResumeDone(3, "its GPU memory could not be brought back: ..."))
    assert record.state == LOST and not record.room and effects == (Decide(),)
    for event in (Busy(), AskResume(), RoomGranted(), AskPark("user", None, False)):
        again, effects = step(record, event)
        assert again == record and effects == ()


def test_a_stuck_call_is_shown_and_cleared_when_it_returns():
    parking = ParkRecord(state="parking", op=2)
    record, _ = step(parking, Stuck(2, "has not returned after 600 s"))
    assert record.stuck
    record, _ = step(record, Stuck(2, None))
    assert record.stuck is None


def test_a_running_kernel_that_found_the_device_full_asks_for_room_and_is_told_how_it_went():
    record, effects = step(ParkRecord(), AskRoom({0: 4 * GiB}))
    assert record.room_need == {0: 4 * GiB} and effects == (Decide(),)
    record, effects = step(record, RoomGranted())
    assert not record.room_need and record.room_outcome == "made" and effects == ()  # nothing to restore
    record, _ = step(record, Busy())
    assert record.room_outcome == "made"  # the kernel's own cell may still be reading it
    record, _ = step(record, AskRoom({0: GiB}))
    assert record.room_outcome is None and record.room_need == {0: GiB}



def test_a_cell_that_begins_before_the_driver_is_asked_calls_the_park_off():
    # A busy kernel is never parked: a cell that began while the kernel emptied its caches and a fresh sample was
    # read (nothing asked of the driver yet) calls the park off, rather than parking it under its cell and making the
    # cell wait for a restore (and, under a broker, for room).
    record, _ = step(ParkRecord(), AskPark("to make room for kernel A", None, busy=False, automatic=True))
    record, _ = step(record, Busy())
    record, effects = step(record, ParkChecked(record.op, (7,), {0: 2 * GiB}, None))
    assert record.state == RUNNING and effects == (Decide(),)
    assert not record.refused  # it parks again when it is idle again and chosen
    # A user's park request waits for the cell instead, as one asked while the cell ran.
    record, _ = step(ParkRecord(op=2), PARK)
    record, _ = step(record, Busy())
    record, effects = step(record, ParkChecked(record.op, (7,), {0: 2 * GiB}, None))
    assert record.state == "pending" and effects == ()
    record, effects = step(record, Idle())
    assert record.state == "parking" and effects == (StartPark(record.op),)
    # A resume asked in that moment calls it off too; a cell that already ended does not.
    record, _ = step(ParkRecord(op=4), PARK)
    record, _ = step(record, AskResume())
    record, effects = step(record, ParkChecked(record.op, (7,), {0: 2 * GiB}, None))
    assert record.state == RUNNING and effects == (Decide(),)
    record, _ = step(ParkRecord(op=6), PARK)
    record, _ = step(record, Busy())
    record, _ = step(record, Idle())
    record, effects = step(record, ParkChecked(record.op, (7,), {0: 2 * GiB}, None))
    assert record.state == "parking" and effects == (Checkpoint(record.op, (7,)),)
