"""The real jupyter_client in this environment still keeps starting kernels in a `_pending_kernels` dict
(gpu_quota_ext.usage.kernels reads it): a new jupyter_client that changes it fails here first."""

import logging

import pytest

from gpu_quota_ext.usage import kernels as kernel_manager_view

from .fake_gpu import fake_gpu_config, manager_of
from .kernels import shutdown_kernel, start_kernel


@pytest.fixture
def jp_server_config():
    return fake_gpu_config("warn")


async def test_a_starting_kernel_is_in_the_real_pending_kernels_dict(
    jp_fetch, jp_serverapp, fake_nvml, caplog, monkeypatch
):
    manager = jp_serverapp.kernel_manager
    gpu_quota = manager_of(jp_serverapp)
    seen = []
    admit = gpu_quota.admit

    async def spying_admit(kernel_id, *args, **kwargs):  # runs inside the start, before the kernel is listed
        pending = kernel_manager_view.pending_kernels(manager)
        seen.append((type(getattr(manager, "_pending_kernels", None)), pending is not None and kernel_id in pending))
        seen.append(kernel_id)
        return await admit(kernel_id, *args, **kwargs)

    monkeypatch.setattr(gpu_quota, "admit", spying_admit)
    monkeypatch.setattr(kernel_manager_view, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="gpu_quota_ext"):
        kernel_id = await start_kernel(jp_fetch)
    (kind, was_pending), admitted = seen
    assert kind is dict and admitted == kernel_id
    assert was_pending  # it was there while starting, as the monitor and provisioner assume
    assert not [r for r in caplog.records if "_pending_kernels" in r.getMessage()]
    await shutdown_kernel(jp_fetch, kernel_id)
