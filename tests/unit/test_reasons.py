"""Reasons in plain words (shared/reasons.py): the raw details this machine really produces (no NVIDIA
driver here: NVML and libcuda fail to load) become the same few words in the status answer and in %gpucap."""

import pytest

from gpu_quota_ext.devices.inventory import read_nvml_devices
from gpu_quota_ext.devices.nvml import NvmlUnavailable, PynvmlBackend
from gpu_quota_ext.kernel import reasons as kernel_reasons
from gpu_quota_ext.parking.checkpoint import (
    CUDA_ERROR_OUT_OF_MEMORY,
    CheckpointError,
    CheckpointUnavailable,
    CudaCheckpointDriver,
)
from gpu_quota_ext.parking.decisions import MPS_REASON, not_parkable
from gpu_quota_ext.parking.wording import lost_reason
from gpu_quota_ext.shared import contract
from gpu_quota_ext.shared.reasons import (
    MAX_WORDS_CHARS,
    MPS_CLIENT,
    NO_DRIVER,
    RESTORE_FAILED,
    reason_pair,
    short_reason,
)


def this_machine_has_no_driver() -> bool:
    import os

    return not os.path.exists(kernel_reasons.NVIDIA_DRIVER_FILE)


needs_no_driver = pytest.mark.skipif(not this_machine_has_no_driver(), reason="this machine has an NVIDIA driver")


@needs_no_driver
def test_nvml_that_cannot_start_is_said_plainly():
    devices, problem = read_nvml_devices()  # the inventory's own words: the status answer's "message"
    assert devices == [] and "NVMLError" in problem
    assert short_reason(problem) == NO_DRIVER
    with pytest.raises(NvmlUnavailable) as error:
        PynvmlBackend().open()  # the monitor's words
    assert short_reason(f"no GPU usage: {error.value}") == NO_DRIVER


@needs_no_driver
def test_a_checkpoint_driver_that_cannot_be_loaded_is_said_plainly():
    with pytest.raises(CheckpointUnavailable) as error:
        CudaCheckpointDriver().open()  # dlopen of libcuda.so.1 fails here
    raw = not_parkable(str(error.value), False, True, 0, ())
    assert "cannot open shared object" in raw
    pair = reason_pair(raw)
    assert pair == {"reason": NO_DRIVER, "detail": raw}
    assert tuple(pair) == contract.REASON_FIELDS


@needs_no_driver
def test_the_kernel_says_the_same_words_as_the_server():
    state = type("State", (), {"managed": True, "devices": (), "cpu_only_reason": None})()
    assert NO_DRIVER in kernel_reasons.no_gpu_reason(state)


def test_known_driver_problems():
    assert short_reason(MPS_REASON) == MPS_CLIENT
    assert short_reason("no GPU: NVML could not start (NVMLError_DriverNotLoaded: Driver Not Loaded)") == (
        "the NVIDIA driver is installed but not loaded"
    )
    assert short_reason(
        "GPU 1 unreadable: nvmlDeviceGetHandleByUUID failed on static-1 (NVMLError_GpuIsLost: GPU is lost)"
    ) == "GPU 1 is lost (off the bus or being reset)"
    assert short_reason(
        "no GPU could be read: nvmlDeviceGetHandleByUUID failed on static-0 (NVMLError_GpuIsLost: GPU is lost)"
    ) == "a GPU is lost (off the bus or being reset)"


def test_a_lost_kernel_is_told_what_it_can_still_do_not_that_a_gpu_is_lost():
    # The parker's words for a failed restore say "what was on the GPU is lost": not the lost GPU of NVML.
    raw = lost_reason(str(CheckpointError("cuCheckpointProcessRestore", 4242, CUDA_ERROR_OUT_OF_MEMORY)), 17 << 30)
    pair = reason_pair(raw)
    assert pair == {"reason": RESTORE_FAILED, "detail": raw}
    assert "off the bus" not in pair["reason"]
    assert "restart the kernel" in pair["reason"] and "host memory" in pair["reason"]


def test_other_details_keep_their_first_clause_without_the_technical_parts():
    off = "hard limits are off on this server (c.GpuQuota.hard_cap)"
    assert short_reason(off) == "hard limits are off on this server"
    assert short_reason(
        "waiting for device memory others hold now: it needs 17.8 GiB on GPU 0; retry 3 in 20 s (nothing is lost)"
    ) == "waiting for device memory others hold now: it needs 17.8 GiB on GPU 0"
    assert short_reason("this kernel holds no GPU memory") == "it holds no GPU memory"  # after "Not parkable:"
    long = "did not park: " + "the host is short of memory " * 10
    assert len(short_reason(long)) == MAX_WORDS_CHARS and short_reason(long).endswith("…")


def test_nothing_to_explain():
    assert short_reason(None) is None and short_reason("  ") is None
    assert reason_pair(None) is None
    # A detail that is all parentheses still says something.
    assert short_reason("(CUDA_ERROR_UNKNOWN)") == "(CUDA_ERROR_UNKNOWN)"
