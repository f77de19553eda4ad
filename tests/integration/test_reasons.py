"""Reasons in plain words in a real server's status answer: each raw reason (the driver's error text) is
there as it was, and again as a short `reason` with the raw `detail` (shared/reasons.py), which the sidebar
shows and puts on hover. On this machine no NVIDIA driver is loaded: NVML and libcuda fail for real."""

import json
import os

import pytest
from traitlets.config import Config

from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.devices.nvml import NvmlUnavailable
from gpu_quota_ext.kernel.reasons import NVIDIA_DRIVER_FILE
from gpu_quota_ext.shared import contract
from gpu_quota_ext.shared.reasons import NO_DRIVER

from .fake_gpu import fake_gpu_config, kernel_entry, status, wait_for
from .kernels import shutdown_kernel, start_kernel

needs_no_driver = pytest.mark.skipif(os.path.exists(NVIDIA_DRIVER_FILE), reason="this machine has an NVIDIA driver")


def assert_pairs(reasons, keys) -> None:
    assert tuple(reasons) == keys
    for pair in reasons.values():
        assert pair is None or (tuple(pair) == contract.REASON_FIELDS and pair["reason"] and pair["detail"])


class TestWithGpus:
    @pytest.fixture
    def jp_server_config(self):
        # The fake NVML, and the real checkpoint driver (the default): libcuda.so.1 cannot be loaded here.
        return fake_gpu_config("warn")

    async def test_every_reason_has_its_pair(self, jp_fetch, fake_nvml):
        kernel_id = await start_kernel(jp_fetch)
        answer = await status(jp_fetch)
        assert_pairs(answer["reasons"], contract.STATUS_REASONS)
        assert answer["reasons"] == {"no_gpu": None, "monitor": None}  # GPUs, and a monitor that measures
        for kernel in answer["kernels"]:
            assert_pairs(kernel["reasons"], contract.KERNEL_REASONS)
        entry = kernel_entry(answer, kernel_id)
        assert entry["reasons"]["cpu_only"] is None
        # The hard limit is off on this server: its reason, short, the raw text kept.
        assert entry["reasons"]["hard_limit"]["detail"] == entry["layers"]["hard_reason"]
        assert entry["reasons"]["hard_limit"]["reason"] == "hard limits are off on this server"
        await shutdown_kernel(jp_fetch, kernel_id)

    @needs_no_driver
    async def test_a_kernel_that_cannot_park_for_want_of_a_driver_says_so_plainly(self, jp_fetch, fake_nvml):
        kernel_id = await start_kernel(jp_fetch)
        entry = kernel_entry(await status(jp_fetch), kernel_id)
        raw = entry["park"]["reason"]
        assert entry["park"]["parkable"] is False and "libcuda.so.1" in raw  # the raw field as it was
        assert entry["reasons"]["park"] == {"reason": NO_DRIVER, "detail": raw}
        await shutdown_kernel(jp_fetch, kernel_id)


class DriverNotLoaded(FakeNvml):
    """NVML as on a machine whose NVIDIA driver is installed but not loaded."""

    def open(self) -> None:
        raise NvmlUnavailable("NVML could not start (NVMLError_DriverNotLoaded: Driver Not Loaded)")


class TestMonitorCannotMeasure:
    @pytest.fixture
    def jp_server_config(self):
        return fake_gpu_config("warn", nvml_class=f"{__name__}.DriverNotLoaded")

    async def test_the_monitors_message_in_plain_words(self, jp_fetch):
        async def answered():
            answer = await status(jp_fetch)
            return answer if answer["monitor"]["state"] == "no-gpu" else None

        answer = await wait_for(answered, timeout=30)
        assert answer["gpu"] is True  # the static GPUs are there; only their usage cannot be read
        assert answer["reasons"]["monitor"] == {
            "reason": "the NVIDIA driver is installed but not loaded",
            "detail": answer["monitor"]["message"],
        }


class TestNvmlCannotStart:
    @pytest.fixture
    def jp_server_config(self):
        # The default inventory: NVML, which cannot start on this machine.
        return Config({"ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}}})

    @needs_no_driver
    async def test_the_no_gpu_message_in_plain_words(self, jp_fetch):
        answer = json.loads((await jp_fetch("api", "gpu-quota", "status")).body)
        assert answer["gpu"] is False and "NVMLError_LibraryNotFound" in answer["message"]
        assert answer["reasons"]["no_gpu"] == {"reason": NO_DRIVER, "detail": answer["message"]}
