"""A hung NVML call: the monitor says "stalled" (status API, /metrics) instead of showing an old sample as
current, keeps the kernels' lifecycle going, and never holds up the server's exit."""

import os
import signal
import subprocess

import pytest

from gpu_quota_ext.shared.sizes import GiB

from ..kernel_transport import short_directory
from .fake_gpu import fake_gpu_config, kernel_entry, kernel_pid, manager_of, next_samples, status, uses_gpu, wait_for
from .fake_mps import wait_until
from .kernels import shutdown_kernel, start_kernel
from .servers import Server
from .test_metrics import scrape


@pytest.fixture
def jp_server_config():
    return fake_gpu_config("kill")


@pytest.mark.slow
async def test_a_hung_nvml_call_makes_the_monitor_stalled_then_ok_again(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    pid, device = await uses_gpu(jp_serverapp, kernel_id, 3 * GiB)
    await next_samples(jp_serverapp)
    assert (await status(jp_fetch))["monitor"]["state"] == "ok"
    metrics = await scrape(jp_fetch)
    assert metrics["gpu_quota_monitor_stalled"] == 0

    release = fake_nvml.hang()
    try:
        stalled = await wait_for(
            lambda: _monitor_if(jp_fetch, "stalled"), timeout=30, step=0.2
        )
        assert "since" in stalled["monitor"]["message"] and "NVML" in stalled["monitor"]["message"]
        # An old sample is not shown as current: usage is unknown while the monitor is stalled.
        assert kernel_entry(stalled, kernel_id)["devices"][0]["used"] is None
        assert all(d["used"] is None for d in stalled["devices"])
        metrics = await scrape(jp_fetch)
        assert metrics["gpu_quota_monitor_stalled"] == 1
        assert metrics["gpu_quota_monitor_sample_age_seconds"] >= stalled["monitor"]["stalled_after"]
        assert f'gpu_quota_device_used_bytes{{device="{device}"}}' not in metrics
        # The server answers and its kernels work meanwhile.
        assert (await jp_fetch("api", "kernels")).code == 200
    finally:
        release.set()
    again = await wait_for(lambda: _monitor_if(jp_fetch, "ok"), timeout=30, step=0.2)
    assert kernel_entry(again, kernel_id)["devices"][0]["used"] == 3 * GiB
    assert (await scrape(jp_fetch))["gpu_quota_monitor_stalled"] == 0
    await shutdown_kernel(jp_fetch, kernel_id)


async def _monitor_if(jp_fetch, state):
    answer = await status(jp_fetch)
    return answer if answer["monitor"]["state"] == state else None


class TestLifecycleDuringAStall:
    @pytest.fixture
    def jp_server_config(self):
        config = fake_gpu_config("warn")
        config.KernelManager.autorestart = False
        return config

    async def test_a_dead_kernel_gives_its_grant_back_while_nvml_hangs(self, jp_fetch, jp_serverapp, fake_nvml):
        kernel_id = await start_kernel(jp_fetch)
        pid = await kernel_pid(jp_serverapp, kernel_id)
        manager = manager_of(jp_serverapp)
        release = fake_nvml.hang()
        try:
            await wait_for(lambda: _monitor_if(jp_fetch, "stalled"), timeout=30, step=0.2)
            os.kill(pid, signal.SIGKILL)
            await wait_for(lambda: manager.ledger.get(kernel_id) is None, timeout=10)
            assert (await status(jp_fetch))["monitor"]["state"] == "stalled"
        finally:
            release.set()
        await shutdown_kernel(jp_fetch, kernel_id)


# --- a real server process, SIGTERM while an NVML call hangs for good ----------------------------


SERVER_CONFIG = {
    "GpuQuota": {
        "inventory_class": "gpu_quota_ext.devices.StaticInventory",
        "nvml_class": "gpu_quota_ext.devices.fake_nvml.HungNvml",
        "poll_interval": 0.2,
    },
    "StaticInventory": {"devices": [{"name": "Test GPU 0", "total": "16GiB"}]},
}


def monitor_state(server: Server) -> str:
    return server.api("/api/gpu-quota/status", timeout=5)["monitor"]["state"]


@pytest.mark.slow
def test_sigterm_during_a_hung_nvml_call_stops_the_server_promptly(short_tmp):
    server = Server(short_directory(short_tmp), [], config=SERVER_CONFIG)
    try:
        server.wait_serving(timeout=120)
        # The server is up and its sampler is stuck inside NVML.
        wait_until(lambda: monitor_state(server) == "stalled", timeout=120, step=0.2)
        server.process.send_signal(signal.SIGTERM)
        # Before the fix the process waited for the sampler thread at exit: for as long as the call hung.
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit within 30 s of SIGTERM while an NVML call hung")
    finally:
        server.kill()
