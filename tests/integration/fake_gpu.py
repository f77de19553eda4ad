"""Helpers for tests that run a real server with the fake NVML (gpu_quota_ext.devices.fake_nvml.FakeNvml)."""

from __future__ import annotations

import json
from typing import Optional, Tuple

from traitlets.config import Config

from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.manager import SETTINGS_KEY

from ..waiting import wait_for
from .kernels import execute, static_devices_config

POLL = 0.2  # seconds between samples in these tests


def fake_gpu_config(enforce: str = "warn", **gpu_quota) -> Config:
    """Two static 16 GiB devices, the fake NVML, a fast poll, no slack beyond 1 GiB, no grace."""
    settings = {
        "nvml_class": "gpu_quota_ext.devices.fake_nvml.FakeNvml",
        "poll_interval": POLL,
        "enforce": enforce,
        "slack": "1GiB",
        "grace": 0,
    }
    settings.update(gpu_quota)
    return Config(static_devices_config("16GiB", "16GiB", **settings))


def manager_of(serverapp):
    """The extension's GpuQuotaManager in a running server."""
    return serverapp.web_app.settings[SETTINGS_KEY]


async def kernel_pid(serverapp, kernel_id: str) -> int:
    """The PID the kernel itself reports: what NVML would list for it."""
    return int((await execute(serverapp, kernel_id, "import os; print(os.getpid())")).strip())


async def uses_gpu(serverapp, kernel_id: str, nbytes: int, pid: Optional[int] = None) -> Tuple[int, int]:
    """The kernel's own process (or `pid`) 'uses' `nbytes` on the kernel's first granted device, as the fake NVML
    shows it from now on: (that pid, the device's index)."""
    pid = pid or await kernel_pid(serverapp, kernel_id)
    device = manager_of(serverapp).ledger.get(kernel_id).devices[0]
    FakeNvml.set_usage(pid, f"static-{device}", nbytes)
    return pid, device


async def status(jp_fetch) -> dict:
    return json.loads((await jp_fetch("api", "gpu-quota", "status")).body)


def kernel_entry(state: dict, kernel_id: str) -> dict:
    return next(k for k in state["kernels"] if k["id"] == kernel_id)


async def next_samples(serverapp, count: int = 2) -> None:
    """Wait until the monitor has completed `count` more rounds."""
    monitor = manager_of(serverapp).monitor
    start = monitor.ticks
    await wait_for(lambda: monitor.ticks >= start + count)
