"""What the extension logs inside a real server goes through the server's log: its format, its timestamps,
its level; never a bare line on stderr (Python's last-resort handler) and never a dropped INFO line."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading

import pytest
from traitlets.config import Config

from .kernels import static_devices_config
from .servers import server_command

# A real server whose monitor cannot open NVML: the monitor's module logger says so once, at WARNING.
CONFIG = """
from gpu_quota_ext.devices.fake_nvml import FakeNvml

class NoNvml(FakeNvml):
    unavailable = "NVML is switched off in this test"

c.ServerApp.jpserver_extensions = {"gpu_quota_ext": True}
c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"
c.StaticInventory.devices = [{"name": "Log GPU", "total": "16GiB"}]
c.GpuQuota.nvml_class = NoNvml
c.GpuQuota.poll_interval = 0.1
"""


@pytest.fixture
def jp_server_config():
    return Config(static_devices_config("16GiB"))


SERVER_LOG_LINE = re.compile(r"^\[[DIWEC] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} [\w.]+\] ")


def server_log_until(tmp_path, marker: str, *args: str, timeout: float = 60) -> list:
    config = tmp_path / "config.py"
    config.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_QUOTA_")}
    env.update(JUPYTER_CONFIG_DIR=str(tmp_path / "jupyter"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    command = server_command(tmp_path, f"--config={config}", *args)
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = threading.Timer(timeout, process.kill)  # the marker never came: stop reading
    deadline.start()
    lines = []
    try:
        for line in process.stderr:
            lines.append(line.rstrip("\n"))
            if marker in line:
                break
    finally:
        deadline.cancel()
        process.kill()
        process.wait()
    assert any(marker in line for line in lines), "\n".join(lines)
    return lines


@pytest.mark.slow
def test_the_monitors_warning_is_a_server_log_line(tmp_path):
    lines = server_log_until(tmp_path, "NVML is switched off in this test")
    (ours,) = [line for line in lines if "NVML is switched off" in line]
    assert SERVER_LOG_LINE.match(ours) and ours.startswith("[W "), ours
    assert " gpu_quota_ext] " in ours
    bare = [line for line in lines if line.startswith("gpu-quota-ext")]
    assert bare == [], bare


async def test_info_from_the_package_reaches_the_servers_handlers(jp_serverapp):
    # What the monitor and the service log with logging.getLogger("gpu_quota_ext") at INFO (a released
    # grant, NVML readable again) lands where the server's own lines go, at the server's level.
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.levelname, record.getMessage()))

    handler = Keep()
    jp_serverapp.log.addHandler(handler)
    try:
        logging.getLogger("gpu_quota_ext").info("gpu-quota-ext: probe %d", 1)
        logging.getLogger("gpu_quota_ext.usage.sampling").debug("gpu-quota-ext: debug probe")  # shown at --debug
    finally:
        jp_serverapp.log.removeHandler(handler)
    expected = [("INFO", "gpu-quota-ext: probe 1")]
    if jp_serverapp.log.isEnabledFor(logging.DEBUG):
        expected.append(("DEBUG", "gpu-quota-ext: debug probe"))
    assert seen == expected


@pytest.mark.slow
def test_a_machine_without_a_gpu_gets_one_plain_line_and_nothing_like_an_error(tmp_path):
    """Issue 31 item 5: with no NVIDIA driver, the server's own inventory, monitor and parker say once, at
    INFO, that there is no GPU; parking's missing libcuda (no news without a GPU) is said at DEBUG only."""
    from gpu_quota_ext.devices.inventory import read_nvml_devices

    devices, problem = read_nvml_devices()
    if devices or "LibraryNotFound" not in (problem or ""):
        pytest.skip(f"this machine has an NVIDIA driver ({problem or 'GPUs seen'})")
    lines = server_log_until(
        tmp_path,
        "parking is not possible",  # the parker's driver check, the last of the start: said at DEBUG
        "--debug",
        "--GpuQuota.inventory_class=gpu_quota_ext.devices.NvmlInventory",
        "--GpuQuota.nvml_class=gpu_quota_ext.devices.nvml.PynvmlBackend",
    )
    ours = [line for line in lines if "gpu-quota-ext" in line and not line.startswith("[D ")]
    assert [line for line in ours if "no GPU" in line] == [
        next(line for line in ours if "no GPU on this machine (no NVIDIA driver)" in line)
    ], ours
    assert all(line.startswith("[I ") for line in ours), ours
    assert not [line for line in ours if "libcuda" in line or "Error" in line or "NVML" in line], ours
    (parking,) = [line for line in lines if "parking is not possible" in line]
    assert parking.startswith("[D "), parking
