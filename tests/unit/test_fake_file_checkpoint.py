"""The file-backed fake checkpoint driver (parking/fake_file_checkpoint.py): what FakeCheckpoint does, on the file
devices.FileFakeNvml reads, so that servers in processes of their own and the host service share one fake GPU."""

import subprocess

import pytest

from gpu_quota_ext.devices.fake_nvml import FileFakeNvml
from gpu_quota_ext.parking import CheckpointUnavailable
from gpu_quota_ext.parking.checkpoint import (
    CHECKPOINTED,
    CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_OPERATING_SYSTEM,
    CUDA_ERROR_OUT_OF_MEMORY,
    DRIVER_RUNNING,
    CheckpointError,
)
from gpu_quota_ext.parking.fake_file_checkpoint import FileFakeCheckpoint, read_state, set_usage, write_totals
from gpu_quota_ext.shared.sizes import GiB

UUID = "GPU-file-0"


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.setenv(FileFakeNvml.VARIABLE, str(tmp_path / "nvml.json"))
    write_totals({UUID: 10 * GiB})
    processes = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]
    yield [p.pid for p in processes]
    for process in processes:
        process.kill()
        process.wait()


def failure(call, *args):
    with pytest.raises(CheckpointError) as failed:
        call(*args)
    return failed.value.code


def test_a_park_moves_the_usage_the_fake_nvml_reads_to_the_host_and_back(files):
    a, b = files
    set_usage(a, UUID, 6 * GiB)
    set_usage(b, UUID, 3 * GiB)
    nvml, driver = FileFakeNvml(), FileFakeCheckpoint()
    driver.open()
    assert nvml.device_used(UUID) == 9 * GiB
    driver.lock(a, 0)
    driver.checkpoint(a)
    assert nvml.device_processes(UUID) == [(b, 3 * GiB)] and driver.state(a) == CHECKPOINTED
    assert read_state()["host"] == {str(a): {UUID: 6 * GiB}}
    driver.restore(a)
    driver.unlock(a)
    assert nvml.device_used(UUID) == 9 * GiB and driver.state(a) == DRIVER_RUNNING
    (restore,) = read_state()["restores"]
    assert (restore["need"], restore["free"], restore["ok"]) == ({UUID: 6 * GiB}, {UUID: 7 * GiB}, True)
    assert failure(driver.unlock, a) == CUDA_ERROR_ILLEGAL_STATE  # not locked


def test_a_restore_into_a_full_device_breaks_the_process_for_good(files):
    a, b = files
    set_usage(a, UUID, 6 * GiB)
    driver = FileFakeCheckpoint()
    driver.lock(a, 0)
    driver.checkpoint(a)
    set_usage(b, UUID, 5 * GiB)  # taken meanwhile: 5 GiB free
    assert failure(driver.restore, a) == CUDA_ERROR_OUT_OF_MEMORY
    set_usage(b, UUID, 0)
    assert failure(driver.restore, a) == CUDA_ERROR_OPERATING_SYSTEM  # whatever is free now
    assert failure(driver.unlock, a) == CUDA_ERROR_ILLEGAL_STATE
    state = read_state()
    assert state["broken"] == [a] and [r["ok"] for r in state["restores"]] == [False]


def test_a_process_that_exited_is_not_found_and_no_driver_without_the_file(files, monkeypatch):
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert failure(FileFakeCheckpoint().lock, gone.pid, 0) == CUDA_ERROR_NOT_FOUND
    monkeypatch.delenv(FileFakeNvml.VARIABLE)
    with pytest.raises(CheckpointUnavailable):
        FileFakeCheckpoint().open()
