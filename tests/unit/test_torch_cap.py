"""The kernel-side torch cap helpers: pure parts, and the import watcher with a stand-in module."""

import sys
import types

import pytest

from gpu_quota_ext.kernel.torch_cap import (
    TorchImportWatcher,
    alloc_conf_variable,
    merge_alloc_conf,
    reads_fraction_from_alloc_conf,
)


def test_alloc_conf_fraction_only_from_torch_2_10():
    assert reads_fraction_from_alloc_conf("2.10.0")
    assert reads_fraction_from_alloc_conf("2.11.0+cu130")
    assert reads_fraction_from_alloc_conf("3.0.0a0")
    assert not reads_fraction_from_alloc_conf("2.9.1")
    assert not reads_fraction_from_alloc_conf("1.13.1")
    assert not reads_fraction_from_alloc_conf(None)
    assert not reads_fraction_from_alloc_conf("garbage")


def test_merge_alloc_conf_keeps_other_options_and_the_tighter_fraction():
    assert merge_alloc_conf(None, 0.25) == "per_process_memory_fraction:0.250000"
    assert (
        merge_alloc_conf("expandable_segments:True", 0.2)
        == "expandable_segments:True,per_process_memory_fraction:0.200000"
    )
    assert merge_alloc_conf("per_process_memory_fraction:0.1,max_split_size_mb:128", 0.5) == (
        "max_split_size_mb:128,per_process_memory_fraction:0.100000"
    )
    assert merge_alloc_conf("per_process_memory_fraction:0.9", 0.5) == "per_process_memory_fraction:0.500000"
    # Rounded down: never more than the cap.
    assert merge_alloc_conf("", 0.3333339) == "per_process_memory_fraction:0.333333"


def test_alloc_conf_variable_follows_the_users_choice():
    assert alloc_conf_variable({}) == "PYTORCH_CUDA_ALLOC_CONF"
    assert alloc_conf_variable({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}) == "PYTORCH_ALLOC_CONF"


def test_import_watcher_calls_back_after_the_module_is_executed(tmp_path, monkeypatch):
    # A stand-in "torch" package on sys.path: the watcher must see it fully imported, once.
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text("READY = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    seen = []
    watcher = TorchImportWatcher(lambda module: seen.append(getattr(module, "READY", False)))
    watcher.install()
    try:
        import torch  # noqa: F401  (the stand-in)

        assert seen == [True]
        assert watcher not in sys.meta_path
    finally:
        watcher.uninstall()
        sys.modules.pop("torch", None)


def test_a_failing_callback_never_breaks_the_import(tmp_path, monkeypatch):
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)

    def boom(module):
        raise RuntimeError("boom")

    watcher = TorchImportWatcher(boom)
    watcher.install()
    try:
        # A warning, shown in the cell that imported torch; nothing on the kernel's (the server's) stderr.
        with pytest.warns(RuntimeWarning, match="could not queue the torch cap"):
            import torch

        assert isinstance(torch, types.ModuleType)
    finally:
        watcher.uninstall()
        sys.modules.pop("torch", None)


def test_bootstrap_without_torch_writes_no_allocator_option(monkeypatch):
    # No torch installed in the kernel's environment: nothing to read the option, so none is written;
    # the import watcher still waits, in case the user installs torch during the session.
    from gpu_quota_ext.kernel import state as state_module
    from gpu_quota_ext.kernel import torch_cap

    monkeypatch.setattr(torch_cap, "installed_torch_version", lambda: None)
    state = state_module.KernelCapState(
        kernel_id="k", devices=[state_module.DeviceCap(0, 0, "GPU-a", 1 << 30, 1 << 31, 1 << 34)]
    )
    env = {}
    installed = []
    monkeypatch.setattr(torch_cap, "install_lazy_hook", lambda s: installed.append(s))
    torch_cap.cap_torch(state, env=env)
    assert env == {}
    assert installed == [state]
    assert "PYTORCH" not in state.torch_route and "first CUDA use" in state.torch_route


