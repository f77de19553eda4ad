"""KernelManagerView over jupyter_server's real kernel manager: a kernel that is gone between being
listed and being looked up (jupyter_server answers that with an HTTP 404, not jupyter_client's KeyError)."""

import asyncio

from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager

from gpu_quota_ext.usage.kernels import KernelManagerView


class ListsAGoneKernel(AsyncMappingKernelManager):
    """The server's manager as the monitor may meet it: "gone" is still listed, already shut down."""

    def list_kernel_ids(self):
        return ["gone"]


def test_a_kernel_gone_since_it_was_listed_is_skipped_not_raised():
    view = KernelManagerView(ListsAGoneKernel())
    assert view.roots() == {}
    assert view.activity("gone") == (None, None)
    view.on_dead("gone", lambda: None)  # nothing to listen to any more
    assert asyncio.new_event_loop().run_until_complete(view.dead_ids()) == []
