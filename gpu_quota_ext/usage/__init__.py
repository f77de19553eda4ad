"""The usage side of the server: what kernels really use, and what is done about it.

One concern per module: sampling.py (the monitor: NVML once per poll, off the event loop),
attribution.py (which kernel a process on a GPU belongs to), reports.py (what kernels say about their
own allocator), kernel_manager.py (the server's kernel manager as this side needs it), lifecycle.py
(a kernel that is gone gives its grant back), watchdog.py (decides and carries out actions on kernels
over their cap), status.py (the status answer and /metrics, built in one place), periodic.py (a round
every poll interval). The manager (manager.py) builds and owns them; nothing here imports it.
"""
