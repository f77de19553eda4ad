"""gpu-quota-ext: a GPU memory cap for every Jupyter kernel, visible and adjustable.

This module is imported inside kernels too (the bootstrap loads it from the server's installation), so
it imports nothing heavy: the server extension's classes are imported only when the server asks.
"""

__version__ = "0.1.0"


def _jupyter_server_extension_points():
    from .app import GpuQuota

    return [{"module": "gpu_quota_ext.app", "app": GpuQuota}]


def _jupyter_labextension_paths():
    return [{"src": "labextension", "dest": "gpu-quota-ext"}]


def load_ipython_extension(ipython):
    """`%load_ext gpu_quota_ext` (the bootstrap does it in every kernel the server starts)."""
    from .kernel.magic import load

    load(ipython)


def unload_ipython_extension(ipython):
    from .kernel.magic import unload

    unload(ipython)
