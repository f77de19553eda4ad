"""A HAMi-limited container: its environment -> the pod's share -> each device's total (the budget).

The variables are the ones HAMi's device plugin writes (CUDA_DEVICE_MEMORY_LIMIT_<i>="<MiB>m", ...);
no HAMi runs here. NVML is faked at the one function that asks the driver (`read_nvml_devices`),
since this machine has no GPU.
"""

import logging

import pytest

from gpu_quota_ext.devices import Device, HamiInventory, NvmlInventory, StaticInventory
from gpu_quota_ext.devices import inventory as devices_module
from gpu_quota_ext.devices.hami import parse_hami_size, read_pod_share, share_devices
from gpu_quota_ext.shared.sizes import GiB, KiB, MiB, PolicyError

H200 = 143_771_287_552  # bytes NVML reports for an H200 (141 GiB class)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("20480m", 20 * GiB),
        ("20480M", 20 * GiB),
        ("20g", 20 * GiB),
        ("20971520k", 20 * GiB),
        ("21474836480", 20 * GiB),
        (" 3000m ", 3000 * MiB),
        ("0", 0),  # HAMi-core: no limit
    ],
)
def test_hami_sizes_read_as_hami_core_reads_them(text, expected):
    assert parse_hami_size(text, "CUDA_DEVICE_MEMORY_LIMIT_0") == expected


@pytest.mark.parametrize("text", ["1.5g", "abc", "-1", "0x10m", "20 GiB", "20GB", "", "512k", "1e9"])
def test_sizes_hami_core_would_read_differently_are_refused_naming_the_variable(text):
    with pytest.raises(PolicyError) as refused:
        parse_hami_size(text, "CUDA_DEVICE_MEMORY_LIMIT_0")
    assert f"CUDA_DEVICE_MEMORY_LIMIT_0={text!r}" in str(refused.value)


