"""Which wall an OOM hit, the kernel's cap or the device itself, decided by numbers: torch writes "allowed;" in
every OOM once a per-process fraction is set, whichever wall refused."""

from __future__ import annotations

import io
import types

import pytest

from gpu_quota_ext.kernel import oom
from gpu_quota_ext.kernel.oom import CAP, DEVICE, explain_after_cell, explain_oom, read_oom, which_wall
from gpu_quota_ext.kernel.state import DeviceCap, KernelCapState
from gpu_quota_ext.shared.sizes import GiB

from .fake_torch import fake_torch

AT_CAP = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.19 GiB of which 60.00 GiB "
          "is free. Including non-PyTorch memory, this process has 10.30 GiB memory in use. 9.90 GiB allowed; Of the "
          "allocated memory 9.50 GiB is allocated by PyTorch, and 300.00 MiB is reserved by PyTorch but unallocated.")
# Issue 28's case: caps 0.3 of an H200, three idle kernels hold 0.27 each, a fourth asks for 0.27 under its cap.
FULL_UNDER_CAP = (
    "CUDA out of memory. Tried to allocate 37.74 GiB. GPU 0 has a total capacity of 139.80 GiB of which 25.12 GiB is "
    "free. Including non-PyTorch memory, this process has 530.00 MiB memory in use. 42.10 GiB allowed; Of the "
    "allocated memory 0 bytes is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated."
)
DEVICE_FULL = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.00 GiB is free."
)


def test_the_numbers_of_a_message_are_read_in_bytes():
    facts = read_oom(FULL_UNDER_CAP)
    assert facts.ordinal == 0
    assert facts.request == int(37.74 * GiB)
    assert facts.free == int(25.12 * GiB)
    assert facts.allowed == int(42.10 * GiB)
    assert read_oom("CUDA out of memory. Tried to allocate 512.00 KiB.").request == 512 * 1024
    assert read_oom("cudaMallocAsync: out of memory") == oom.OomFacts()


@pytest.mark.parametrize(
    "request_, cap, reserved, wall",
    [
        (2 * GiB, 10 * GiB, int(9.8 * GiB), CAP),  # reserved + request passes the cap
        (37 * GiB, 42 * GiB, 0, DEVICE),  # well under the cap: the device refused, "allowed;" or not
        (10 * GiB, 10 * GiB, 0, DEVICE),  # exactly the cap fits it
        (10 * GiB + 1, 10 * GiB, 0, CAP),
        (2 * GiB, None, 5 * GiB, DEVICE),  # no cap: only the device can refuse
        (None, 10 * GiB, 10 * GiB, CAP),  # no request in the text: a kernel at its cap hit it
        (None, 10 * GiB, 2 * GiB, DEVICE),
        (30 * GiB, 20 * GiB, None, CAP),  # no reading: the request alone passes the cap
        (3 * GiB, 20 * GiB, None, DEVICE),
    ],
)
def test_which_wall_is_a_matter_of_numbers(request_, cap, reserved, wall):
    assert which_wall(request_, cap, reserved) == wall


def test_cap_hit_names_the_cap_what_is_reserved_and_what_was_asked():
    line = explain_oom(AT_CAP, caps={1: 10 * GiB}, reserved={1: int(9.8 * GiB)})
    assert line == (
        "gpu-quota: your GPU quota on cuda:1 was the limit: 10.0 GiB allowed, this kernel reserves 9.8 GiB and asked "
        "for 2.0 GiB more; `%gpucap` shows details, `torch.cuda.empty_cache()` or freeing tensors helps"
    )


def test_cap_hit_without_our_record_uses_torchs_figure():
    line = explain_oom(AT_CAP, caps={}, reserved={1: int(9.8 * GiB)})
    assert line.startswith("gpu-quota: your GPU quota on cuda:1 was the limit: 9.9 GiB allowed")


def test_a_full_device_under_the_cap_is_the_device_though_torch_says_allowed():
    line = explain_oom(FULL_UNDER_CAP, caps={0: int(42.1 * GiB)}, reserved={0: 0})
    assert line.startswith("gpu-quota: cuda:0 itself is full (25.1 GiB free for 37.7 GiB more)")
    assert "your quota there is 42.1 GiB, 0 B of it reserved: the quota was not the limit" in line
    assert "allowed by your GPU quota" not in line


def test_device_full_says_other_processes_hold_the_rest():
    line = explain_oom(DEVICE_FULL, caps={0: 20 * GiB}, reserved={0: GiB})
    assert "cuda:0 itself is full (1.0 GiB free for 2.0 GiB more): other processes hold the rest" in line
    assert "your quota there is 20.0 GiB, 1.0 GiB of it reserved" in line
    assert "\n" not in line


def test_hook_speaks_only_for_torch_oom_and_asks_for_room_only_for_the_device(monkeypatch):
    torch = fake_torch(80 * GiB)
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    asked = []
    monkeypatch.setattr(oom, "ask_for_room", lambda ordinal, state, stream=None: asked.append(ordinal))
    state = KernelCapState(kernel_id="k", devices=[DeviceCap(0, 3, "GPU-x", 20 * GiB, 40 * GiB, 80 * GiB)])
    stream = io.StringIO()
    result = types.SimpleNamespace(error_in_exec=torch.OutOfMemoryError(DEVICE_FULL))
    assert explain_after_cell(result, state, stream) == stream.getvalue().strip()
    assert "itself is full" in stream.getvalue()
    assert asked == [0]
    at_cap = "CUDA out of memory. Tried to allocate 30.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 60 " \
             "GiB is free. 20.00 GiB allowed;"
    stream = io.StringIO()
    assert "was the limit" in explain_after_cell(
        types.SimpleNamespace(error_in_exec=torch.OutOfMemoryError(at_cap)), state, stream
    )
    assert asked == [0]  # the cap was the wall: nothing to ask for
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
