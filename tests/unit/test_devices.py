"""CUDA_VISIBLE_DEVICES parsing and the static inventory: pure."""

import pytest

from gpu_quota_ext.devices import Device, devices_named, parse_cuda_visible_devices, select_visible
from gpu_quota_ext.devices.inventory import parse_static_devices
from gpu_quota_ext.shared.sizes import GiB, PolicyError

FOUR = [Device(i, "H200", f"GPU-{i}{i}{i}{i}-uuid", 140 * GiB, i) for i in range(4)]


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        ("", []),
        ("0,2", ["0", "2"]),
        (" 1 , 3 ", ["1", "3"]),
        ("0,-1,2", ["0"]),
        ("-1", []),
        ("GPU-2222,1", ["GPU-2222", "1"]),
        ("MIG-abcd", ["MIG-abcd"]),
        ("0,,1", ["0"]),
        ("nonsense", []),
    ],
)
def test_parse_cuda_visible_devices(value, expected):
    assert parse_cuda_visible_devices(value) == expected


def test_select_visible_keeps_cuda_order_and_reindexes():
    chosen = select_visible(FOUR, ["3", "GPU-1111"])
    assert [(d.index, d.nvml_index) for d in chosen] == [(0, 3), (1, 1)]
    assert select_visible(FOUR, None) == FOUR
    assert select_visible(FOUR, []) == []
    assert [d.nvml_index for d in select_visible(FOUR, ["2", "7", "1"])] == [2]  # 7 names nothing: CUDA stops
    assert select_visible(FOUR, ["GPU-"]) == []  # ambiguous prefix


def test_devices_named_keeps_the_devices_as_they_are_in_cuda_order_once_each():
    # What a kernelspec's own CUDA_VISIBLE_DEVICES pins, in the server's indexes (the manager's placement).
    assert [d.index for d in devices_named(FOUR, ["3", "GPU-1111", "3", "1"])] == [3, 1]
    assert [d.index for d in devices_named(FOUR, ["2", "7", "1"])] == [2]  # 7 names nothing: CUDA stops
    assert devices_named(FOUR, ["GPU-", "1"]) == []  # an ambiguous prefix names none, and ends the list
    assert devices_named(FOUR, []) == []


def test_cuda_id_prefers_uuid():
    assert FOUR[2].cuda_id == "GPU-2222-uuid"
    assert Device(0, "static", "static-0", GiB, 0).cuda_id == "0"


def test_static_devices():
    devices = parse_static_devices([{"name": "A", "total": "80GiB"}, {"total": 1 << 34, "uuid": "GPU-x"}])
    assert [(d.index, d.name, d.total, d.uuid) for d in devices] == [
        (0, "A", 80 * GiB, "static-0"),
        (1, "Static GPU", 1 << 34, "GPU-x"),
    ]
    for bad in ("80GiB", [{"name": "A"}], [{"total": "0.5"}], [{"total": "lots"}]):
        with pytest.raises(PolicyError, match="StaticInventory.devices"):
            parse_static_devices(bad)


def test_static_devices_with_the_same_uuid_are_refused_naming_both():
    # Issue 10, item 13: two entries that claim one device would be granted and watched as two.
    entries = [
        {"total": "16GiB", "uuid": "GPU-x"},
        {"total": "16GiB", "uuid": "GPU-y"},
        {"total": "16GiB", "uuid": "GPU-x"},
    ]
    with pytest.raises(
        PolicyError,
        match=r"c.StaticInventory.devices\[0\] and c.StaticInventory.devices\[2\] have the same uuid 'GPU-x'",
    ):
        parse_static_devices(entries)
    # An explicit uuid can clash with a default one too.
    with pytest.raises(
        PolicyError, match=r"devices\[0\] and c.StaticInventory.devices\[1\] have the same uuid 'static-0'"
    ):
        parse_static_devices([{"total": "16GiB"}, {"total": "16GiB", "uuid": "static-0"}])
    # Same names are fine: only the uuid identifies a device.
    assert len(parse_static_devices([{"total": "16GiB", "name": "A"}, {"total": "16GiB", "name": "A"}])) == 2


def test_a_huge_static_entry_is_echoed_short():
    with pytest.raises(PolicyError) as error:
        parse_static_devices([{"total": "1" * 1_000_000 + "x"}])
    assert len(str(error.value)) < 250


def test_no_driver_is_a_plain_fact_and_a_driver_that_fails_a_warning():
    import logging

    from gpu_quota_ext.devices.inventory import no_gpu_line

    level, line = no_gpu_line("no GPU: NVML could not start (NVMLError_LibraryNotFound: NVML Shared Library Not Found)")
    assert level == logging.INFO and "NVML" not in line and "no GPU on this machine (no NVIDIA driver)" in line
    level, line = no_gpu_line("no GPU: NVML could not start (NVMLError_DriverNotLoaded: Driver Not Loaded)")
    assert level == logging.WARNING and "DriverNotLoaded" in line
