"""Cap changes inside the kernel: the server's answer becomes the kernel's record, the record reaches
torch (now, or at first CUDA use through the lazy hook) and the environment of future child processes.
A fake torch records what would reach the GPU; a fake client plays the server."""

from __future__ import annotations

import contextlib
import copy
import io
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from gpu_quota_ext.kernel import torch_cap
from gpu_quota_ext.kernel.client import CapAnswer
from gpu_quota_ext.kernel.magic import GpuCap, format_table
from gpu_quota_ext.kernel.state import DeviceCap, KernelCapState
from gpu_quota_ext.kernel.torch_cap import merge_alloc_conf
from gpu_quota_ext.shared.sizes import GiB

from .fake_torch import fake_torch
from .fakes import OfflineClient

TOTAL = 80 * GiB


class FakeClient(OfflineClient):
    """Answers like the server: grants up to max_cap (clamps above), or refuses when told to."""

    def __init__(self, max_cap=40 * GiB, refuse=False):
        super().__init__()
        self.max_cap, self.refuse, self.calls = max_cap, refuse, []

    def request_cap(self, cap_text, device_index=None):
        from gpu_quota_ext.shared.sizes import parse_cap

        self.calls.append((cap_text, device_index))
        wanted = parse_cap(cap_text).to_bytes(TOTAL)
        if wanted > self.max_cap and self.refuse:
            return CapAnswer("refused", "above your max_cap of 40.0 GiB", status=409)
        cap = min(wanted, self.max_cap)
        indexes = [device_index] if device_index is not None else [2, 5]
        devices = [{"index": i, "cap": cap, "max_cap": self.max_cap, "policy_cap": 20 * GiB} for i in indexes]
        return CapAnswer("clamped" if wanted > self.max_cap else "granted", "ok", devices, "kernel request", 200)

    def reset(self):
        self.calls.append(("reset", None))
        devices = [{"index": i, "cap": 20 * GiB, "max_cap": self.max_cap, "policy_cap": 20 * GiB} for i in (2, 5)]
        return CapAnswer("granted", "cap reset", devices, "default", 200)

    def report_usage(self, devices):
        self.calls.append(("usage", devices))


class FakeShell:
    pass


def two_device_state() -> KernelCapState:
    return KernelCapState(
        kernel_id="k1",
        devices=[
            DeviceCap(0, 2, "GPU-a", 20 * GiB, 40 * GiB, TOTAL),
            DeviceCap(1, 5, "GPU-b", 20 * GiB, 40 * GiB, TOTAL),
        ],
    )


@pytest.fixture
def env(monkeypatch):
    """The kernel's environment as the bootstrap left it, with a torch that reads the fraction from it."""
    monkeypatch.setattr("gpu_quota_ext.kernel.torch_cap.installed_torch_version", lambda: "2.13.0")
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,per_process_memory_fraction:0.25"}


def magic_for(state, client, env) -> GpuCap:
    return GpuCap(FakeShell(), state, client, env=env)


@pytest.fixture
def torch(monkeypatch):
    module = fake_torch(TOTAL - GiB, TOTAL - GiB)  # torch's totals are a little below NVML's
    monkeypatch.setitem(sys.modules, "torch", module)
    return module


def test_granted_cap_before_cuda_starts_is_what_the_lazy_hook_applies(torch, env, capsys):
    state = two_device_state()
    torch_cap.install_lazy_hook(state)  # queued with the start caps (20 GiB)
    magic = magic_for(state, FakeClient(), env)
    magic.magic("0.3")
    assert state.caps_by_ordinal() == [int(0.3 * TOTAL)] * 2
    assert torch.cuda.fractions == {} and torch.cuda.context_calls == 0  # nothing touched CUDA yet
    torch.cuda.init()
    assert torch.cuda.fractions == {o: pytest.approx(int(0.3 * TOTAL) / (TOTAL - GiB)) for o in (0, 1)}
    out = capsys.readouterr().out
    assert "granted" in out and "applies at its first use" in out
    # Child processes get the new cap, raised above the old fraction; the user's other options stay.
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,per_process_memory_fraction:0.300000"


