"""Issue 33, the pod side: a real jupyter_server and real kernels inside a pod that KAI or NVIDIA's DRA driver gave
part of a GPU, and the status saying where the pod's share came from.

Simulated: no cluster runs here. The test writes the pod's annotations file as the kubelet writes it through the
downward API volume the hub's pod spec mounts (Go-quoted `key="value"` lines), and sets the variables the
cluster's node parts would set (CUDA_MPS_PIPE_DIRECTORY from NVIDIA's DRA driver); the physical GPU is a static
80 GiB device. What is checked is what the extension does with them: the share is each device's total, caps are
fractions of it, and the status answer's device says where it came from and who enforces it.
"""

import json

import pytest
from traitlets.config import Config

from gpu_quota_ext.shared.sizes import GiB

from .kernels import kernel_env, start_kernel, static_devices_config


def kubelet_file(path, annotations: dict) -> str:
    path.write_text("".join(f"{key}={json.dumps(value)}\n" for key, value in sorted(annotations.items())))
    return str(path)


def pod_config(annotations_file: str, **gpu_quota) -> Config:
    config = static_devices_config("80GiB", **gpu_quota)
    config["GpuQuota"]["inventory_class"] = "gpu_quota_ext.devices.HamiInventory"
    config["HamiInventory"] = {
        "physical_class": "gpu_quota_ext.devices.StaticInventory",
        "pod_annotations": annotations_file,
    }
    return Config(config)


async def status(jp_fetch) -> dict:
    return json.loads((await jp_fetch("api", "gpu-quota", "status")).body)


@pytest.fixture
def no_pod_variables(monkeypatch):
    for name in (
        "CUDA_DEVICE_MEMORY_LIMIT",
        "CUDA_DEVICE_MEMORY_LIMIT_0",
        "NVIDIA_GPU_MEMORY_LIMITS",
        "GPU_PORTION",
        "CUDA_MPS_PIPE_DIRECTORY",
    ):
        monkeypatch.delenv(name, raising=False)


class TestKaiFraction:
    @pytest.fixture
    def jp_server_config(self, tmp_path, no_pod_variables):
        # What the hub's kai way writes for gpu_memory "20GiB" (tests/hub/test_kube_ways.py builds it).
        record = {"way": "kai", "container": "notebook", "gpus": 1, "gpu_memory": "20480Mi"}
        path = kubelet_file(
            tmp_path / "annotations",
            {
                "gpu-memory": "20480",
                "gpu-fraction-container-name": "notebook",
                "gpu-quota-ext/pod-gpu": json.dumps(record),
                "kubernetes.io/config.source": "api",
            },
        )
        return pod_config(path, default_cap="0.25", max_cap="0.5", overcommit=1.0, on_full="refuse")

    async def test_caps_split_the_fraction_and_the_status_says_nothing_enforces_it(self, jp_fetch, jp_serverapp):
        (device,) = (await status(jp_fetch))["devices"]
        assert (device["name"], device["total"], device["budget"]) == ("Test GPU 0 (KAI share)", 20 * GiB, 20 * GiB)
        assert device["share"] == {
            "way": "kai",
            "bytes": 20 * GiB,
            "source": "annotation gpu-memory=20480",
            "enforced_by": None,
            "scope": "pod",
        }
        kernel_id = await start_kernel(jp_fetch)
        env = await kernel_env(jp_serverapp, kernel_id, ["GPU_QUOTA_DEVICES"])
        (granted,) = json.loads(env["GPU_QUOTA_DEVICES"])
        assert (granted["cap"], granted["total"]) == (5 * GiB, 20 * GiB)  # a quarter of the pod's 20 GiB


class TestNvidiaDraClaim:
    @pytest.fixture
    def jp_server_config(self, tmp_path, no_pod_variables, monkeypatch):
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")  # the driver's CDI edit for an MPS claim
        record = {
            "way": "nvidia-dra",
            "container": "notebook",
            "gpus": 1,
            "gpu_memory": "16384Mi",
            "claim": "gpu-quota-nvidia-dra-5d1c0e2a9b7f",
        }
        path = kubelet_file(tmp_path / "annotations", {"gpu-quota-ext/pod-gpu": json.dumps(record)})
        return pod_config(path, default_cap="0.5", max_cap="1.0")

    async def test_the_claims_mps_limit_is_the_budget_held_per_process(self, jp_fetch, jp_serverapp):
        (device,) = (await status(jp_fetch))["devices"]
        assert (device["total"], device["name"]) == (16 * GiB, "Test GPU 0 (NVIDIA DRA share)")
        share = device["share"]
        assert (share["way"], share["scope"], share["enforced_by"]) == (
            "nvidia-dra",
            "process",
            "MPS (the claim's control daemon, per process)",
        )
        assert "gpu-quota-nvidia-dra-5d1c0e2a9b7f" in share["source"]
        kernel_id = await start_kernel(jp_fetch)
        env = await kernel_env(jp_serverapp, kernel_id, ["GPU_QUOTA_DEVICES", "CUDA_MPS_PIPE_DIRECTORY"])
        assert json.loads(env["GPU_QUOTA_DEVICES"])[0]["cap"] == 8 * GiB
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"  # kernels stay clients of the claim's MPS
