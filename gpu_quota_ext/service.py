"""The server-side quota service: what the launch hook, the REST API and the monitor share.

It holds the validated policy, the device inventory, the ledger and the kernels' secrets, and turns
"kernel K of kernelspec S is starting" into a grant and the environment that carries it.
"""

from __future__ import annotations

import getpass
import hmac
import logging
import os
import secrets
import threading
from typing import Callable, Dict, List, Mapping, Optional

from .devices import Device, parse_cuda_visible_devices
from .hard_cap import HardCapLayer
from .hard_limit import HardCapSettings, Probe
from .launch_env import is_python_kernel, launch_env
from .ledger import Grant, Ledger
from .policy import Policy, resolve

log = logging.getLogger("gpu_quota_ext")


def server_user() -> str:
    """The user this server runs for: JupyterHub's name for them when spawned by a hub."""
    try:
        fallback = getpass.getuser()
    except Exception:
        fallback = "unknown"
    return os.environ.get("JUPYTERHUB_USER") or fallback


class QuotaService:
    def __init__(
        self,
        policy: Policy,
        devices: List[Device],
        ledger: Optional[Ledger] = None,
        api_url: Callable[[], Optional[str]] = lambda: None,
        user: Optional[str] = None,
        no_gpu_reason: Optional[str] = None,
    ):
        self.policy = policy
        self.devices: Dict[int, Device] = {d.index: d for d in devices}
        self.ledger = ledger if ledger is not None else Ledger(devices, policy)
        self.user = user or server_user()
        self.no_gpu_reason = no_gpu_reason
        self._api_url = api_url
        self._tokens: Dict[str, str] = {}
        self._tokens_lock = threading.Lock()
        # Usage lives in the monitor (set by the app once the server's kernel manager exists); caps in the ledger.
        self.monitor = None
        # The hard limit (MPS): off until the app starts it from c.GpuQuota.hard_cap.
        self.hard_cap = HardCapLayer(HardCapSettings())

    # --- kernel lifecycle (called by the provisioner) -----------------------------------------

    def admit(
        self, kernel_id: str, kernelspec: str, argv, env: Mapping[str, str], probe: Optional[Probe] = None
    ) -> Dict[str, str]:
        """Grant (or find, on restart) the kernel's caps; return the variables its environment gets.

        Raises AdmissionRefused (on_full="refuse") or PolicyError (a caps callable that failed).
        """
        resolved = resolve(self.policy, self.user, kernelspec)
        allowed = self._pinned_devices(env)
        grant = self.ledger.grant(kernel_id, self.user, kernelspec, resolved, allowed=allowed)
        return launch_env(
            grant,
            self.devices,
            env,
            api_url=self._api_url(),
            token=self.token_for(kernel_id),
            python_kernel=is_python_kernel(argv),
            hard_limit=self.hard_cap.decide(kernel_id, grant, self.devices, env, probe),
        )

    def release(self, kernel_id: str) -> Optional[Grant]:
        with self._tokens_lock:
            self._tokens.pop(kernel_id, None)
        self.hard_cap.forget(kernel_id)
        return self.ledger.release(kernel_id)

    def _pinned_devices(self, env: Mapping[str, str]) -> Optional[List[int]]:
        """A kernelspec that sets its own CUDA_VISIBLE_DEVICES is placed only among those devices."""
        pinned = parse_cuda_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
        if pinned is None or pinned == parse_cuda_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES")):
            return None
        allowed = []
        for entry in pinned:
            for device in self.devices.values():
                nvml = device.nvml_index if device.nvml_index is not None else device.index
                if (entry.isdigit() and int(entry) == nvml) or (not entry.isdigit() and device.uuid.startswith(entry)):
                    allowed.append(device.index)
        return allowed

    # --- the kernels' secrets ------------------------------------------------------------------

    def token_for(self, kernel_id: str) -> str:
        """The kernel's secret; the same across restarts so a restarted kernel can still ask."""
        with self._tokens_lock:
            token = self._tokens.get(kernel_id)
            if token is None:
                token = self._tokens[kernel_id] = secrets.token_urlsafe(32)
            return token

    def token_matches(self, kernel_id: str, presented: Optional[str]) -> bool:
        with self._tokens_lock:
            expected = self._tokens.get(kernel_id)
        if not (expected and presented):
            return False
        # Bytes: compare_digest refuses non-ASCII str, and a header may carry anything.
        return hmac.compare_digest(expected.encode(), presented.encode("utf-8", "surrogateescape"))