def test_cap_change_with_cuda_running_applies_at_once_and_frees_the_cache_when_lowering(torch, env, capsys):
    torch.cuda.init()
    torch.cuda.reserved[0] = 30 * GiB  # held above what will be granted
    state = two_device_state()
    for device in state.devices:
        device.cap = 40 * GiB
    magic_for(state, FakeClient(), env).magic("0.25")
    assert torch.cuda.cache_emptied == 1
    assert torch.cuda.fractions[0] == pytest.approx(20 * GiB / (TOTAL - GiB))
    out = capsys.readouterr().out
    assert "cuda:0 still holds 30.0 GiB" in out and "existing tensors are kept" in out
    assert "cuda:1 still holds" not in out


def test_device_option_sends_the_server_index_and_changes_one_device(torch, env):
    state = two_device_state()
    client = FakeClient()
    magic_for(state, client, env).magic("--device 1 8GiB")
    assert client.calls == [("8GiB", 5)]
    assert state.caps_by_ordinal() == [20 * GiB, 8 * GiB]


def test_clamped_and_refused(torch, env, capsys):
    state = two_device_state()
    magic_for(state, FakeClient(), env).magic("0.9")
    assert state.caps_by_ordinal() == [40 * GiB] * 2
    assert state.cap_source == "%gpucap, clamped by the server"
    capsys.readouterr()
    magic_for(state, FakeClient(refuse=True), env).magic("0.9")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("gpu-quota: error: refused by the server: above your max_cap")
    assert state.caps_by_ordinal() == [40 * GiB] * 2


def test_reset_takes_the_servers_caps_and_source(torch, env):
    state = two_device_state()
    magic = magic_for(state, FakeClient(), env)
    magic.magic("12GiB")
    magic.magic("reset")
    assert state.caps_by_ordinal() == [20 * GiB] * 2
    assert state.cap_source == "server policy (default)"


def refused(line: str) -> bool:
    from gpu_quota_ext.kernel.command import CommandError, parse_command

    try:
        parse_command(line, [0, 1])
    except CommandError:
        return True
    return False


# Lines the parser refuses (the lines it accepts are the tests above): every example is a refusal to check.
REFUSED_LINES = st.one_of(
    st.lists(
        st.sampled_from(["--device", "7", "-1", "abc", "1.5", "0", "999TiB", "--cells", "x", "reset", '"']),
        min_size=1,
        max_size=4,
    ).map(" ".join),
    st.text(min_size=1, max_size=30),
).filter(refused)


@settings(max_examples=200, deadline=None)
@given(REFUSED_LINES)
def test_a_rejected_line_changes_nothing_and_asks_nobody(line):
    state = two_device_state()
    before = copy.deepcopy(state)
    client = FakeClient()
    environ: dict = {}
    magic = magic_for(state, client, environ)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(UsageError) as refusal:
        magic.magic(line)
    assert state == before and client.calls == [] and environ == {} and not magic.cells.enabled
    # The refusal is IPython's usage error (IPython prints it as one line and fails the cell), nothing printed.
    assert out.getvalue() == err.getvalue() == "" and str(refusal.value) and "\n" not in str(refusal.value)


def test_table_before_cuda_starts(torch, env):
    table = format_table(two_device_state(), {})
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["device", "cap", "allocated"]
    assert lines[1].split()[:6] == ["cuda:0", "(server", "GPU", "2)", "20.0", "GiB"]
    assert "'-' until this kernel's torch uses CUDA" in table
    assert "you may ask for up to 40.0 GiB per device" in table


def test_the_lazy_hook_reads_caps_when_it_runs_not_when_it_is_installed(torch):
    state = two_device_state()
    torch_cap.install_lazy_hook(state)
    torch_cap.install_lazy_hook(state)  # once per kernel
    assert len(torch.cuda.queued) == 1
    state.devices[0].cap = 10 * GiB
    torch.cuda.init()
    assert torch.cuda.fractions[0] == pytest.approx(10 * GiB / (TOTAL - GiB))


def test_merge_alloc_conf_raises_only_when_asked():
    assert merge_alloc_conf("per_process_memory_fraction:0.2", 0.3) == "per_process_memory_fraction:0.200000"
    assert (
        merge_alloc_conf("per_process_memory_fraction:0.2", 0.3, tighten_only=False)
        == "per_process_memory_fraction:0.300000"
    )
