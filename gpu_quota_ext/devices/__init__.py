"""Devices: the Device type and CUDA_VISIBLE_DEVICES matching (device.py), the inventories that list a
server's GPUs (inventory.py: NVML, static, a pod's share of its GPUs: pod_share.py picks the reader, hami.py,
kai.py or nvidia_dra.py, with the pod's annotations from downward.py, and share.py holds what they return),
and NVML itself (nvml.py, with the fake for tests beside it in fake_nvml.py).

    c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"
"""

from .device import Device, devices_named, find_device, parse_cuda_visible_devices, select_visible
from .downward import ANNOTATIONS_ITEM, POD_INFO_DIR, RECORD_ANNOTATION
from .fake_nvml import FakeNvml
from .inventory import DeviceInventory, HamiInventory, NvmlInventory, StaticInventory
from .nvml import NvmlBackend, NvmlFailure, NvmlUnavailable, PynvmlBackend
from .share import WAYS, DeviceShare, PodShare

__all__ = [
    "Device", "devices_named", "find_device", "parse_cuda_visible_devices", "select_visible",
    "DeviceInventory", "HamiInventory", "NvmlInventory", "StaticInventory",
    "NvmlBackend", "NvmlFailure", "NvmlUnavailable", "PynvmlBackend", "FakeNvml",
    "ANNOTATIONS_ITEM", "POD_INFO_DIR", "RECORD_ANNOTATION", "WAYS", "DeviceShare", "PodShare",
]
