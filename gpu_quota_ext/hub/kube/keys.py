"""The pod keys of the hub's mapping (besides the server's caps), each with its parser, and which way reads
which key: a key the chosen way cannot carry stops the hub at start (or fails that spawn, for a group
property), naming the entry, instead of being dropped without a word.

Pure: each parser returns the normalized text, or raises PolicyError.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Mapping, Tuple

from ...devices import WAYS
from ...shared.sizes import MiB, PolicyError, parse_cap

HAMI, HAMI_DRA, KAI, NVIDIA_DRA = WAYS
DRA_WAYS = (HAMI_DRA, NVIDIA_DRA)
MAX_GPUS = 16  # HAMi-core keeps limits for 16 devices per container; more GPUs than that in one pod is not a share
GPU_POLICIES = ("binpack", "spread", "topology-aware")
NODE_POLICIES = ("binpack", "spread")
# A Kubernetes label value (KAI's queue is a label): 63 characters, alphanumerics at both ends.
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def _whole(value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PolicyError(f"{value!r} is not a whole number of {what}")
    text = str(value).strip().rstrip("%").strip() if what == "percent" else str(value).strip()
    if not text.isdigit():
        raise PolicyError(f"{value!r} is not a whole number of {what}")
    number = int(text)
    if not low <= number <= high:
        raise PolicyError(f"{value!r}: {what} must be from {low} to {high}")
    return number


def _gpus(value: Any) -> str:
    return str(_whole(value, 0, MAX_GPUS, "GPUs"))


def _gpu_memory(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        # 10240 could mean bytes (our caps) or MiB (HAMi's unit): make the admin say which.
        raise PolicyError(f"{value!r}: write a size with its unit ('10GiB', '10240MiB') or a fraction ('0.25', '25%')")
    spec = parse_cap(value)
    if spec.fraction is not None:
        percent = spec.fraction * 100
        if abs(percent - round(percent)) > 1e-9:
            raise PolicyError(
                f"{value!r}: HAMi's nvidia.com/gpumem-percentage and KAI's gpu-fraction take whole percents (1 to 100)"
            )
        return f"{round(percent)}%"
    assert spec.nbytes is not None
    if spec.nbytes < MiB:
        raise PolicyError(f"{value!r}: less than 1 MiB of GPU memory")
    return f"{spec.nbytes // MiB}MiB"  # the pod's unit is whole MiB: never more than asked


def _gpu_cores(value: Any) -> str:
    return str(_whole(value, 0, 100, "percent"))


def _gpu_type(value: Any) -> str:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise PolicyError(f"{value!r}: give a GPU model or a list of them, e.g. 'H200' or ['A100', 'H100']")
    names = []
    for item in items:
        # A model becomes an annotation (HAMi) or a string inside a CEL selector (DRA): no quotes, no escapes.
        if not isinstance(item, str) or not item.strip() or any(ch in item for ch in ",{}\n'\"\\"):
            raise PolicyError(
                f"{value!r}: each GPU model must be a non-empty name without commas, braces, quotes or backslashes"
            )
        names.append(item.strip())
    return ",".join(names)


def _choice(allowed: Tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower() if isinstance(value, str) else None
        if text not in allowed:
            raise PolicyError(f"{value!r} must be one of {', '.join(repr(a) for a in allowed)}")
        return text

    return parse


def _kai_queue(value: Any) -> str:
    if not isinstance(value, str) or not _LABEL_VALUE.match(value.strip()):
        raise PolicyError(f"{value!r}: a KAI queue name is a Kubernetes label value (letters, digits, '-', '_', '.')")
    return value.strip()


POD_KEYS: Dict[str, Callable[[Any], str]] = {
    "gpus": _gpus,
    "gpu_memory": _gpu_memory,
    "gpu_cores": _gpu_cores,
    "gpu_type": _gpu_type,
    "gpu_scheduler_policy": _choice(GPU_POLICIES),
    "node_scheduler_policy": _choice(NODE_POLICIES),
    "kai_queue": _kai_queue,
}

# The pod keys each way carries into the pod.
WAY_KEYS: Dict[str, Tuple[str, ...]] = {
    HAMI: ("gpus", "gpu_memory", "gpu_cores", "gpu_type", "gpu_scheduler_policy", "node_scheduler_policy"),
    HAMI_DRA: ("gpus", "gpu_memory", "gpu_cores", "gpu_type"),
    NVIDIA_DRA: ("gpus", "gpu_memory", "gpu_cores", "gpu_type"),
    KAI: ("gpus", "gpu_memory", "kai_queue"),
}
_WHY_NOT = {
    "gpu_cores": "KAI schedules GPU memory, not a compute share",
    "gpu_type": "KAI has no GPU-model request; give that profile a node selector",
    "gpu_scheduler_policy": "only HAMi's own scheduler reads it",
    "node_scheduler_policy": "only HAMi's own scheduler reads it",
    "kai_queue": "only the 'kai' way sends pods to KAI's queues",
}


def check_way(way: str, settings: Mapping[str, str], where: str) -> None:
    """Raise PolicyError naming `where` when `settings` hold a pod key `way` cannot carry."""
    for key in settings:
        if key in POD_KEYS and key not in WAY_KEYS[way]:
            raise PolicyError(f"{where}[{key!r}]: the {way!r} way cannot carry it ({_WHY_NOT[key]})")
    memory = settings.get("gpu_memory")
    if way in DRA_WAYS and memory is not None and memory.endswith("%"):
        raise PolicyError(
            f"{where}['gpu_memory'] = {memory!r}: a DRA claim asks for GPU memory in bytes (its capacity request, or "
            "its MPS limit), not a fraction of a GPU not chosen yet; write a size such as '10GiB'"
        )
