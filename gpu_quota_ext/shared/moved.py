"""Module paths that moved when the package became one folder per concern, kept importable.

An admin's config names classes by their import path (`c.GpuQuota.nvml_class =
"gpu_quota_ext.fake_nvml.FakeNvml"`), a jupyterhub_config.py imports `gpu_quota_ext.host_service.configure`:
those keep working, with a DeprecationWarning that names the new path. The old name is the same module
object as the new one (not a copy), so a class or a setting reached either way is one thing.

Standard library only: the package's __init__ installs this finder, and kernels import the package too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Dict, Optional

_SERVICE_MODULES = (
    "app", "attribution", "book", "configure", "handlers", "hub_directory", "metrics", "page", "sampler", "spec",
    "status", "store", "user_policy",
)

# old module -> new module
MOVED: Dict[str, str] = {
    "gpu_quota_ext.cap_request": "gpu_quota_ext.shared.cap_request",
    "gpu_quota_ext.hami": "gpu_quota_ext.devices.hami",
    "gpu_quota_ext.nvml": "gpu_quota_ext.devices.nvml",
    "gpu_quota_ext.fake_nvml": "gpu_quota_ext.devices.fake_nvml",
    "gpu_quota_ext.local_ledger": "gpu_quota_ext.ledger.local",
    "gpu_quota_ext.remote_ledger": "gpu_quota_ext.ledger.remote",
    "gpu_quota_ext.watchdog": "gpu_quota_ext.usage.watchdog_settings",
    "gpu_quota_ext.usage.kernel_manager": "gpu_quota_ext.usage.kernels",
    "gpu_quota_ext.usage.status": "gpu_quota_ext.status.view",
    "gpu_quota_ext.jupyter_private": "gpu_quota_ext.usage.kernels",
    "gpu_quota_ext.metrics": "gpu_quota_ext.status.collector",
    "gpu_quota_ext.parker": "gpu_quota_ext.parking.parker",
    "gpu_quota_ext.checkpoint": "gpu_quota_ext.parking.checkpoint",
    "gpu_quota_ext.fake_checkpoint": "gpu_quota_ext.parking.fake_checkpoint",
    "gpu_quota_ext.park_handlers": "gpu_quota_ext.handlers",
    "gpu_quota_ext.mps": "gpu_quota_ext.hard_limit.mps",
    "gpu_quota_ext.hard_cap": "gpu_quota_ext.hard_limit.layer",
    "gpu_quota_ext.kube": "gpu_quota_ext.hub.kube",
    "gpu_quota_ext.host_service": "gpu_quota_ext.hub.service",
    "gpu_quota_ext.host_service.contract": "gpu_quota_ext.shared.service_contract",
    **{f"gpu_quota_ext.host_service.{name}": f"gpu_quota_ext.hub.service.{name}" for name in _SERVICE_MODULES},
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and hands back the module at its new path."""

    def find_spec(self, fullname: str, path=None, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in MOVED:
            return None
        # A package's old name (host_service) must accept submodules: give it a search path.
        is_package = any(other.startswith(fullname + ".") for other in MOVED)
        return importlib.util.spec_from_loader(fullname, self, is_package=is_package)

    def create_module(self, spec):
        return None  # a placeholder: exec_module puts the real module in its place

    def get_code(self, fullname: str):
        """For `python -m OLD.PATH` (a hub's services entry written by hand): run the new module as __main__."""
        stub = f"import runpy\nrunpy.run_module({MOVED[fullname]!r}, run_name='__main__', alter_sys=True)\n"
        return compile(stub, fullname, "exec")

    def exec_module(self, module) -> None:
        old = module.__name__
        new = MOVED[old]
        warnings.warn(
            f"{old} moved to {new}; the old path will go in a later release", DeprecationWarning, stacklevel=2
        )
        # The import system returns what sys.modules holds once exec_module is done: the real module.
        sys.modules[old] = importlib.import_module(new)


def install() -> None:
    """Put the finder on sys.meta_path once (idempotent)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())  # before the path finder, which would load the files twice
