"""The one private jupyter_client attribute the server side reads: MultiKernelManager._pending_kernels.

jupyter_client keeps the kernels being started in `_pending_kernels` (kernel id -> start task) until
they are listed; there is no public accessor. The release of vanished grants (the monitor) must not
release a kernel that is still starting, and the provisioner puts a start that lost a race back in it.
A new jupyter_client may rename or reshape it: then this says so once, clearly, and callers get None
(the monitor then sees no starting kernels; the provisioner skips its repair), not a silent change.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

log = logging.getLogger("gpu_quota_ext")

_warned = False


def pending_kernels(multi_kernel_manager: Any) -> Optional[dict]:
    """The manager's table of kernels being started (kernel id -> start task), or None when this
    jupyter_client has no such dict (warned once per process)."""
    pending = getattr(multi_kernel_manager, "_pending_kernels", None)
    if isinstance(pending, dict):
        return pending
    global _warned
    if not _warned:
        _warned = True
        import jupyter_client

        log.warning(
            "gpu-quota-ext: jupyter_client %s has no MultiKernelManager._pending_kernels dict (found %s):"
            " kernels being started are not seen as such, so a grant may be released while its kernel starts;"
            " gpu-quota-ext needs an update for this jupyter_client",
            getattr(jupyter_client, "__version__", "?"),
            "nothing" if pending is None else type(pending).__name__,
        )
    return None