def test_bootstrap_with_old_torch_uses_only_the_lazy_route(monkeypatch):
    from gpu_quota_ext.kernel import state as state_module
    from gpu_quota_ext.kernel import torch_cap

    monkeypatch.setattr(torch_cap, "installed_torch_version", lambda: "2.9.1")
    monkeypatch.setattr(torch_cap, "install_lazy_hook", lambda s: None)
    state = state_module.KernelCapState(
        kernel_id="k", devices=[state_module.DeviceCap(0, 0, "GPU-a", 1 << 30, 1 << 31, 1 << 34)]
    )
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    torch_cap.cap_torch(state, env=env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # torch 2.9 would reject the new key


# --- the private torch API the lazy route relies on -----------------------------------------------


def test_the_installed_torch_has_the_private_lazy_call_we_rely_on():
    # torch.cuda._lazy_call is private: a torch that drops or renames it must fail here, not silently
    # leave kernels uncapped. The CPU torch of the test environment has the same torch.cuda module.
    torch = pytest.importorskip("torch")
    from gpu_quota_ext.kernel.torch_cap import lazy_call_of

    assert callable(getattr(torch.cuda, "_lazy_call", None))
    assert lazy_call_of(torch) is torch.cuda._lazy_call


def test_a_torch_without_lazy_call_gives_one_clear_problem_line_at_kernel_start(monkeypatch):
    from gpu_quota_ext.kernel import bootstrap
    from gpu_quota_ext.kernel import state as state_module
    from gpu_quota_ext.shared.env_vars import DEVICES, KERNEL_ID, USER_STARTUP

    from .fake_torch import fake_torch

    module = fake_torch(1 << 34)
    module.cuda = types.SimpleNamespace(is_initialized=lambda: False)  # a torch.cuda with no _lazy_call
    monkeypatch.setitem(sys.modules, "torch", module)
    monkeypatch.setattr(state_module, "STATE", state_module.KernelCapState())
    monkeypatch.setenv(KERNEL_ID, "k")
    monkeypatch.setenv(
        DEVICES,
        '[{"ordinal": 0, "index": 0, "uuid": "GPU-a", "cap": 1073741824, "max_cap": 2147483648, "total": 17179869184}]',
    )
    monkeypatch.delenv(USER_STARTUP, raising=False)
    monkeypatch.setenv("PYTHONSTARTUP", "")  # restored after the test (the bootstrap unsets it)
    from gpu_quota_ext.kernel import torch_cap

    monkeypatch.setattr(torch_cap, "installed_torch_version", lambda: None)  # leaves PYTORCH_*ALLOC_CONF alone

    bootstrap.run({})  # must not raise

    problems = state_module.STATE.problems
    assert len(problems) == 1, problems
    assert problems[0].startswith("torch 2.13.0+fake has no torch.cuda._lazy_call (a private torch API)")
    assert "Traceback" not in problems[0] and "\n" not in problems[0]


def test_the_calls_registered_for_the_first_cuda_use_run_before_the_caps_are_put_in_force(monkeypatch):
    from gpu_quota_ext.kernel import torch_cap
    from gpu_quota_ext.kernel.state import DeviceCap, KernelCapState

    from .fake_torch import fake_torch

    order = []
    module = fake_torch(1 << 34)
    module.cuda.is_initialized = lambda: True  # CUDA in use already: the hook applies at once
    monkeypatch.setitem(sys.modules, "torch", module)
    monkeypatch.setattr(torch_cap, "apply_current_caps", lambda torch, state: order.append("caps"))
    state = KernelCapState(kernel_id="k", devices=[DeviceCap(0, 0, "GPU-a", 1 << 30, 1 << 31, 1 << 34)])
    state.before_cuda.append(lambda: order.append("sync"))
    state.before_cuda.append(lambda: 1 / 0)  # a failing call is said, and the caps still go in force
    torch_cap.install_lazy_hook(state)
    assert order == ["sync", "caps"]
    assert any("before CUDA start: ZeroDivisionError" in p for p in state.problems)
