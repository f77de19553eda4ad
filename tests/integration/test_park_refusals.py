"""Where parking cannot work, a real server says so: a kernel under MPS (the hard-limit layer knows it
is an MPS client; the driver would answer 801), and invalid park settings stop the server at start."""

import json

import pytest
from tornado.httpclient import HTTPClientError

from gpu_quota_ext.parking.decisions import MPS_REASON
from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint

from .fake_gpu import kernel_entry, status, wait_for
from .fake_mps import mps_config
from .kernels import start_kernel
from .test_bad_config import STATIC, start_server


@pytest.fixture
def jp_server_config():
    return mps_config(
        "80GiB", checkpoint_class="gpu_quota_ext.parking.fake_checkpoint.FakeCheckpoint",
        nvml_class="gpu_quota_ext.devices.fake_nvml.FakeNvml", poll_interval=0.2,
    )


async def test_a_kernel_under_mps_is_not_parkable_and_says_why(jp_fetch, jp_serverapp):
    FakeCheckpoint.reset()
    kernel_id = await start_kernel(jp_fetch)
    state = await status(jp_fetch)
    assert kernel_entry(state, kernel_id)["layers"]["hard_limit"], "the kernel got the MPS hard limit"

    async def reason():
        park = kernel_entry(await status(jp_fetch), kernel_id)["park"]
        return park if park["reason"] == MPS_REASON else None

    park = await wait_for(reason, timeout=30)
    assert park["parkable"] is False
    with pytest.raises(HTTPClientError) as refused:
        await jp_fetch("api", "gpu-quota", "kernels", kernel_id, "park", method="POST", body="{}")
    assert refused.value.code == 409
    assert json.loads(refused.value.response.body)["message"] == MPS_REASON
    assert FakeCheckpoint.calls == []  # the driver was never asked


@pytest.mark.parametrize(
    "args, env_extra, expected",
    [
        (["--GpuQuota.park_idle_after=soon"], None, "c.GpuQuota.park_idle_after = 'soon'"),
        (
            [],
            {"GPU_QUOTA_PARK_IDLE_AFTER": "-5min"},
            "c.GpuQuota.park_idle_after = '-5min' (from the environment variable GPU_QUOTA_PARK_IDLE_AFTER)",
        ),
        (["--GpuQuota.park_host_margin=lots"], None, "c.GpuQuota.park_host_margin = 'lots'"),
        (["--GpuQuota.checkpoint_class=os.path"], None, "checkpoint_class"),
        (["--GpuQuota.park_min_idle=-1min"], None, "c.GpuQuota.park_min_idle = '-1min'"),
        (["--GpuQuota.park_wait_limit=forever"], None, "c.GpuQuota.park_wait_limit = 'forever'"),
        (
            [],
            {"GPU_QUOTA_PARK_ON_DEVICE_FULL": "maybe"},
            "c.GpuQuota.park_on_device_full = 'maybe' (from the environment variable GPU_QUOTA_PARK_ON_DEVICE_FULL)",
        ),
    ],
)
def test_invalid_park_settings_stop_the_server_with_one_clear_line(tmp_path, args, env_extra, expected):
    returncode, stderr = start_server(tmp_path, STATIC + args, env_extra)
    assert returncode not in (None, 0), "the server kept running with an invalid setting"
    ours = [line for line in stderr.splitlines() if "gpu-quota-ext: invalid configuration" in line]
    assert len(ours) == 1, stderr
    assert expected in ours[0]
    assert "Traceback" not in stderr
