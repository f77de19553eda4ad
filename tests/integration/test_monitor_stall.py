"""A hung NVML call: the monitor says "stalled" (status API, /metrics) instead of showing an old sample as
current, keeps the kernels' lifecycle going, and never holds up the server's exit."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from gpu_quota_ext.policy import GiB

from .fake_gpu import (  # noqa: F401
    fake_gpu_config,
    fake_nvml,
    kernel_entry,
    kernel_pid,
    manager_of,
    next_samples,
    status,
    wait_for,
)
from .kernels import shutdown_kernel, start_kernel
from .test_metrics import scrape


@pytest.fixture
def jp_server_config():
    return fake_gpu_config("kill")


@pytest.mark.slow
async def test_a_hung_nvml_call_makes_the_monitor_stalled_then_ok_again(jp_fetch, jp_serverapp, fake_nvml):
    kernel_id = await start_kernel(jp_fetch)
    pid = await kernel_pid(jp_serverapp, kernel_id)
    device = manager_of(jp_serverapp).ledger.get(kernel_id).devices[0]
    fake_nvml.set_usage(pid, f"static-{device}", 3 * GiB)
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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


SERVER_CONFIG = """
c.ServerApp.jpserver_extensions = {"gpu_quota_ext": True}
c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"
c.StaticInventory.devices = [{"name": "Test GPU 0", "total": "16GiB"}]
c.GpuQuota.nvml_class = "gpu_quota_ext.devices.fake_nvml.HungNvml"
c.GpuQuota.poll_interval = 0.2
"""


@pytest.mark.slow
def test_sigterm_during_a_hung_nvml_call_stops_the_server_promptly(tmp_path):
    (tmp_path / "jupyter_server_config.py").write_text(SERVER_CONFIG)
    for name in ("config", "data", "runtime", "root"):
        (tmp_path / name).mkdir()
    port, token = free_port(), "stall-test-token"
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        JUPYTER_DATA_DIR=str(tmp_path / "data"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
    )
    command = [
        sys.executable, "-m", "jupyter_server",
        f"--config={tmp_path / 'jupyter_server_config.py'}",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", "--ServerApp.open_browser=False",
        f"--ServerApp.root_dir={tmp_path / 'root'}",
    ]
    if hasattr(os, "getuid") and os.getuid() == 0:
        command.append("--allow-root")
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/api/gpu-quota/status"
        deadline = time.monotonic() + 120
        state = None
        while state != "stalled":  # the server is up and its sampler is stuck inside NVML
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, f"never stalled (last state {state})"
            try:
                request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
                with urllib.request.urlopen(request, timeout=5) as answer:
                    state = json.loads(answer.read())["monitor"]["state"]
            except OSError:
                pass
            time.sleep(0.2)
        server.send_signal(signal.SIGTERM)
        # Before the fix the process waited for the sampler thread at exit: for as long as the call hung.
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit within 30 s of SIGTERM while an NVML call hung")
        assert server.returncode is not None
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()
