"""Parking: an idle kernel's GPU memory moved to host memory and back through the CUDA driver's
checkpoint API.

decisions.py holds the pure rules (settings, states, the host guard); parker.py carries them out for a
server's kernels; host_room.py reads how much host memory there is; checkpoint.py is the driver, with its
fake for tests beside it (fake_checkpoint.py).

    c.GpuQuota.checkpoint_class = "gpu_quota_ext.parking.fake_checkpoint.FakeCheckpoint"
"""

from .checkpoint import (
    CheckpointDriver,
    CheckpointError,
    CheckpointUnavailable,
    CudaCheckpointDriver,
)
from .decisions import ParkSettings, build_park_settings
from .parker import Parker

__all__ = [
    "CheckpointDriver", "CheckpointError", "CheckpointUnavailable", "CudaCheckpointDriver",
    "ParkSettings", "build_park_settings", "Parker",
]
