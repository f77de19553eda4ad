"""The hard limit: a per-kernel memory limit the driver enforces at allocation time (NVIDIA MPS).

decisions.py holds the pure rules (settings, each kernel's limit and route); mps.py runs and asks the MPS
control daemon; layer.py is what the server holds (the daemon it manages, each kernel's layers).
"""

from .decisions import LIMIT_VARIABLE, HardLimitSettings, KernelLayers, build_hard_limit_settings
from .layer import HardLimitLayer, HardLimitUnavailable

__all__ = [
    "LIMIT_VARIABLE", "HardLimitSettings", "KernelLayers", "build_hard_limit_settings", "HardLimitLayer",
    "HardLimitUnavailable",
]
