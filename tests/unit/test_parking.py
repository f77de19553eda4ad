"""Parking's decisions without a server: durations, settings, the host guard, the idle timer, refusals, and the
driver sequences (park all processes or none, resume all) against the fake driver, which fails a restore into a
full device for good as the real one does."""

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.parking import ParkSettings, build_park_settings
from gpu_quota_ext.parking.checkpoint import (
    CHECKPOINTED,
    CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OPERATING_SYSTEM,
    CUDA_ERROR_OUT_OF_MEMORY,
    DRIVER_RUNNING,
    LOCKED,
    CheckpointError,
    CheckpointUnavailable,
    CudaCheckpointDriver,
)
from gpu_quota_ext.parking.decisions import (
    MPS_REASON,
    due_for_park,
    idle_seconds,
    not_parkable,
    on_device_full_for,
)
from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
from gpu_quota_ext.parking.parker import park_processes, resume_processes
from gpu_quota_ext.parking.states import STATES, ParkRecord, moved
from gpu_quota_ext.parking.wording import park_json
from gpu_quota_ext.shared.contract import PARK_FIELDS, PARK_STATES
from gpu_quota_ext.shared.durations import parse_duration
from gpu_quota_ext.shared.sizes import GiB, PolicyError

# --- durations and settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("30min", 1800),
        ("90s", 90),
        ("1.5h", 5400),
        ("2d", 172800),
        (300, 300),
        ("300", 300),
        (" 45 MIN ", 2700),
        (0.5, 0.5),
    ],
)
def test_durations_in_seconds_or_with_a_unit(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("off", [None, "", "off", "OFF", "never", "0", 0])
def test_off_is_none(off):
    assert parse_duration(off) is None


@pytest.mark.parametrize(
    "bad", ["soon", "-5", "5 parsecs", "1e999", float("nan"), float("inf"), True, [], "400d", -1, "min"]
)
def test_bad_durations_say_what_is_accepted(bad):
    with pytest.raises(PolicyError, match="duration"):
        parse_duration(bad)


@given(st.one_of(st.text(max_size=20), st.integers(), st.floats(), st.none(), st.booleans()))
def test_parse_duration_answers_seconds_none_or_policy_error(value):
    try:
        seconds = parse_duration(value)
    except PolicyError:
        return
    assert seconds is None or 0 < seconds <= 366 * 86400


def test_park_settings_default_off_and_name_the_bad_setting():
    assert build_park_settings("off", "2GiB") == ParkSettings(idle_after=None, host_margin=2 * GiB)
    assert build_park_settings("30min", "0").idle_after == 1800
    with pytest.raises(PolicyError, match=r"c.GpuQuota.park_idle_after = 'soon'"):
        build_park_settings("soon", "2GiB")
    with pytest.raises(PolicyError, match=r"c.GpuQuota.park_host_margin = '0.5'"):
        build_park_settings("off", "0.5")  # a fraction of what? a margin is a size


def test_park_on_device_full_auto_is_on_exactly_where_caps_can_add_up_to_more_than_a_device():
    assert on_device_full_for("auto", 2.0) == "on"
    assert on_device_full_for("auto", None) == "on"  # no admission control: caps add up to anything
    assert on_device_full_for("auto", 1.0) == "off"
    assert on_device_full_for("auto", 0.5) == "off"
    assert on_device_full_for("off", 3.0) == "off" and on_device_full_for("on", 1.0) == "on"


# --- the idle timer, refusals, retries -------------------------------------------------------------------


def test_the_idle_timer_parks_only_idle_kernels_past_the_setting_and_never_when_off():
    on = ParkSettings(idle_after=60)
    assert due_for_park(on, "idle", 60)
    assert not due_for_park(on, "idle", 59.9)
    assert not due_for_park(on, "busy", 1000)
    assert not due_for_park(on, "idle", None)
    assert not due_for_park(ParkSettings(idle_after=None), "idle", 1e9)


def test_idle_seconds_from_jupyter_servers_last_activity():
    assert idle_seconds("idle", 100.0, 160.0) == 60.0
    assert idle_seconds("busy", 100.0, 160.0) is None
    assert idle_seconds("idle", None, 160.0) is None
    assert idle_seconds("idle", 200.0, 160.0) == 0.0  # a clock step back is not negative idleness


def test_not_parkable_gives_the_most_basic_reason_first():
    assert not_parkable("libcuda.so.1 missing", True, False, 0, ()).startswith("no checkpoint driver: libcuda")
    assert not_parkable(None, True, True, GiB, (5,)) == MPS_REASON
    assert not_parkable(None, False, False, 0, ()) == "this kernel has no GPU"
    assert "another Unix user" in not_parkable(None, False, True, GiB, (5, 6), foreign=(6,))
    assert not_parkable(None, False, True, 0, (5,)) == "this kernel holds no GPU memory"
    assert not_parkable(None, False, True, GiB, ()) == "this kernel holds no GPU memory"
    assert not_parkable(None, False, True, GiB, (5,)) is None


@given(st.lists(st.sampled_from(STATES), max_size=20), st.floats(0, 1e9))
def test_a_record_moves_through_its_states_and_since_changes_only_with_the_state(states, start):
    record = ParkRecord(since=start)
    now = start
    for state in states:
        now += 1
        before = record
        record = moved(record, state, now)
        assert record.state in STATES and (record.state == "running" or record.state in PARK_STATES)
        assert record.since == (before.since if state == before.state else now)


def test_the_park_object_has_the_contracts_fields():
    assert tuple(park_json("parked", 1.0, 5.0, GiB, True, None)) == PARK_FIELDS


# --- the driver sequences, against the fake --------------------------------------------------------------


@pytest.fixture
def fake():
    FakeNvml.reset()
    FakeCheckpoint.reset()
    yield FakeCheckpoint()
    FakeCheckpoint.reset()
    FakeNvml.reset()


@pytest.fixture
def children():
    started = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    yield tuple(p.pid for p in started)
    for process in started:
        process.kill()
        process.wait()


def test_every_process_parks_to_0_bytes_and_comes_back(fake, children):
    for pid in children:
        FakeNvml.set_usage(pid, "GPU-0", GiB)
    park_processes(fake, children, 1000)
    assert FakeNvml.usage == {}
    assert all(fake.state(pid) == CHECKPOINTED for pid in children)
    assert FakeCheckpoint.parked_pids() == {pid: {"GPU-0": GiB} for pid in children}
    resume_processes(fake, children)
    assert FakeNvml.usage == {pid: {"GPU-0": GiB} for pid in children}
    assert all(fake.state(pid) == DRIVER_RUNNING for pid in children)


def test_a_refused_process_leaves_every_process_of_the_kernel_running(fake, children):
    FakeCheckpoint.foreign.add(children[1])
    for pid in children:
        FakeNvml.set_usage(pid, "GPU-0", GiB)
    with pytest.raises(CheckpointError) as refused:
        park_processes(fake, children, 1000)
    assert refused.value.code == 800
    assert all(fake.state(pid) == DRIVER_RUNNING for pid in children)
    assert set(FakeNvml.usage) == set(children)


def test_an_mps_client_is_refused_with_the_drivers_801(fake, children):
    FakeCheckpoint.refuse(CUDA_ERROR_NOT_SUPPORTED)
    with pytest.raises(CheckpointError) as refused:
        park_processes(fake, children, 1000)
    assert refused.value.code == 801 and "CUDA_ERROR_NOT_SUPPORTED" in str(refused.value)


def test_a_restore_into_a_full_device_breaks_the_process_for_good_as_the_driver_does(fake, children):
    # NVIDIA's driver (580, measured on an H200; cuda-checkpoint issue #44): a restore that finds no room fails
    # with out-of-memory, and every later restore with 304, unlock with 401, even once memory is free again.
    FakeNvml.totals = {"GPU-0": 4 * GiB}
    for pid in children:
        FakeNvml.set_usage(pid, "GPU-0", GiB)
    park_processes(fake, children, 1000)
    FakeNvml.set_usage(os.getpid(), "GPU-0", int(2.5 * GiB))  # another process took the device meanwhile
    with pytest.raises(CheckpointError) as failed:
        resume_processes(fake, children)
    assert failed.value.code == CUDA_ERROR_OUT_OF_MEMORY
    assert fake.state(children[1]) == CHECKPOINTED  # nothing was unlocked while one is still parked
    FakeNvml.clear_usage(os.getpid())  # room again: too late
    with pytest.raises(CheckpointError) as again:
        resume_processes(fake, children)
    assert again.value.code in (CUDA_ERROR_OPERATING_SYSTEM, CUDA_ERROR_ILLEGAL_STATE)
    with pytest.raises(CheckpointError) as unlock:
        fake.unlock(failed.value.pid)
    assert unlock.value.code == CUDA_ERROR_ILLEGAL_STATE


def test_a_restore_with_room_brings_every_process_back(fake, children):
    FakeNvml.totals = {"GPU-0": 4 * GiB}
    for pid in children:
        FakeNvml.set_usage(pid, "GPU-0", GiB)
    park_processes(fake, children, 1000)
    FakeNvml.set_usage(os.getpid(), "GPU-0", GiB)  # others may hold what the parked kernel does not need
    assert resume_processes(fake, children) is True
    assert all(fake.state(pid) == DRIVER_RUNNING for pid in children)


def test_a_process_that_exited_while_parked_is_skipped_on_resume_and_its_host_state_is_gone(fake):
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    FakeNvml.set_usage(process.pid, "GPU-0", GiB)
    park_processes(fake, (process.pid,), 1000)
    process.kill()
    process.wait()
    resume_processes(fake, (process.pid,))
    assert FakeCheckpoint.parked_pids() == {}


def test_the_real_driver_says_plainly_when_there_is_none():
    driver = CudaCheckpointDriver(library="libcuda-that-is-not-here.so.1")
    with pytest.raises(CheckpointUnavailable, match="no CUDA driver here"):
        driver.open()
    with pytest.raises(CheckpointError, match="CUDA_ERROR_NOT_INITIALIZED"):
        driver.lock(os.getpid(), 0)


def test_a_driver_without_the_checkpoint_calls_is_named(tmp_path):
    # Any shared library without the cu* symbols stands for a driver older than the checkpoint API.
    import ctypes.util

    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm to stand for an old driver")
    with pytest.raises(CheckpointUnavailable, match="has no checkpoint API .*cuCheckpointProcessLock"):
        CudaCheckpointDriver(library=libm).open()


def test_usage_nvml_cannot_read_is_unknown_not_nothing():
    # A kernel on a GPU NVML has lost was shown "holds no GPU memory" while it held 9.3 GiB (its usage summed as 0).
    reason = not_parkable(None, False, True, 0, (7,), unreadable=(1,))
    assert reason == "what it holds on GPU 1 is unknown: NVML could not read it"
    from gpu_quota_ext.shared.reasons import short_reason

    assert short_reason(reason) == "its usage on GPU 1 is unknown"
    assert not_parkable(None, False, True, 0, (7,)) == "this kernel holds no GPU memory"


def test_a_later_processes_failed_checkpoint_never_restores_an_earlier_one_blind(fake, children):
    # The first process's checkpoint freed its memory; while the second one's ran (seconds, for a large one), another
    # process took that memory; then the second one failed. Restoring the first to undo the park would be a restore
    # into a device without room: the driver would lose it for good. The kernel stays parked as far as the driver has
    # it (every process locked), and comes back through the broker like any park.
    FakeNvml.totals = {"GPU-0": 4 * GiB}
    for pid in children:
        FakeNvml.set_usage(pid, "GPU-0", GiB)

    class SecondFails(FakeCheckpoint):
        def checkpoint(self, pid):
            if pid == children[1]:
                FakeNvml.set_usage(os.getpid(), "GPU-0", int(2.5 * GiB))  # the first one's memory, taken meanwhile
                raise CheckpointError("cuCheckpointProcessCheckpoint", pid, CUDA_ERROR_OPERATING_SYSTEM)
            super().checkpoint(pid)

    driver = SecondFails()
    try:
        park_processes(driver, children, 1000)
    except CheckpointError:
        pass
    assert FakeCheckpoint.broken == set()
    assert fake.state(children[0]) == CHECKPOINTED and fake.state(children[1]) == LOCKED
    FakeNvml.clear_usage(os.getpid())  # room again (the broker reserves it before it asks)
    assert resume_processes(driver, children) is True
    assert all(fake.state(pid) == DRIVER_RUNNING for pid in children)
