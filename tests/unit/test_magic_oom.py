"""Which wall an OOM hit: the kernel's cap (torch says "allowed;") or the device itself."""

from __future__ import annotations

import io
import types

from gpu_quota_ext.kernel import oom
from gpu_quota_ext.kernel.oom import explain_after_cell, explain_oom
from gpu_quota_ext.kernel.state import DeviceCap, KernelCapState
from gpu_quota_ext.policy import GiB

from .fake_torch import fake_torch

AT_CAP = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.19 GiB of which 60.00 GiB "
          "is free. Of the allocated memory 9.50 GiB is allocated by PyTorch. 9.90 GiB allowed; 9.80 GiB reserved")
DEVICE_FULL = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.00 GiB is free."
)


def test_cap_hit_names_the_cap_and_what_is_reserved():
    line = explain_oom(AT_CAP, caps={1: 10 * GiB}, reserved={1: int(9.8 * GiB)})
    assert line == (
        "gpu-quota: 10.0 GiB allowed by your GPU quota on cuda:1; 9.8 GiB reserved; "
        "`%gpucap` shows details, `torch.cuda.empty_cache()` or freeing tensors helps"
    )


def test_cap_hit_without_our_record_uses_torchs_figure():
    assert explain_oom(AT_CAP, caps={}, reserved={}).startswith(
        "gpu-quota: 9.90 GiB allowed by your GPU quota on cuda:1"
    )


def test_device_full_says_other_processes_hold_the_rest():
    line = explain_oom(DEVICE_FULL, caps={0: 20 * GiB}, reserved={0: GiB})
    assert "cuda:0 itself is full: other processes hold the rest" in line
    assert "your quota there is 20.0 GiB" in line
    assert "\n" not in line


def test_hook_speaks_only_for_torch_oom(monkeypatch):
    torch = fake_torch(80 * GiB)
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    state = KernelCapState(kernel_id="k", devices=[DeviceCap(0, 3, "GPU-x", 20 * GiB, 40 * GiB, 80 * GiB)])
    stream = io.StringIO()
    result = types.SimpleNamespace(error_in_exec=torch.OutOfMemoryError(DEVICE_FULL))
    assert explain_after_cell(result, state, stream) == stream.getvalue().strip()
    assert "itself is full" in stream.getvalue()
    stream = io.StringIO()
    assert (
        explain_after_cell(types.SimpleNamespace(error_in_exec=RuntimeError("CUDA out of memory")), state, stream)
        is None
    )
    assert explain_after_cell(types.SimpleNamespace(error_in_exec=None), state, stream) is None
    assert stream.getvalue() == ""


def test_without_torch_imported_nothing_is_an_oom(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "torch", raising=False)
    assert not oom.is_torch_oom(RuntimeError("x"))
