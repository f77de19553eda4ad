"""The server-side quota service: what the launch hook, the REST API and the monitor share.

It holds the validated policy, the device inventory, the ledger and the kernels' secrets, and turns
"kernel K of kernelspec S is starting" into a grant and the environment that carries it. It also knows
which start holds each kernel id, so two starts that chose the same id cannot share one grant.
"""

from __future__ import annotations

import asyncio
import getpass
import hmac
import logging
import os
import secrets
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional

from .devices import Device, parse_cuda_visible_devices
from .hard_cap import HardCapLayer
from .hard_limit import HardCapSettings, Probe
from .launch_env import is_python_kernel, launch_env
from .ledger import Grant, Ledger
from .local_ledger import LocalLedger
from .policy import Policy, PolicyDecision, default_decision, format_bytes, resolve, resolve_answer, shown

log = logging.getLogger("gpu_quota_ext")

CAPS_CALLABLE_TIMEOUT = 5.0  # seconds a caps callable may take before its kernel gets the default policy
CAPS_CALLABLE_THREADS = 4  # callables still running at once; past that, starts get the default policy


class KernelIdTaken(Exception):
    """Another start holds this kernel id (a client chose the same id for two starts at once)."""


def describe_grant(grant: Grant) -> str:
    """One line for the server's log: what a kernel got, where, and why."""
    if not grant.devices:
        return f"runs without a GPU cap: {grant.cpu_only_reason}" if grant.cpu_only_reason else "no GPU on this server"
    caps = ", ".join(f"{format_bytes(grant.caps[i])} on device {i}" for i in grant.devices)
    return f"granted {caps} (max {format_bytes(max(grant.max_caps.values()))}; source: {grant.source})"


def server_user() -> str:
    """The user this server runs for: JupyterHub's name for them when spawned by a hub."""
    try:
        fallback = getpass.getuser()
    except Exception:
        fallback = "unknown"
    return os.environ.get("JUPYTERHUB_USER") or fallback


