"""The kernel-launch hook: a jupyter_client kernel provisioner that the extension makes the default.

Every kernelspec without a provisioner stanza of its own is launched through it, so every kernel gets
its grant (and the environment that carries it) before its process exists, with no kernelspec edited.
"""

from __future__ import annotations

from typing import Any, Optional

from jupyter_client.provisioning import LocalProvisioner
from tornado import web

from .ledger import AdmissionRefused
from .policy import PolicyError

SETTINGS_KEY = "gpu_quota_service"  # where the extension puts its QuotaService in the web app settings


class GpuQuotaProvisioner(LocalProvisioner):
    """LocalProvisioner plus a grant: taken in pre_launch, kept on restart, released on shutdown."""

    def _service(self) -> Optional[Any]:
        # provisioner -> KernelManager -> MappingKernelManager -> ServerApp, whose web app holds the service
        node = self.parent
        while node is not None:
            web_app = getattr(node, "web_app", None)
            if web_app is not None:
                return web_app.settings.get(SETTINGS_KEY)
            node = getattr(node, "parent", None)
        return None

    def _kernelspec_name(self) -> str:
        return getattr(self.parent, "kernel_name", None) or "unknown"

    async def pre_launch(self, **kwargs: Any) -> dict:
        kwargs = await super().pre_launch(**kwargs)  # merges the kernelspec's own env first
        service = self._service()
        if service is None:
            self.log.warning("gpu-quota-ext: the server extension is not loaded; kernel %s starts without a cap", self.kernel_id)
            return kwargs
        env = dict(kwargs.get("env") or {})
        probe = await service.hard_cap.probe()  # asks the MPS daemon (hard_cap on) in a thread, with a timeout
        try:
            updates = service.admit(
                self.kernel_id, self._kernelspec_name(), kwargs.get("cmd") or self.kernel_spec.argv, env, probe=probe
            )
        except AdmissionRefused as refusal:
            self._forget_failed_start()
            raise web.HTTPError(503, f"GPU quota: kernel not started: {refusal}", reason="GPU budget full") from None
        except PolicyError as error:
            self._forget_failed_start()
            raise web.HTTPError(500, f"GPU quota: {error}", reason="GPU quota policy error") from None
        except Exception:
            # Whatever failed after the grant was taken must not keep its budget.
            self._release()
            self._forget_failed_start()
            raise
        env.update(updates)
        kwargs["env"] = env
        return kwargs

    async def launch_kernel(self, cmd, **kwargs: Any):
        try:
            return await super().launch_kernel(cmd, **kwargs)
        except Exception:
            # The process never started: its grant must not hold budget.
            self._release()
            self._forget_failed_start()
            raise

    async def cleanup(self, restart: bool = False) -> None:
        await super().cleanup(restart=restart)
        if not restart:
            self._release()

    def _forget_failed_start(self) -> None:
        # jupyter_client (8.10) keeps the id of a kernel whose start failed in its pending table for
        # good; the server's shutdown_all then fails with "Kernel does not exist". A refusal is a
        # normal event for a quota, so we drop that entry ourselves.
        multi = getattr(self.parent, "parent", None)
        pending = getattr(multi, "_pending_kernels", None)
        if isinstance(pending, dict):
            pending.pop(self.kernel_id, None)

    def _release(self) -> None:
        service = self._service()
        if service is not None and self.kernel_id:
            service.release(self.kernel_id)
