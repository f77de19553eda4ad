"""The DRA ways: a pod's GPU as a ResourceClaimTemplate (resource.k8s.io/v1, served from Kubernetes 1.34) that
the pod's `spec.resourceClaims` names and the notebook container's `resources.claims` uses.

Pure: the settled GPU in, the API's JSON out.

Two drivers, each with the device class and the request fields it reads:
- `hami-dra`: HAMi's DRA driver (Project-HAMi/k8s-dra-driver, installed by HAMi-DRA: Project-HAMi/HAMi-DRA).
  DeviceClass `hami-core-gpu.project-hami.io`; each device publishes the consumable capacities `memory` (bytes,
  1 MiB steps) and `cores` (0 to 100), and allows several allocations: the claim's
  `exactly.capacity.requests` {memory, cores} is the pod's share of each GPU, which the driver turns into
  HAMi-core's CUDA_DEVICE_MEMORY_LIMIT_<i> and CUDA_DEVICE_SM_LIMIT_<i> through CDI. A capacity a claim does
  not ask for is consumed whole (its request policy's default): a memory share without `gpu_cores` asks for
  `cores: 0`, HAMi's own default (no compute reserved, no SM limit), so that the GPU stays shareable. Needs
  the scheduler's DRAConsumableCapacity feature (alpha in 1.34 and 1.35, beta from 1.36). With several GPUs, a
  `distinctAttribute` constraint on the device's uuid keeps them distinct GPUs (a device that allows several
  allocations could otherwise serve the same request twice). HAMi-DRA's webhook writes the same claim from
  `nvidia.com/gpu`/`gpumem`/`gpucores` limits; this pod carries none, so the webhook leaves it alone.
- `nvidia-dra`: NVIDIA's DRA driver for GPUs (kubernetes-sigs/dra-driver-nvidia-gpu). DeviceClass
  `gpu.nvidia.com`; a device is allocated whole, to one claim. A memory figure becomes the claim's opaque
  `GpuConfig` (apiVersion resource.nvidia.com/v1beta1) with `sharing.strategy: MPS` and
  `mpsConfig.defaultPinnedDeviceMemoryLimit` (cores: `defaultActiveThreadPercentage`): an MPS control daemon
  for this claim holds each process to it (the driver's MPSSupport feature gate, alpha, off by default).
GPU models (`gpu_type`) become a CEL selector on the device's `productName`, matched as HAMi matches
`nvidia.com/use-gputype`: the model's name contained in the device's, case aside.

The template's name is its content's hash: one template per distinct claim, shared by every pod that makes
that claim, never changed under a running pod (Kubernetes makes one ResourceClaim per pod from it, and
deletes that claim with the pod).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ...shared.sizes import PolicyError
from .hami import SettledGpu
from .keys import HAMI_DRA, NVIDIA_DRA

API_VERSION = "resource.k8s.io/v1"
POD_CLAIM = "gpu-quota"  # the claim's name in the pod (spec.resourceClaims[].name)
REQUEST = "gpu"  # the request's name inside the claim
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpu-quota-ext"}
NVIDIA_CONFIG_API = "resource.nvidia.com/v1beta1"


@dataclass(frozen=True)
class DraDriver:
    way: str
    device_class: str
    domain: str  # the driver's name: device attributes are `device.attributes[domain]`


DRIVERS = {
    HAMI_DRA: DraDriver(HAMI_DRA, "hami-core-gpu.project-hami.io", "hami-core-gpu.project-hami.io"),
    NVIDIA_DRA: DraDriver(NVIDIA_DRA, "gpu.nvidia.com", "gpu.nvidia.com"),
}


def type_selector(domain: str, gpu_types: str) -> str:
    """CEL: the device's productName contains one of the models (comma-separated, validated by keys.py)."""
    product = f"device.attributes['{domain}'].productName.lowerAscii()"
    tests = [f"{product}.contains('{name.strip().lower()}')" for name in gpu_types.split(",") if name.strip()]
    return " || ".join(tests)


