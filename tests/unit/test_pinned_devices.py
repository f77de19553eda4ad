"""A kernelspec that pins CUDA_VISIBLE_DEVICES (by NVML index or UUID prefix) is placed only among those
devices: through GpuQuotaManager.admit, the launch hook's entry, with a server that sees only part of
the machine (so its device indexes and the NVML indexes differ)."""

import asyncio

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.ledger.local import LocalLedger
from gpu_quota_ext.manager import GpuQuotaManager
from gpu_quota_ext.policy import build_policy
from gpu_quota_ext.shared.sizes import GiB

# The server runs with CUDA_VISIBLE_DEVICES=2,3 on a four-GPU machine: its devices 0 and 1 are NVML's 2 and 3.
SERVER_VISIBLE = "2,3"
DEVICES = [
    Device(0, "H200", "GPU-2222aaaa-uuid", 140 * GiB, nvml_index=2),
    Device(1, "H200", "GPU-3333bbbb-uuid", 140 * GiB, nvml_index=3),
]
ARGV = ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"]


@pytest.fixture(autouse=True)
def server_visible(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", SERVER_VISIBLE)


def manager(on_full="cpu-only"):
    policy = build_policy("0.25", "0.5", on_full=on_full)
    # No kernel manager: admission is all these tests ask of it (the monitor is never started).
    return GpuQuotaManager(policy, DEVICES, LocalLedger(DEVICES, policy), None, FakeNvml(), user="u")


def admit(service, kernel_id, env):
    return asyncio.run(service.admit(kernel_id, "pinned", ARGV, env, language="python"))


@pytest.mark.parametrize(
    "pin, device",
    [
        ("3", 1),  # NVML index 3 is the server's device 1
        ("2", 0),
        ("GPU-3333bbbb-uuid", 1),  # a whole UUID
        ("GPU-2222", 0),  # a UUID prefix, as CUDA allows
        ("3,-1,2", 1),  # CUDA stops at the first invalid entry: only 3 is pinned
    ],
)
def test_every_kernel_of_a_pinned_kernelspec_lands_on_its_device(pin, device):
    service = manager()
    # Spread would alternate between the two devices: the pin keeps all four kernels on one.
    for number in range(4):
        env = admit(service, f"k{number}", {"CUDA_VISIBLE_DEVICES": pin})
        grant = service.ledger.get(f"k{number}")
        assert grant.devices == (device,) and grant.placed
        assert env["CUDA_VISIBLE_DEVICES"] == DEVICES[device].uuid


def test_a_pin_on_both_devices_places_among_them():
    service = manager()
    placed = [
        admit(service, f"k{n}", {"CUDA_VISIBLE_DEVICES": "GPU-3333,2"}) and service.ledger.get(f"k{n}").devices
        for n in range(4)
    ]
    assert sorted(placed) == [(0,), (0,), (1,), (1,)]


def test_the_servers_own_visible_devices_are_no_pin():
    # A kernelspec env that repeats the server's variable (jupyter copies it) places anywhere: spread.
    service = manager()
    placed = [
        admit(service, f"k{n}", {"CUDA_VISIBLE_DEVICES": SERVER_VISIBLE}) and service.ledger.get(f"k{n}").devices
        for n in range(2)
    ]
    assert placed == [(0,), (1,)]


@pytest.mark.parametrize("pin", ["1", "GPU-9999", "-1", ""])
def test_a_pin_on_no_device_of_this_server_is_handled_as_full(pin):
    # NVML 1 exists but this server does not manage it; "-1" and "" hide every GPU from the kernel.
    service = manager()
    admit(service, "k", {"CUDA_VISIBLE_DEVICES": pin})
    grant = service.ledger.get("k")
    assert grant.devices == () and "does not manage" in grant.cpu_only_reason
    assert [d["granted"] for d in service.ledger.device_grants()] == [0, 0]
