"""What %gpucap says about a kernel's layers (soft cap, hard limit through MPS, or why none): from the
variable the launch hook sets, with no server."""

import json

from gpu_quota_ext.kernel.layers import layer_line, read_layers, restart_note
from gpu_quota_ext.kernel.state import DeviceCap, KernelCapState
from gpu_quota_ext.shared.sizes import GiB

TOTAL = 80 * GiB


def state(*caps):
    return KernelCapState(
        kernel_id="k",
        devices=[
            DeviceCap(ordinal=i, index=i + 2, uuid=f"GPU-{i}", cap=c, max_cap=40 * GiB, total=TOTAL)
            for i, c in enumerate(caps)
        ],
    )


def hard(*usable):
    devices = [{"ordinal": i, "index": i + 2, "limit": u + (640 << 20), "usable": u} for i, u in enumerate(usable)]
    return {"GPU_QUOTA_LAYERS": json.dumps({"hard": "mps", "reason": None, "number": "cap", "devices": devices})}


def test_hard_limit_line_names_each_device_and_the_context():
    line = layer_line(state(20 * GiB, 20 * GiB), hard(40 * GiB, 30 * GiB))
    assert line.startswith("layers: soft cap + hard limit (NVIDIA MPS)")
    assert "40.0 GiB on cuda:0, 30.0 GiB on cuda:1" in line and "CUDA context" in line


def test_soft_only_says_why():
    env = {
        "GPU_QUOTA_LAYERS": json.dumps(
            {"hard": None, "reason": "the MPS server runs for another Unix user (uid 0)", "devices": []}
        )
    }
    assert (
        layer_line(state(20 * GiB), env)
        == "layers: soft cap only, no hard limit: the MPS server runs for another Unix user (uid 0)"
    )
    assert "hard_cap, is off" in layer_line(state(20 * GiB), {})
    assert "unreadable GPU_QUOTA_LAYERS" in layer_line(state(20 * GiB), {"GPU_QUOTA_LAYERS": "{not json"})
    assert read_layers({"GPU_QUOTA_LAYERS": "[1]"})["reason"] == "unreadable GPU_QUOTA_LAYERS"


def test_no_line_without_a_server_or_a_gpu():
    assert layer_line(KernelCapState(), hard(10 * GiB)) is None
    assert layer_line(KernelCapState(kernel_id="k"), hard(10 * GiB)) is None


def test_a_raise_above_the_hard_limit_waits_for_a_restart():
    env = hard(20 * GiB)
    assert restart_note(state(20 * GiB), env) is None  # at the limit: nothing waits
    note = restart_note(state(30 * GiB), env)
    assert "stays 20.0 GiB on cuda:0" in note and "next restart" in note
    assert restart_note(state(30 * GiB), {}) is None  # no hard layer: the soft cap moves at once
