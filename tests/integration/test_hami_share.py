"""Issue 15, the pod side: a real jupyter_server and real kernels inside a HAMi-limited container.

Simulated: no HAMi runs here. The test sets, for the server process, the variables HAMi's device plugin
gives a container that asked for `nvidia.com/gpumem: 20480` (CUDA_DEVICE_MEMORY_LIMIT_0="20480m",
CUDA_DEVICE_SM_LIMIT, CUDA_DEVICE_MEMORY_SHARED_CACHE); the physical GPU is a static 80 GiB device (or
NVML faked at its one driver call), because this machine has no GPU and no HAMi-core.
What is checked is what the extension does with them: the pod's 20 GiB is each device's total, caps
are fractions of it, admission refuses past it, and kernels inherit HAMi's variables unchanged.
"""

import json

import pytest
from tornado.httpclient import HTTPClientError
from traitlets.config import Config

from gpu_quota_ext.devices import Device
from gpu_quota_ext.devices import inventory as devices_module
from gpu_quota_ext.shared.sizes import GiB

from .kernels import execute, kernel_env, start_kernel, static_devices_config

SHARE = 20 * GiB
HAMI_ENV = {
    "CUDA_DEVICE_MEMORY_LIMIT_0": "20480m",
    "CUDA_DEVICE_SM_LIMIT": "50",
}


@pytest.fixture
def hami_env(monkeypatch, tmp_path):
    """The server's environment as HAMi's device plugin leaves it (set before the server starts)."""
    env = dict(HAMI_ENV, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "vgpu" / "0b1c.cache"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def hami_config(**gpu_quota) -> Config:
    config = static_devices_config("80GiB", **gpu_quota)
    config["GpuQuota"]["inventory_class"] = "gpu_quota_ext.devices.HamiInventory"
    config["HamiInventory"] = {"physical_class": "gpu_quota_ext.devices.StaticInventory"}
    return Config(config)


async def status(jp_fetch) -> dict:
    return json.loads((await jp_fetch("api", "gpu-quota", "status")).body)


class TestShareIsTheBudget:
    @pytest.fixture
    def jp_server_config(self, hami_env):
        return hami_config(default_cap="0.25", max_cap="0.5", overcommit=1.0, on_full="refuse", on_over_max="refuse")

    async def test_caps_are_fractions_of_the_share_and_the_sidebar_shows_it(self, jp_fetch, jp_serverapp):
        (device,) = (await status(jp_fetch))["devices"]
        assert device["total"] == SHARE and device["budget"] == SHARE  # overcommit 1.0
        assert device["name"] == "Test GPU 0 (HAMi share)"

        kernel_id = await start_kernel(jp_fetch)
        env = await kernel_env(
            jp_serverapp, kernel_id, ["GPU_QUOTA_DEVICES", "CUPY_GPU_MEMORY_LIMIT", "XLA_PYTHON_CLIENT_MEM_FRACTION"]
        )
        (granted,) = json.loads(env["GPU_QUOTA_DEVICES"])
        # default_cap 0.25 is a quarter of the pod's 20 GiB, not of the 80 GiB GPU.
        assert (granted["cap"], granted["max_cap"], granted["total"]) == (5 * GiB, 10 * GiB, SHARE)
        assert env["CUPY_GPU_MEMORY_LIMIT"] == str(5 * GiB)
        # A fraction of the share: under HAMi-core, torch and JAX see the share as the device's memory.
        assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2500"

    async def test_admission_splits_the_share_and_refuses_past_it(self, jp_fetch, jp_serverapp):
        kernels = [await start_kernel(jp_fetch) for _ in range(4)]  # 4 x 5 GiB = the whole 20 GiB share
        with pytest.raises(HTTPClientError) as refused:
            await start_kernel(jp_fetch)
        assert refused.value.code == 503
        assert "budget" in refused.value.response.body.decode()
        state = await status(jp_fetch)
        assert state["devices"][0]["granted"] == SHARE
        assert len(state["kernels"]) == 4

        # Raising one kernel's cap to its max_cap (half the share) does not fit either: refused, unchanged.
        with pytest.raises(HTTPClientError) as raised:
            await jp_fetch("api", "gpu-quota", "kernels", kernels[0], method="PUT", body=json.dumps({"cap": "0.5"}))
        assert raised.value.code == 409
        state = await status(jp_fetch)
        assert next(k for k in state["kernels"] if k["id"] == kernels[0])["devices"][0]["cap"] == 5 * GiB

        # A kernel gone: its 5 GiB is free for the next one.
        await jp_fetch("api", "kernels", kernels[1], method="DELETE")
        await start_kernel(jp_fetch)
        assert (await status(jp_fetch))["devices"][0]["granted"] == SHARE

    async def test_kernels_inherit_the_pods_hami_variables_unchanged(self, jp_fetch, jp_serverapp, hami_env):
        """One HAMi limit per pod: a kernel with its own CUDA_DEVICE_MEMORY_LIMIT* or shared cache file would
        set the pod's total (if first to start CUDA) or leave it. Kernels see exactly the server's."""
        kernel_id = await start_kernel(jp_fetch)
        out = await execute(
            jp_serverapp,
            kernel_id,
            "import os, json; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('CUDA_DEVICE_')"
            " or k == 'CUDA_DISABLE_CONTROL'}))",
        )
        assert json.loads(out.strip().splitlines()[-1]) == hami_env


class TestDefaultInventoryInAPod:
    """No inventory configured: the default NVML inventory finds HAMi's variables by itself."""

    @pytest.fixture
    def jp_server_config(self, hami_env, monkeypatch):
        # The one call that asks the driver, faked: an 80 GiB GPU as NVML lists it.
        gpu = Device(
            index=0,
            name="NVIDIA A100-SXM4-80GB",
            uuid="GPU-5e1a0b2c-0000-4000-8000-000000000001",
            total=80 * GiB,
            nvml_index=0,
        )
        monkeypatch.setattr(devices_module, "read_nvml_devices", lambda: ([gpu], None))
        return Config(
            {
                "ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}},
                "GpuQuota": {"default_cap": "0.5", "nvml_class": "gpu_quota_ext.devices.fake_nvml.FakeNvml"},
            }
        )

    async def test_it_just_works_in_the_pod(self, jp_fetch, jp_serverapp):
        (device,) = (await status(jp_fetch))["devices"]
        assert (device["name"], device["total"]) == ("NVIDIA A100-SXM4-80GB (HAMi share)", SHARE)
        kernel_id = await start_kernel(jp_fetch)
        env = await kernel_env(jp_serverapp, kernel_id, ["GPU_QUOTA_DEVICES", "CUDA_VISIBLE_DEVICES"])
        assert json.loads(env["GPU_QUOTA_DEVICES"])[0]["cap"] == 10 * GiB
        assert env["CUDA_VISIBLE_DEVICES"] == "GPU-5e1a0b2c-0000-4000-8000-000000000001"


def test_a_hami_value_that_cannot_be_read_stops_the_server_naming_it(jp_configurable_serverapp, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MEMORY_LIMIT_0", "1.5g")
    with pytest.raises(SystemExit) as stopped:
        jp_configurable_serverapp(config=hami_config())
    message = str(stopped.value)
    assert (
        message.startswith("gpu-quota-ext: invalid configuration:") and "CUDA_DEVICE_MEMORY_LIMIT_0='1.5g'" in message
    )