def claim_spec(
    driver: DraDriver, gpu: SettledGpu, gpu_types: Optional[str] = None, device_class: Optional[str] = None
) -> Dict[str, Any]:
    """The ResourceClaimSpec (the API's JSON) for `gpu.count` GPUs with the pod's share of each."""
    if gpu.count < 1:
        raise ValueError("no GPU: no claim")
    if gpu.percent is not None:
        raise PolicyError(
            f"nvidia.com/gpumem-percentage {gpu.percent}: a {driver.way} claim asks for GPU memory in bytes, not a "
            "fraction of a GPU not chosen yet (the policy gives this user no gpu_memory size; give one)"
        )
    exactly: Dict[str, Any] = {
        "deviceClassName": device_class or driver.device_class,
        "allocationMode": "ExactCount",
        "count": gpu.count,
    }
    if gpu_types:
        exactly["selectors"] = [{"cel": {"expression": type_selector(driver.domain, gpu_types)}}]
    devices: Dict[str, Any] = {"requests": [{"name": REQUEST, "exactly": exactly}]}
    if driver.way == HAMI_DRA:
        capacity: Dict[str, str] = {}
        if gpu.memory_mib is not None:
            capacity["memory"] = f"{gpu.memory_mib}Mi"
        if gpu.cores is not None:
            capacity["cores"] = str(gpu.cores)
        elif gpu.memory_mib is not None:
            # A capacity not asked for is consumed whole (the device's request policy: all 100 cores): the GPU
            # could not be shared. 0 is HAMi's own default: no compute reserved, no SM limit.
            capacity["cores"] = "0"
        if capacity:
            exactly["capacity"] = {"requests": capacity}
        if gpu.count > 1:
            devices["constraints"] = [{"requests": [REQUEST], "distinctAttribute": f"{driver.domain}/uuid"}]
    else:
        mps: Dict[str, Any] = {}
        if gpu.memory_mib is not None:
            mps["defaultPinnedDeviceMemoryLimit"] = f"{gpu.memory_mib}Mi"
        if gpu.cores:  # 0: no compute limit
            mps["defaultActiveThreadPercentage"] = gpu.cores
        if mps:
            parameters = {
                "apiVersion": NVIDIA_CONFIG_API,
                "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mpsConfig": mps},
            }
            devices["config"] = [{"requests": [REQUEST], "opaque": {"driver": driver.domain, "parameters": parameters}}]
    return {"devices": devices}


def template_name(way: str, spec: Dict[str, Any]) -> str:
    """gpu-quota-<way>-<first 12 hex digits of the spec's SHA-256>: a DNS subdomain, one per distinct claim."""
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return f"gpu-quota-{way}-{digest[:12]}"


def claim_template(way: str, spec: Dict[str, Any], namespace: str) -> Dict[str, Any]:
    """The ResourceClaimTemplate the hub creates in the user's namespace (the API's JSON)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": template_name(way, spec), "namespace": namespace, "labels": dict(MANAGED_BY)},
        "spec": {"metadata": {"labels": dict(MANAGED_BY)}, "spec": spec},
    }


def describe_claim(spec: Dict[str, Any]) -> str:
    """One line for the hub's log."""
    request = spec["devices"]["requests"][0]["exactly"]
    parts: List[str] = [f"{request['count']} x {request['deviceClassName']}"]
    capacity = request.get("capacity", {}).get("requests", {})
    parts += [f"{name} {value}" for name, value in capacity.items()]
    for config in spec["devices"].get("config", []):
        parts += [f"{name} {value}" for name, value in config["opaque"]["parameters"]["sharing"]["mpsConfig"].items()]
    if "selectors" in request:
        parts.append(request["selectors"][0]["cel"]["expression"])
    return ", ".join(parts)
