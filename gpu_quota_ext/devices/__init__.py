"""Devices: the Device type and CUDA_VISIBLE_DEVICES matching (device.py), the inventories that list a
server's GPUs (inventory.py: NVML, static, HAMi's pod share from hami.py), and NVML itself (nvml.py, with
the fake for tests beside it in fake_nvml.py).

    c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"
"""

from .device import Device, devices_named, find_device, parse_cuda_visible_devices, select_visible
from .fake_nvml import FakeNvml
from .inventory import DeviceInventory, HamiInventory, NvmlInventory, StaticInventory
from .nvml import NvmlBackend, NvmlFailure, NvmlUnavailable, PynvmlBackend

__all__ = [
    "Device", "devices_named", "find_device", "parse_cuda_visible_devices", "select_visible",
    "DeviceInventory", "HamiInventory", "NvmlInventory", "StaticInventory",
    "NvmlBackend", "NvmlFailure", "NvmlUnavailable", "PynvmlBackend", "FakeNvml",
]
