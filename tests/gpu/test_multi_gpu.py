"""Issue 7: placement and caps across two real GPUs (the device tool's nvidia-h200-x2).

Skipped on machines with fewer than two GPUs. Run with `bash tests/gpu/run_on_device.sh multi_gpu` on a
two-GPU machine; each test prints FIGURE lines.
"""

import json

import pytest
from traitlets.config import Config

from ..integration.kernels import execute, kernel_env, start_kernel
from .conftest import gpu_count, kernel_pid, record

pytestmark = pytest.mark.gpu


needs_two = pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")

TOUCH = "import torch; x = torch.ones(1, device='cuda'); print(torch.cuda.device_count())"

# Just under and just over the cap on every GPU this kernel sees (0.99 and 1.01 of the cap).
AROUND_CAP = """
import json, os, torch
caps = {d["ordinal"]: d["cap"] for d in json.loads(os.environ["GPU_QUOTA_DEVICES"])}
result = {}
for ordinal, cap in caps.items():
    total = torch.cuda.get_device_properties(ordinal).total_memory
    cap_in_torch = min(cap, total)
    row = []
    for factor in (0.99, 1.01):
        try:
            x = torch.empty(int(factor * cap_in_torch), dtype=torch.int8, device=f"cuda:{ordinal}")
            del x
            row.append("ok")
        except torch.OutOfMemoryError:
            row.append("OOM")
        torch.cuda.empty_cache()
    result[ordinal] = row
print(json.dumps(result))
"""


def config(placement: str, **more) -> Config:
    return Config(
        {
            "ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}},
            "GpuQuota": {"default_cap": "0.2", "placement": placement, "overcommit": 0.5, **more},
        }
    )


async def start_four_and_touch(jp_fetch, jp_serverapp):
    kernels = [await start_kernel(jp_fetch) for _ in range(4)]
    for kernel_id in kernels:
        await execute(jp_serverapp, kernel_id, TOUCH, timeout=180)
    status = json.loads((await jp_fetch("api", "gpu-quota", "status")).body)
    placed = {k["id"]: k["devices"][0]["index"] for k in status["kernels"]}
    used = nvml_used_by_pid_per_device()
    return kernels, placed, used, status


def nvml_used_by_pid_per_device() -> dict:
    import pynvml

    pynvml.nvmlInit()
    where = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
            where.setdefault(process.pid, set()).add(i)
    return where


class TestSpread:
    @pytest.fixture
    def jp_server_config(self):
        return config("spread")

    @needs_two
    async def test_four_kernels_land_two_per_gpu_and_nvml_agrees(self, jp_fetch, jp_serverapp):
        kernels, placed, where, status = await start_four_and_touch(jp_fetch, jp_serverapp)
        record("spread: ledger placement", sorted(placed.values()))
        assert sorted(placed.values()) == [0, 0, 1, 1]
        for kernel_id in kernels:
            env = await kernel_env(jp_serverapp, kernel_id, ["CUDA_VISIBLE_DEVICES"])
            device = status["devices"][placed[kernel_id]]
            assert env["CUDA_VISIBLE_DEVICES"] == device["uuid"]
            assert where.get(kernel_pid(jp_serverapp, kernel_id)) == {placed[kernel_id]}
        record("spread: status API devices", [(d["index"], d["granted"], d["used"]) for d in status["devices"]])
        around = json.loads((await execute(jp_serverapp, kernels[0], AROUND_CAP, timeout=180)).strip().splitlines()[-1])
        record("spread: 0.99 / 1.01 of the cap", around)
        assert around == {"0": ["ok", "OOM"]}


class TestPack:
    @pytest.fixture
    def jp_server_config(self):
        return config("pack")

    @needs_two
    async def test_pack_fills_gpu0_up_to_its_budget_first(self, jp_fetch, jp_serverapp):
        # budget 0.5 of a GPU, caps 0.2: two kernels fit on GPU 0, the next two go to GPU 1.
        _, placed, _, _ = await start_four_and_touch(jp_fetch, jp_serverapp)
        record("pack: ledger placement", sorted(placed.values()))
        assert sorted(placed.values()) == [0, 0, 1, 1]
        assert [placed[k] for k in list(placed)[:2]] == [0, 0]


class TestTwoDeviceKernel:
    @pytest.fixture
    def jp_server_config(self):
        return config("spread", caps=[{"kernelspec": "python3", "cap": "0.2", "devices": 2}])

    @needs_two
    async def test_a_kernel_granted_both_gpus_has_a_cap_on_each(self, jp_fetch, jp_serverapp):
        kernel_id = await start_kernel(jp_fetch)
        around = json.loads((await execute(jp_serverapp, kernel_id, AROUND_CAP, timeout=300)).strip().splitlines()[-1])
        record("two devices: 0.99 / 1.01 of the cap on each", around)
        assert around == {"0": ["ok", "OOM"], "1": ["ok", "OOM"]}