class GpuQuotaManager:
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
        self.ledger = ledger if ledger is not None else LocalLedger(devices, policy)
        self.user = user or server_user()
        self.no_gpu_reason = no_gpu_reason
        self._api_url = api_url
        self._tokens: Dict[str, str] = {}
        self._tokens_lock = threading.Lock()
        self._holders: Dict[str, Any] = {}  # kernel id -> the start (provisioner) that holds its grant
        self._holders_lock = threading.RLock()
        self.caps_timeout = CAPS_CALLABLE_TIMEOUT
        self._caps_slots = threading.BoundedSemaphore(CAPS_CALLABLE_THREADS)
        # Usage lives in the monitor (set by the app once the server's kernel manager exists); caps in the ledger.
        self.monitor = None
        self.parker = None  # parking (parker.py), set by the app like the monitor
        # The hard limit (MPS): off until the app starts it from c.GpuQuota.hard_cap.
        self.hard_cap = HardCapLayer(HardCapSettings())

    # --- kernel lifecycle (called by the provisioner) -----------------------------------------

    async def admit(self, kernel_id: str, kernelspec: str, argv, env: Mapping[str, str], holder: Any = None) -> Dict[str, str]:
        """Grant (or find, on restart) the kernel's caps; return the variables its environment gets.

        `holder` is the start asking (its provisioner): a restart by the same holder keeps its grant;
        another start of the same kernel id raises KernelIdTaken. Raises AdmissionRefused
        (on_full="refuse") or PolicyError (a cap that cannot be granted on a device).
        """
        grant = self._held_grant(kernel_id, holder)
        if grant is None:
            self._check_free(kernel_id, holder)
            resolved = await self.resolve_caps(kernelspec)
            with self._holders_lock:
                # Another start of this id may have won while the caps callable ran.
                self._check_free(kernel_id, holder)
                grant = self.ledger.grant(kernel_id, self.user, kernelspec, resolved, allowed=self._pinned_devices(env))
                self._holders[kernel_id] = holder
            log.info("gpu-quota-ext: kernel %s (%s) %s", kernel_id, kernelspec, describe_grant(grant))
        # Only a Python kernel's bootstrap moves the secret out of its environment: no one else gets it.
        python = is_python_kernel(argv)
        probe = await self.hard_cap.probe()  # asks the MPS daemon (hard_cap on) in a thread, with a timeout
        return launch_env(
            grant,
            self.devices,
            env,
            api_url=self._api_url() if python else None,
            token=self.token_for(kernel_id) if python else None,
            python_kernel=python,
            hard_limit=self.hard_cap.decide(kernel_id, grant, self.devices, env, probe),
        )

    def release(self, kernel_id: str, holder: Any = None) -> Optional[Grant]:
        """Free the kernel's grant and secret. With `holder`, only if that start holds them (a start that
        lost the race for its kernel id must not release the winner's grant)."""
        with self._holders_lock:
            if holder is not None and self._holders.get(kernel_id, holder) is not holder:
                return None
            self._holders.pop(kernel_id, None)
        with self._tokens_lock:
            self._tokens.pop(kernel_id, None)
        self.hard_cap.forget(kernel_id)
        return self.ledger.release(kernel_id)

    def holder(self, kernel_id: str) -> Any:
        with self._holders_lock:
            return self._holders.get(kernel_id)

    def _held_grant(self, kernel_id: str, holder: Any) -> Optional[Grant]:
        with self._holders_lock:
            if kernel_id not in self._holders or self._holders[kernel_id] is not holder:
                return None
        return self.ledger.get(kernel_id)

    def _check_free(self, kernel_id: str, holder: Any) -> None:
        with self._holders_lock:
            if kernel_id in self._holders and self._holders[kernel_id] is not holder:
                raise KernelIdTaken(f"kernel {shown(kernel_id)} is already starting or running; a new kernel needs another id")

    # --- what policy gives a kernel -------------------------------------------------------------

    async def resolve_caps(self, kernelspec: str) -> PolicyDecision:
        """Policy's answer for this server's user and `kernelspec`. A caps callable (the admin's code) runs
        in a thread, never on the event loop; if it fails, hangs or answers nonsense, the kernel gets the
        default policy and the log one warning line."""
        policy = self.policy
        if not callable(policy.rules):
            return resolve(policy, self.user, kernelspec)
        try:
            return resolve_answer(policy, await self._call_caps(kernelspec))
        except Exception as error:
            log.warning(
                "gpu-quota-ext: c.GpuQuota.caps callable failed for user %s, kernelspec %s: %s; the kernel gets the default policy",
                shown(self.user), shown(kernelspec), _one_line(error),
            )
            return default_decision(policy, "default (caps callable failed)")

    async def _call_caps(self, kernelspec: str) -> Any:
        # A daemon thread per call, not an executor: a callable that never returns would hold an executor's
        # worker, and the interpreter joins those at exit, so the server could never stop. At most
        # CAPS_CALLABLE_THREADS calls run at once, so hung callables cannot pile up threads.
        if not self._caps_slots.acquire(blocking=False):
            raise TimeoutError(f"{CAPS_CALLABLE_THREADS} earlier calls have not returned yet")
        loop = asyncio.get_running_loop()
        answered = loop.create_future()

        def settle(outcome) -> None:
            if not answered.done():  # done: the wait timed out and gave up on it
                answered.set_result(outcome)

        def call() -> None:
            try:
                outcome = (True, self.policy.rules(self.user, kernelspec))
            except BaseException as error:
                outcome = (False, error)
            finally:
                self._caps_slots.release()
            try:
                loop.call_soon_threadsafe(settle, outcome)
            except RuntimeError:  # the loop closed while the callable ran
                pass

        threading.Thread(target=call, name="gpu-quota-caps-callable", daemon=True).start()
        try:
            ok, value = await asyncio.wait_for(answered, self.caps_timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer within {self.caps_timeout:g} s") from None
        if not ok:
            raise value
        return value

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


def _one_line(error: BaseException) -> str:
    """An exception as one short line for the log (no traceback: the admin's bug, not ours)."""
    try:
        text = " ".join(str(error).split())
    except Exception:  # the admin's exception may not even print
        text = ""
    return f"{error.__class__.__name__}: {text[:200]}" if text else error.__class__.__name__
