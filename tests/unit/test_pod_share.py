"""A pod's share of its GPUs, whichever way the cluster gave it: what the container holds -> the share -> each
device's total and where it came from (the status answer's `share`).

The inputs are faked as the cluster writes them: the kubelet's downward API annotations file (Go-quoted
`key="value"` lines), the variables HAMi's DRA driver writes through CDI, KAI's binder and kai-gpu-fractioning's
NRI plugin inject, NVIDIA's DRA driver's MPS pipe. No cluster and no GPU here: NVML is faked at the one function
that asks the driver (`read_nvml_devices`).
"""

import json
import logging

import pytest

from gpu_quota_ext.devices import Device, HamiInventory, NvmlInventory, StaticInventory
from gpu_quota_ext.devices import inventory as devices_module
from gpu_quota_ext.devices.downward import RECORD_ANNOTATION, parse_annotations, pod_record
from gpu_quota_ext.devices.kai import parse_quantity
from gpu_quota_ext.devices.pod_share import read_share
from gpu_quota_ext.devices.share import PodShare, share_devices
from gpu_quota_ext.shared import contract
from gpu_quota_ext.shared.sizes import GiB, MiB, PolicyError

H100 = 85_520_809_984  # bytes NVML reports for an H100 80GB


def record(**fields) -> dict:
    return {RECORD_ANNOTATION: json.dumps(fields)}


def physical(*totals):
    return [
        Device(index=i, name="NVIDIA H100", uuid=f"GPU-{i:08d}-bbbb", total=t, nvml_index=i)
        for i, t in enumerate(totals)
    ]


# --- the downward API file --------------------------------------------------------------------------------------


def test_the_annotations_file_is_read_as_the_kubelet_writes_it():
    text = (
        'gpu-fraction="0.25"\n'
        'gpu-quota-ext/pod-gpu="{\\"gpus\\":1,\\"way\\":\\"kai\\"}"\n'
        'kubernetes.io/config.seen="2026-12-04T10:00:00.000000000Z"\n'
        'odd="tab\\there \\u00e9 \\x41"\n'
        "not a line\n"
        'broken="\\q"\n'
    )
    found = parse_annotations(text)
    assert found["gpu-fraction"] == "0.25"
    assert pod_record(found) == {"gpus": 1, "way": "kai"}
    assert found["odd"] == "tab\there é A"
    assert "not a line" not in found and "broken" not in found


@pytest.mark.parametrize("value", ["{not json", "[1, 2]", '{"gpus": 1}', "x" * 5000])
def test_a_record_the_hub_does_not_write_is_no_record(value):
    assert pod_record({RECORD_ANNOTATION: value}) is None


# --- which way, from what the container holds --------------------------------------------------------------------


def test_hami_dra_is_told_by_its_cdi_variables():
    env = {
        "CUDA_DEVICE_MEMORY_LIMIT_0": "4096m",
        "CUDA_DEVICE_SM_LIMIT_0": "30",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/usr/local/vgpu/claims/9f2e/1.cache",
    }
    share, warning = read_share(env)
    assert (share.way, share.limit_for(0), share.sm_name, share.sm_limit) == (
        "hami-dra",
        4 * GiB,
        "CUDA_DEVICE_SM_LIMIT_0",
        "30",
    )
    assert share.enforced_by == "HAMi-core" and warning is None
    # The device plugin's variables alone: HAMi's device plugin.
    share, _ = read_share({"CUDA_DEVICE_MEMORY_LIMIT_0": "4096m", "CUDA_DEVICE_SM_LIMIT": "30"})
    assert share.way == "hami"


def test_kai_with_its_hami_core_plugin_is_kai_enforced_by_hami_core():
    annotations = {"gpu-memory": "4096", **record(way="kai", gpus=1, gpu_memory="4096Mi")}
    share, _ = read_share({"CUDA_DEVICE_MEMORY_LIMIT": "4147m", "GPU_PORTION": "0.27"}, annotations)
    # What HAMi-core holds the container to (KAI's portion x the node's GPU memory), not the annotation's ask.
    assert (share.way, share.limit_for(0), share.enforced_by) == (
        "kai",
        4147 * MiB,
        "HAMi-core (KAI-resource-isolator)",
    )


def test_kai_fractioning_is_enforced_by_the_driver_and_ends_the_container_at_its_limit():
    share, _ = read_share({"NVIDIA_GPU_MEMORY_LIMITS": "8192", "CUDA_MPS_PIPE_DIRECTORY": "/run/mps"})
    assert (share.way, share.every_device, share.enforced) == ("kai", 8 * GiB, True)
    assert "ended" in share.at_limit
    with pytest.raises(PolicyError, match="NVIDIA_GPU_MEMORY_LIMITS='8Gi'"):
        read_share({"NVIDIA_GPU_MEMORY_LIMITS": "8Gi"})


