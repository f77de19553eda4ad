"""GPU inventories: which devices this server may place kernels on, and how big each is.

Two backends behind one small interface: NVML (the real machine) and a static list from config (tests,
demos on machines without a GPU). `CUDA_VISIBLE_DEVICES` of the server narrows what NVML reports, the
way CUDA itself would. Inside a pod that the cluster gave a share of its GPUs (HAMi, HAMi-DRA, KAI fractions,
NVIDIA's DRA driver with MPS: gpu_quota_ext.devices.pod_share decides which and reads it) a device's size is the
pod's share of it: NVML's inventory applies it by default, `HamiInventory` on any other. The pod's annotations,
which some ways need, come from the downward API file the hub's pod spec mounts (devices/downward.py).
"""

from __future__ import annotations

import logging
from typing import Any, List, Mapping, Optional, Tuple, Union

from traitlets import Bool, Type, Unicode
from traitlets import List as ListTrait
from traitlets.config import LoggingConfigurable

from ..shared.sizes import PolicyError, parse_cap, shown
from .device import Device, parse_cuda_visible_devices, select_visible
from .downward import ANNOTATIONS_FILE, parse_annotations
from .pod_share import read_share
from .share import describe_share, share_devices


class DeviceInventory(LoggingConfigurable):
    """The interface: `list_devices()` lists the GPUs this server may use; [] means "no GPU"."""

    def list_devices(self) -> List[Device]:
        raise NotImplementedError

    @property
    def problem(self) -> Optional[str]:
        """Why there are no devices, in one line, or None."""
        return None


class StaticInventory(DeviceInventory):
    """Devices written in config, for tests and GPU-less demos:

        c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"
        c.StaticInventory.devices = [{"name": "Demo GPU", "total": "80GiB"}, {"total": "80GiB"}]
    """

    devices = ListTrait(
        default_value=[],
        help="Devices of this static inventory: dicts with 'total' (bytes or '80GiB'), optional 'name', 'uuid'.",
    ).tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._devices = parse_static_devices(self.devices)

    def list_devices(self) -> List[Device]:
        return list(self._devices)

    @property
    def problem(self) -> Optional[str]:
        return None if self._devices else "no GPU: the static inventory lists no devices"


def parse_static_devices(entries: Any) -> List[Device]:  # as the admin's config wrote it
    if not isinstance(entries, (list, tuple)):
        raise PolicyError(f"c.StaticInventory.devices = {shown(entries)}: must be a list of dicts")
    devices = []
    first_with_uuid = {}
    for i, entry in enumerate(entries):
        where = f"c.StaticInventory.devices[{i}]"
        if not isinstance(entry, dict) or "total" not in entry:
            raise PolicyError(f"{where} = {shown(entry)}: must be a dict with 'total', e.g. {{'total': '80GiB'}}")
        try:
            spec = parse_cap(entry["total"])
        except PolicyError as error:
            raise PolicyError(f"{where}['total']: {error}") from None
        if spec.nbytes is None:
            raise PolicyError(
                f"{where}['total'] = {shown(entry['total'])}: a device's memory is a size, not a fraction"
            )
        # No "GPU-" prefix by default: a static device is named by index in CUDA_VISIBLE_DEVICES.
        uuid = str(entry.get("uuid", f"static-{i}"))
        # A UUID names one device: the monitor and CUDA_VISIBLE_DEVICES would mix up two that share one.
        if uuid in first_with_uuid:
            raise PolicyError(
                f"c.StaticInventory.devices[{first_with_uuid[uuid]}] and {where} have the same uuid {shown(uuid)}; "
                "each device needs its own"
            )
        first_with_uuid[uuid] = i
        devices.append(
            Device(index=i, name=str(entry.get("name", "Static GPU")), uuid=uuid, total=spec.nbytes, nvml_index=i)
        )
    return devices


def _annotations_trait() -> Unicode:
    return Unicode(
        ANNOTATIONS_FILE,
        help="""The pod's annotations as the downward API writes them (the hub's pod spec mounts them here:
        gpu_quota_ext.hub.kube). Read once, when present: KAI's fraction annotations and the hub's record of the
        pod's GPU claim are there. Empty: read no file.""",
    ).tag(config=True)


class NvmlInventory(DeviceInventory):
    """The machine's GPUs through NVML (nvidia-ml-py). No library, no driver: no devices, said once."""

    pod_share = Bool(
        True,
        help="""Inside a pod the cluster gave a share of its GPUs (HAMi's CUDA_DEVICE_MEMORY_LIMIT variables, a
        HAMi DRA claim, KAI's fraction annotations or NVIDIA_GPU_MEMORY_LIMITS, an NVIDIA DRA claim's MPS limit)
        each GPU's size is the pod's share: caps are fractions of it, admission splits it among the kernels, the
        sidebar and the status show it as the device's total with where it came from. False: the whole GPU as
        NVML reports it.""",
    ).tag(config=True)
    pod_annotations = _annotations_trait()

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._devices: Optional[List[Device]] = None
        self._problem: Optional[str] = None

    @property
    def problem(self) -> Optional[str]:
        self.list_devices()
        return self._problem

    def list_devices(self) -> List[Device]:
        # Device totals do not change while the server runs: read NVML once.
        if self._devices is None:
            found, self._problem = read_nvml_devices()
            visible = parse_cuda_visible_devices(_server_env("CUDA_VISIBLE_DEVICES"))
            self._devices = select_visible(found, visible)
            if self.pod_share and self._devices:
                annotations = read_pod_annotations(self.pod_annotations, self.log)
                self._devices = apply_pod_share(self._devices, _server_environ(), self.log, annotations=annotations)
            if self._problem:
                self.log.log(*no_gpu_line(self._problem))
            elif not self._devices:
                self._problem = "no GPU: CUDA_VISIBLE_DEVICES of the server hides every device"
                self.log.warning("gpu-quota-ext: %s", self._problem)
            else:
                self.log.info(
                    "gpu-quota-ext: %d GPU(s): %s",
                    len(self._devices),
                    ", ".join(f"{d.index}: {d.name} ({d.total} bytes)" for d in self._devices),
                )
        return list(self._devices)


