"""Helpers for tests of the hard limit with the fake MPS control program (tests/fake_mps/)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

from traitlets.config import Config

FAKE_CONTROL = Path(__file__).parents[1] / "fake_mps" / "nvidia-cuda-mps-control"
OTHER_USER = "gq-mps-other"
MPS_VARIABLES = [
    "CUDA_VISIBLE_DEVICES",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY",
    "GPU_QUOTA_LAYERS",
]


def mps_config(*totals: str, **gpu_quota) -> Config:
    """The extension on, a static inventory of devices with UUIDs (GPU-0000…, GPU-1111…), the fake control
    program, a managed daemon and hard_cap "auto" unless the test says otherwise."""
    settings = {
        "inventory_class": "gpu_quota_ext.devices.StaticInventory",
        "hard_cap": "auto",
        "mps_control": str(FAKE_CONTROL),
        "mps_timeout": 3,
    }
    settings.update(gpu_quota)
    devices = [{"name": f"Test GPU {i}", "total": t, "uuid": f"GPU-{str(i) * 4}-test"} for i, t in enumerate(totals)]
    return Config(
        {
            "ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}},
            "GpuQuota": settings,
            "StaticInventory": {"devices": devices},
        }
    )


def control(pipe_directory: str, commands: str, timeout: float = 10) -> str:
    """`echo commands | nvidia-cuda-mps-control` (the fake) against this pipe directory."""
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_directory)
    done = subprocess.run([str(FAKE_CONTROL)], input=commands, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout


def start_daemon(pipe_directory: str) -> int:
    """An admin's daemon (for "external" tests): its PID."""
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_directory)
    subprocess.run([str(FAKE_CONTROL), "-d"], env=env, check=True, timeout=10)
    return int((Path(pipe_directory) / "nvidia-cuda-mps-control.pid").read_text())


def fake_processes() -> Dict[int, List[str]]:
    """pid -> argv of every process running the fake control program or a fake MPS server."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        if state != "Z" and any(str(FAKE_CONTROL) in w or w == "nvidia-cuda-mps-server" for w in words):
            found[int(entry)] = words
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(predicate, timeout: float = 20.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(step)


def other_user() -> Optional[int]:
    """The uid of a second Unix user (made with useradd when missing), or None when this is not root."""
    if os.getuid() != 0 or shutil.which("useradd") is None:
        return None
    try:
        return pwd.getpwnam(OTHER_USER).pw_uid
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER], check=True
        )
        return pwd.getpwnam(OTHER_USER).pw_uid
