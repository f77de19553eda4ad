"""What other parts (parking, a remote ledger) build on, with a real server and real kernels: a kernel's
activity as jupyter_server keeps it, its PIDs on the GPUs, a hook after every sample, fields added to
the status view; and a server without a GPU still has a monitor that says why."""

from __future__ import annotations

import datetime
import json
import threading

import pytest
from traitlets.config import Config

from .fake_gpu import fake_gpu_config, kernel_entry, kernel_pid, manager_of, next_samples, status, uses_gpu
from .kernels import execute, shutdown_kernel, start_kernel, static_devices_config


@pytest.fixture
def jp_server_config():
    return fake_gpu_config("warn")


async def test_a_kernels_activity_pids_and_each_sample_are_there_for_other_parts(jp_fetch, jp_serverapp, fake_nvml):
    manager = manager_of(jp_serverapp)
    kernel_id = await start_kernel(jp_fetch)
    pid = await kernel_pid(jp_serverapp, kernel_id)

    state, before = manager.kernels.activity(kernel_id)
    assert state in ("idle", "busy") and isinstance(before, datetime.datetime)
    await execute(jp_serverapp, kernel_id, "print(1)")
    state, after = manager.kernels.activity(kernel_id)
    assert after > before  # the cell was activity
    assert manager.kernels.activity("no-such-kernel") == (None, None)

    seen = []
    manager.monitor.on_sample(lambda sample: seen.append((threading.get_ident(), sample)))
    await uses_gpu(jp_serverapp, kernel_id, 1 << 30, pid)
    await next_samples(jp_serverapp, 2)
    assert manager.gpu_pids(kernel_id) == (pid,)
    assert seen and all(ident == threading.get_ident() for ident, _ in seen)  # on the event loop's thread
    assert seen[-1][1] is manager.monitor.latest

    with pytest.raises(ValueError):  # "park" is the parker's, registered by the manager
        manager.status.add_kernel_field("park", lambda kid: None)
    manager.status.add_kernel_field("extra", lambda kid: {"state": "running", "pids": list(manager.gpu_pids(kid))})
    entry = kernel_entry(await status(jp_fetch), kernel_id)
    assert entry["extra"] == {"state": "running", "pids": [pid]} and entry["park"]["state"] in ("idle", "busy")
    one = json.loads((await jp_fetch("api", "gpu-quota", "kernels", kernel_id)).body)
    assert one["extra"] == {"state": "running", "pids": [pid]} and one["park"]["state"] in ("idle", "busy")
    await shutdown_kernel(jp_fetch, kernel_id)
    assert manager.gpu_pids(kernel_id) in ((), (pid,))  # until the next sample, the last one's figures


class TestNoGpu:
    @pytest.fixture
    def jp_server_config(self):
        return Config(static_devices_config())

    async def test_without_a_gpu_the_monitor_exists_and_says_so(self, jp_fetch, jp_serverapp):
        manager = manager_of(jp_serverapp)
        answer = await status(jp_fetch)
        assert answer["gpu"] is False and answer["monitor"]["state"] == "no-gpu"
        assert answer["monitor"]["message"] == answer["message"] and "no GPU" in answer["message"]
        assert answer["actions"] == [] and "enforce" in answer["policy"]
        assert manager.monitor._task is not None  # started like any other: nothing to sample, said once
