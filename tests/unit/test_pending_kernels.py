"""The guard around jupyter_client's private MultiKernelManager._pending_kernels."""

import logging

import pytest

from gpu_quota_ext.usage import kernels as kernel_manager_view


@pytest.fixture(autouse=True)
def fresh_warning(monkeypatch):
    monkeypatch.setattr(kernel_manager_view, "_warned", False)


class Manager:
    pass


def test_a_dict_is_returned_as_is():
    manager = Manager()
    manager._pending_kernels = {"k": object()}
    assert kernel_manager_view.pending_kernels(manager) is manager._pending_kernels


@pytest.mark.parametrize("value", [None, ["k"], {"k"}, "k", 3])
def test_missing_or_reshaped_gives_none_and_one_clear_warning(value, caplog):
    manager = Manager()
    if value is not None:
        manager._pending_kernels = value
    with caplog.at_level(logging.WARNING, logger="gpu_quota_ext"):
        assert kernel_manager_view.pending_kernels(manager) is None
        assert kernel_manager_view.pending_kernels(manager) is None
    warnings = [r for r in caplog.records if "_pending_kernels" in r.getMessage()]
    assert len(warnings) == 1  # once, not at every sample
    assert "jupyter_client" in warnings[0].getMessage() and "needs an update" in warnings[0].getMessage()


def test_the_monitor_sees_no_starting_kernels_without_it():
    from gpu_quota_ext.usage.kernels import KernelManagerView

    manager = Manager()
    manager._pending_kernels = ("not", "a", "dict")
    assert KernelManagerView(manager).starting_ids() == set()
    manager._pending_kernels = {"k1": None}
    assert KernelManagerView(manager).starting_ids() == {"k1"}