@pytest.mark.parametrize(
    "annotations, env, total, source",
    [
        (
            {"nvidia.com/container.notebook.gpu-memory.limit": "6Gi", "gpu-memory": "9999"},
            {},
            6 * GiB,
            "annotation nvidia.com/container.notebook.gpu-memory.limit=6Gi",
        ),
        ({"gpu-memory": "10240"}, {}, 10 * GiB, "annotation gpu-memory=10240"),
        ({"gpu-fraction": "0.5"}, {"GPU_PORTION": "0.75"}, H100 // 2 // MiB * MiB, "annotation gpu-fraction=0.5"),
        ({}, {"GPU_PORTION": "0.25"}, H100 // 4 // MiB * MiB, "GPU_PORTION=0.25"),
    ],
)
def test_kai_alone_schedules_a_share_nothing_enforces(annotations, env, total, source):
    share, warning = read_share(env, annotations)
    (device,), _ = share_devices(physical(H100), share)
    assert (device.total, device.share.source, device.share.enforced_by) == (total, source, None)
    assert device.name == "NVIDIA H100 (KAI share)" and not share.enforced and warning is None


def test_a_whole_gpu_under_kai_is_no_share():
    assert read_share({"GPU_PORTION": "1"}) == (None, None)


@pytest.mark.parametrize(
    "annotations, words",
    [
        ({"gpu-memory": "4Gi"}, "gpu-memory='4Gi'"),
        ({"gpu-fraction": "1.5"}, "gpu-fraction='1.5'"),
        ({"gpu-fraction": "half"}, "gpu-fraction='half'"),
        ({"nvidia.com/container.notebook.gpu-memory.limit": "0.5Gi"}, "gpu-memory.limit='0.5Gi'"),
    ],
)
def test_a_kai_value_that_cannot_be_read_is_refused_naming_it(annotations, words):
    with pytest.raises(PolicyError, match=words.replace(".", r"\.")):
        read_share({}, annotations)


def test_quantities_as_kubernetes_writes_them():
    assert [parse_quantity(text, "x") for text in ("8Gi", "8192Mi", "1G", str(2 * MiB))] == [
        8 * GiB,
        8 * GiB,
        10**9,
        2 * MiB,
    ]


def test_nvidia_dra_is_each_processs_mps_limit_from_the_hubs_record():
    annotations = record(way="nvidia-dra", gpus=2, gpu_memory="10240Mi", claim="gpu-quota-nvidia-dra-0a1b2c3d4e5f")
    share, _ = read_share({"CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps"}, annotations)
    shared, _ = share_devices(physical(H100, H100), share)
    assert [d.total for d in shared] == [10 * GiB, 10 * GiB]
    assert shared[0].share.to_json() == {
        "way": "nvidia-dra",
        "bytes": 10 * GiB,
        "source": "the MPS limit of gpu-quota-nvidia-dra-0a1b2c3d4e5f (10240Mi), from annotation gpu-quota-ext/pod-gpu",
        "enforced_by": "MPS (the claim's control daemon, per process)",
        "scope": "process",
    }
    # Whole GPUs (no memory in the claim): no share, no warning.
    assert read_share({}, record(way="nvidia-dra", gpus=1)) == (None, None)


def test_what_the_hub_asked_and_the_container_lacks_is_one_warning():
    share, warning = read_share({}, record(way="hami", gpus=1, gpu_memory="10240Mi"))
    assert share is None
    assert warning == (
        "the hub asked HAMi for gpu_memory 10240Mi but this container shows no CUDA_DEVICE_MEMORY_LIMIT variables "
        "(HAMi's device plugin sets them): each GPU's whole memory is the budget"
    )
    assert read_share({}) == (None, None)  # not in such a pod: nothing to say


def test_the_status_share_has_exactly_the_contracts_fields():
    share = PodShare(every_device=GiB, fallback_source="x")
    (device,), _ = share_devices(physical(H100), share)
    assert tuple(device.share.to_json()) == contract.DEVICE_SHARE_FIELDS


# --- the inventories, reading the file ----------------------------------------------------------------------------


@pytest.fixture
def fake_driver(monkeypatch):
    """One H100 as NVML would list it; the server's environment without any pod-share variable."""
    for name in list(__import__("os").environ):
        if name.startswith(("CUDA_DEVICE_", "NVIDIA_GPU_MEMORY", "CUDA_MPS_")) or name in (
            "CUDA_VISIBLE_DEVICES",
            "CUDA_DISABLE_CONTROL",
            "GPU_PORTION",
        ):
            monkeypatch.delenv(name)
    monkeypatch.setattr(devices_module, "read_nvml_devices", lambda: (physical(H100), None))


def kubelet_file(tmp_path, annotations: dict):
    path = tmp_path / "annotations"
    path.write_text("".join(f"{key}={json.dumps(value)}\n" for key, value in sorted(annotations.items())))
    return str(path)


def test_nvml_inventory_reads_kai_annotations_from_the_file(fake_driver, tmp_path, caplog):
    path = kubelet_file(tmp_path, {"gpu-memory": "20480", **record(way="kai", gpus=1, gpu_memory="20480Mi")})
    with caplog.at_level(logging.INFO):
        (device,) = NvmlInventory(pod_annotations=path).list_devices()
    assert (device.total, device.share.way) == (20 * GiB, "kai")
    assert "KAI pod share" in caplog.text and "no driver-side limit holds the pod to it" in caplog.text


def test_no_file_no_share_and_an_unreadable_one_is_said(fake_driver, tmp_path, caplog):
    assert NvmlInventory(pod_annotations=str(tmp_path / "absent")).list_devices() == physical(H100)
    folder = tmp_path / "a-folder"
    folder.mkdir()
    assert NvmlInventory(pod_annotations=str(folder)).list_devices() == physical(H100)


def test_hami_inventory_says_what_the_hub_asked_and_did_not_get(fake_driver, tmp_path, caplog):
    from traitlets.config import Config

    path = kubelet_file(tmp_path, record(way="hami-dra", gpus=1, gpu_memory="8192Mi", claim="gpu-quota-hami-dra-1"))
    config = Config(
        {
            "HamiInventory": {"physical_class": StaticInventory, "pod_annotations": path},
            "StaticInventory": {"devices": [{"total": "80GiB"}]},
        }
    )
    with caplog.at_level(logging.INFO):
        (device,) = HamiInventory(config=config).list_devices()
    assert device.total == 80 * GiB and device.share is None
    assert "the hub asked HAMi-DRA for gpu_memory 8192Mi" in caplog.text
