"""Parking: an idle kernel's GPU memory moved to host memory and back through the CUDA driver's checkpoint API,
and the broker that makes overcommit safe: which resume may run now (only into room reserved for it), which
idle kernels park to make room.

states.py is a kernel's parking as a pure state machine; shown.py the state the broker sees a kernel in (one rule
for a server's parker and the host service); broker.py the broker's pure decisions; decisions.py
the rules applied before the driver is asked (settings, parkable, idle timer); host_account.py the host's
memory as one account for every park; wording.py the words; events.py the same changes as structured events
(jupyter_server's event system, a schema per event in event_schemas/);
parker.py carries them out for a server's kernels; host_broker.py asks the host service's broker instead of
this server's own; kernel_channel.py asks a kernel to empty its caches before it parks; host_room.py reads how
much host memory there is; path.py chooses per kernel between the driver's checkpoint calls and the fast park
library (pages/, through pages_driver.py and the kernel's control channel); checkpoint.py is the driver, with its
fakes for tests beside it (fake_checkpoint.py; fake_file_checkpoint.py for servers in processes of their own,
sharing a file with devices.FileFakeNvml).

    c.GpuQuota.checkpoint_class = "gpu_quota_ext.parking.fake_checkpoint.FakeCheckpoint"

The host service's broker (hub/service/room.py) runs the same decisions over every user's kernels: the broker's
types, `decide`, `shown_as` and `host_room` are this package's surface for it.
"""

from .broker import (
    BrokerSettings,
    Demand,
    DeviceView,
    HostView,
    KernelView,
    Plan,
    Reservation,
    Round,
    decide,
)
from .checkpoint import (
    CheckpointDriver,
    CheckpointError,
    CheckpointUnavailable,
    CudaCheckpointDriver,
)
from .decisions import ParkSettings, build_park_settings, on_device_full_for
from .events import park_event_logger
from .host_account import HostAccount, HostReading
from .host_broker import HostBroker, HostRooms
from .host_room import host_room
from .kernel_channel import KernelChannel, KernelClients
from .pages.build import preload_library
from .parker import OwnBroker, ParkedKernels, Parker, RoomBroker
from .path import preloads
from .shown import PARK_MARGIN, PARK_RATE, Said, Shown, park_time, shown_as

__all__ = [
    "CheckpointDriver", "CheckpointError", "CheckpointUnavailable", "CudaCheckpointDriver",
    "ParkSettings", "build_park_settings", "on_device_full_for", "Parker", "ParkedKernels", "KernelChannel",
    "KernelClients", "OwnBroker",
    "RoomBroker", "HostBroker",
    "HostRooms", "BrokerSettings", "Demand", "DeviceView", "HostView", "KernelView", "Plan",
    "Reservation", "Round", "decide", "host_room", "HostAccount", "HostReading", "preload_library", "preloads",
    "PARK_MARGIN", "PARK_RATE", "Said", "Shown", "park_time", "shown_as", "park_event_logger",
]