def test_no_hami_variables_no_share():
    assert read_pod_share({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"}) is None
    assert read_pod_share({"CUDA_DEVICE_MEMORY_LIMIT_0": "0"}) is None  # 0: HAMi-core sets no limit


def test_per_device_limits_fall_back_to_the_plain_variable_like_hami_core():
    share = read_pod_share(
        {
            "CUDA_DEVICE_MEMORY_LIMIT": "8g",
            "CUDA_DEVICE_MEMORY_LIMIT_0": "20480m",
            "CUDA_DEVICE_MEMORY_LIMIT_1": "0",  # 0 on one device: the plain variable applies there
            "CUDA_DEVICE_MEMORY_LIMIT_16": "1g",  # HAMi-core keeps 16 devices: not its variable
            "CUDA_DEVICE_MEMORY_LIMIT_X": "1g",
            "CUDA_DEVICE_SM_LIMIT": "30",
        }
    )
    assert (share.limit_for(0), share.limit_for(1), share.limit_for(2)) == (20 * GiB, 8 * GiB, 8 * GiB)
    assert share.source_for(0) == "CUDA_DEVICE_MEMORY_LIMIT_0=20480m"
    assert share.source_for(1) == "CUDA_DEVICE_MEMORY_LIMIT=8g"
    assert share.sm_limit == "30" and share.enforced


def test_disabled_control_is_read_as_not_enforced():
    share = read_pod_share({"CUDA_DEVICE_MEMORY_LIMIT_0": "1024m", "CUDA_DISABLE_CONTROL": "true"})
    assert share.limit_for(0) == GiB and not share.enforced


def test_a_bad_limit_anywhere_is_refused():
    with pytest.raises(PolicyError, match="CUDA_DEVICE_MEMORY_LIMIT_1='lots'"):
        read_pod_share({"CUDA_DEVICE_MEMORY_LIMIT_0": "1024m", "CUDA_DEVICE_MEMORY_LIMIT_1": "lots"})


def physical(*totals):
    return [
        Device(index=i, name="NVIDIA H200", uuid=f"GPU-{i:08d}-aaaa", total=t, nvml_index=i)
        for i, t in enumerate(totals)
    ]


def test_share_becomes_each_devices_total_and_says_so():
    share = read_pod_share({"CUDA_DEVICE_MEMORY_LIMIT_0": "20480m", "CUDA_DEVICE_MEMORY_LIMIT_1": "10240m"})
    shared, lines = share_devices(physical(H200, H200), share)
    assert [d.total for d in shared] == [20 * GiB, 10 * GiB]
    assert all(d.name == "NVIDIA H200 (HAMi share)" for d in shared)
    # Identity stays: kernels are still placed on the same GPU by UUID.
    assert [(d.index, d.uuid, d.nvml_index) for d in shared] == [
        (d.index, d.uuid, d.nvml_index) for d in physical(H200, H200)
    ]
    assert "budget 20.0 GiB from CUDA_DEVICE_MEMORY_LIMIT_0=20480m" in lines[0]
    assert "the GPU has 133.9 GiB" in lines[0]


def test_nvml_already_showing_the_share_or_a_smaller_gpu_gives_the_smaller():
    share = read_pod_share({"CUDA_DEVICE_MEMORY_LIMIT": "20g"})
    # HAMi-core in the server's process: NVML's total is already the limit.
    shared, lines = share_devices(physical(20 * GiB), share)
    assert shared[0].total == 20 * GiB and "already reports the share" in lines[0]
    # A limit above the GPU (HAMi's memory oversubscription): no more than the GPU has.
    shared, lines = share_devices(physical(16 * GiB), share)
    assert shared[0].total == 16 * GiB and "only 16.0 GiB" in lines[0]


def test_sharing_twice_changes_nothing():
    share = read_pod_share({"CUDA_DEVICE_MEMORY_LIMIT_0": "20480m"})
    once, _ = share_devices(physical(H200), share)
    twice, _ = share_devices(once, share)
    assert twice == once


def test_a_device_without_a_limit_keeps_its_whole_memory():
    share = read_pod_share({"CUDA_DEVICE_MEMORY_LIMIT_0": "20480m"})
    shared, lines = share_devices(physical(H200, H200), share)
    assert shared[1] == physical(H200, H200)[1]
    assert "no HAMi limit" in lines[1]


@pytest.fixture
def fake_driver(monkeypatch):
    """One H200 as NVML would list it; the server's environment without any HAMi variable."""
    for name in list(__import__("os").environ):
        if name.startswith("CUDA_DEVICE_") or name in ("CUDA_VISIBLE_DEVICES", "CUDA_DISABLE_CONTROL"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(devices_module, "read_nvml_devices", lambda: (physical(H200), None))


def test_the_default_nvml_inventory_applies_the_pods_share(fake_driver, monkeypatch, caplog):
    monkeypatch.setenv("CUDA_DEVICE_MEMORY_LIMIT_0", "20480m")
    monkeypatch.setenv("CUDA_DEVICE_SM_LIMIT", "50")
    with caplog.at_level(logging.INFO):
        (device,) = NvmlInventory().list_devices()
    assert device.total == 20 * GiB and device.name == "NVIDIA H200 (HAMi share)"
    said = caplog.text
    assert "HAMi pod share, CUDA_DEVICE_SM_LIMIT=50: HAMi-core enforces the pod's total" in said
    assert "CUDA_DEVICE_MEMORY_LIMIT_0=20480m" in said


def test_the_share_can_be_turned_off(fake_driver, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MEMORY_LIMIT_0", "20480m")
    (device,) = NvmlInventory(pod_share=False).list_devices()
    assert device.total == H200 and device.name == "NVIDIA H200"


def test_without_hami_nothing_changes(fake_driver):
    assert NvmlInventory().list_devices() == physical(H200)


def test_a_bad_hami_value_fails_the_inventory_with_its_name(fake_driver, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MEMORY_LIMIT_0", "1.5g")
    with pytest.raises(PolicyError, match="CUDA_DEVICE_MEMORY_LIMIT_0='1.5g'"):
        NvmlInventory().list_devices()


def test_disabled_control_warns_that_nothing_below_enforces_the_total(fake_driver, monkeypatch, caplog):
    monkeypatch.setenv("CUDA_DEVICE_MEMORY_LIMIT_0", "20480m")
    monkeypatch.setenv("CUDA_DISABLE_CONTROL", "true")
    with caplog.at_level(logging.INFO):
        (device,) = NvmlInventory().list_devices()
    assert device.total == 20 * GiB  # the pod was scheduled for its share: the budget stays the share
    assert "no driver-side limit holds the pod to it" in caplog.text


def test_hami_inventory_over_a_static_list(fake_driver, monkeypatch):
    from traitlets.config import Config

    monkeypatch.setenv("CUDA_DEVICE_MEMORY_LIMIT", "30000m")
    config = Config(
        {"HamiInventory": {"physical_class": StaticInventory}, "StaticInventory": {"devices": [{"total": "80GiB"}]}}
    )
    (device,) = HamiInventory(config=config).list_devices()
    assert device.total == 30000 * MiB and device.name == "Static GPU (HAMi share)"


def test_hami_inventory_over_nvml_applies_the_share_once(fake_driver, monkeypatch, caplog):
    monkeypatch.setenv("CUDA_DEVICE_MEMORY_LIMIT_0", "20480m")
    with caplog.at_level(logging.INFO):
        (device,) = HamiInventory().list_devices()
    assert device.name == "NVIDIA H200 (HAMi share)" and device.total == 20 * GiB
    assert caplog.text.count("HAMi pod share") == 1


def test_hami_inventory_without_the_variables_warns_and_budgets_the_whole_gpu(fake_driver, caplog):
    with caplog.at_level(logging.INFO):
        (device,) = HamiInventory().list_devices()
    assert device.total == H200
    assert "no CUDA_DEVICE_MEMORY_LIMIT variables" in caplog.text


def test_kib_and_bytes_below_a_mib_are_refused():
    with pytest.raises(PolicyError, match="less than 1 MiB"):
        parse_hami_size(str(512 * KiB), "CUDA_DEVICE_MEMORY_LIMIT")