def no_gpu_line(problem: str) -> Tuple[int, str]:
    """(level, line) the server logs when NVML lists no GPU. A machine without an NVIDIA driver at all (NVML's
    library is not there) is a fact, said once at INFO in plain words: a CPU machine is an ordinary place to
    run a server. A driver that is there and does not answer, or a missing nvidia-ml-py, is a warning."""
    if "LibraryNotFound" in problem:
        return logging.INFO, "gpu-quota-ext: no GPU on this machine (no NVIDIA driver): kernels start without GPU caps"
    return logging.WARNING, f"gpu-quota-ext: {problem}; kernels start without GPU caps"


def _server_env(name: str) -> Optional[str]:
    import os

    return os.environ.get(name)


def _server_environ() -> dict:
    import os

    return dict(os.environ)


def read_nvml_devices():
    """(devices, problem): every GPU NVML reports, or [] and one line saying why not."""
    try:
        import pynvml
    except ImportError:
        return [], "no GPU: nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return [], f"no GPU: NVML could not start ({error.__class__.__name__}: {error})"
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            devices.append(
                Device(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    total=int(total),
                    nvml_index=i,
                )
            )
        return devices, None
    except pynvml.NVMLError as error:
        return [], f"no GPU: NVML failed listing devices ({error})"


def read_pod_annotations(path: str, log: Union[logging.Logger, logging.LoggerAdapter]) -> Optional[dict]:
    """The downward API's annotations file at `path`, parsed; None when there is none (not in such a pod)."""
    import os

    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read(1024 * 1024)  # the API server caps a pod's annotations at 256 KiB
    except OSError as error:
        log.warning("gpu-quota-ext: could not read the pod's annotations at %s: %s", path, error)
        return None
    return parse_annotations(text)


def apply_pod_share(
    devices: List[Device],
    env: Mapping[str, str],
    log: Union[logging.Logger, logging.LoggerAdapter],
    *,
    expected: bool = False,
    annotations: Optional[Mapping[str, str]] = None,
) -> List[Device]:
    """`devices` with the pod's share (from `env` and the pod's `annotations`) as their totals, said in the log.

    Raises PolicyError naming the variable or annotation when a value cannot be read as its writer means it.
    """
    share, warning = read_share(env, annotations)
    if share is None:
        if warning:
            log.warning("gpu-quota-ext: %s", warning)
        elif expected:
            log.warning(
                "gpu-quota-ext: no CUDA_DEVICE_MEMORY_LIMIT variables in the server's environment (nor another "
                "pod share): each GPU's whole memory is the budget"
            )
        return devices
    shared, lines = share_devices(devices, share)
    log.info("gpu-quota-ext: %s; %s", describe_share(share), "; ".join(lines))
    if not share.enforced:
        log.warning(
            "gpu-quota-ext: %s: caps split the pod's share, but no driver-side limit holds the pod to it",
            share.off_reason or "the share is not enforced",
        )
    return shared


class HamiInventory(DeviceInventory):
    """The GPUs of a container with a pod share (HAMi, HAMi-DRA, KAI, NVIDIA DRA), from any inventory: each
    device's size is the pod's share.

        c.GpuQuota.inventory_class = "gpu_quota_ext.devices.HamiInventory"
        c.HamiInventory.physical_class = "gpu_quota_ext.devices.StaticInventory"   # or NVML (the default)

    NVML's own inventory already applies the share (NvmlInventory.pod_share): this class is for the
    other sources of devices, and for saying explicitly that this server runs under HAMi (a warning
    when the variables are missing).
    """

    physical_class = Type(
        default_value=NvmlInventory,
        klass=DeviceInventory,
        help="Where the physical GPUs come from: NVML (default) or gpu_quota_ext.devices.StaticInventory.",
    ).tag(config=True)
    pod_annotations = _annotations_trait()

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._physical = self.physical_class(parent=self)
        if isinstance(self._physical, NvmlInventory):
            self._physical.pod_share = False  # applied here, once
        self._devices: Optional[List[Device]] = None

    def list_devices(self) -> List[Device]:
        if self._devices is None:
            self._devices = apply_pod_share(
                self._physical.list_devices(),
                _server_environ(),
                self.log,
                expected=True,
                annotations=read_pod_annotations(self.pod_annotations, self.log),
            )
        return list(self._devices)

    @property
    def problem(self) -> Optional[str]:
        return self._physical.problem
