"""CUDA_VISIBLE_DEVICES parsing and the static inventory: pure."""

import pytest

from gpu_quota_ext.devices import Device, parse_cuda_visible_devices, parse_static_devices, select_visible
from gpu_quota_ext.policy import GiB, PolicyError

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


def test_cuda_id_prefers_uuid():
    assert FOUR[2].cuda_id == "GPU-2222-uuid"
    assert Device(0, "static", "static-0", GiB, 0).cuda_id == "0"


def test_static_devices():
    devices = parse_static_devices([{"name": "A", "total": "80GiB"}, {"total": 1 << 34, "uuid": "GPU-x"}])
    assert [(d.index, d.name, d.total, d.uuid) for d in devices] == [(0, "A", 80 * GiB, "static-0"), (1, "Static GPU", 1 << 34, "GPU-x")]
    for bad in ("80GiB", [{"name": "A"}], [{"total": "0.5"}], [{"total": "lots"}]):
        with pytest.raises(PolicyError, match="StaticInventory.devices"):
            parse_static_devices(bad)
