"""The usage side of the server: what kernels really use, and what is done about it.

One concern per module: sampling.py (the monitor: NVML once per poll, off the event loop), attribution.py
(which kernel a process on a GPU belongs to, pure), processes.py (the live process table it reads),
reports.py (what kernels say about their own allocator), kernels.py (the one place that touches
jupyter_server's kernel manager), lifecycle.py (a kernel that is gone gives its grant back), watchdog.py
(decides and carries out actions on kernels over their cap), watchdog_settings.py (its settings), history.py
(each kernel's usage over the last minutes), periodic.py (a round every poll interval). The manager
(manager.py) builds and owns them; nothing here imports it.
"""

from .attribution import foreign_pids, kernel_for_pid
from .history import HistoryPoint, UsageHistory, history_text, kernel_history_text, point_for
from .kernels import (
    KernelActions,
    KernelEnds,
    KernelIds,
    KernelManagerView,
    KernelRoots,
    pending_kernels,
    untrack_kernel_requests,
)
from .lifecycle import KernelLifecycle
from .processes import PidResolver, ProcTable, processes_by_kernel
from .reports import KernelReports
from .sampling import Monitor, Sample
from .watchdog import Watchdog
from .watchdog_settings import WatchdogSettings, build_watchdog_settings

__all__ = [
    "PidResolver", "ProcTable", "foreign_pids", "kernel_for_pid",
    "processes_by_kernel", "KernelManagerView", "KernelIds",
    "KernelRoots", "KernelEnds", "KernelActions", "pending_kernels", "untrack_kernel_requests", "KernelLifecycle",
    "HistoryPoint", "UsageHistory", "history_text", "kernel_history_text", "point_for",
    "KernelReports", "Monitor", "Sample", "Watchdog", "WatchdogSettings", "build_watchdog_settings",
]
