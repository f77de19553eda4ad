"""`%gpucap`, OOM explanations and the usage panel on a real GPU, in kernels a real jupyter_server started.

Run on a machine with an NVIDIA GPU, CUDA torch and nvidia-ml-py (tests/gpu/run_on_device.sh does):

    python -m pytest tests/gpu -m gpu -s -k magic

`-s` shows the measured figures ("FIGURE magic: ..." lines; also in $GPU_QUOTA_FIGURES when set).
"""

from __future__ import annotations

import ast
import json

import pytest
from traitlets.config import Config

from gpu_quota_ext.shared.sizes import format_bytes

from ..integration.cell_output import run_cell
from ..integration.kernels import start_kernel
from .conftest import record

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),  # asks the driver; no context
]


@pytest.fixture
def jp_server_config():
    # The real inventory (NVML): caps are fractions of the real device.
    return Config(
        {
            "ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}},
            "GpuQuota": {"default_cap": "0.2", "max_cap": "0.5", "on_over_max": "clamp"},
        }
    )


def figure(name: str, value) -> None:
    record(f"magic: {name}", value)


async def ok(serverapp, kernel_id: str, code: str):
    out = await run_cell(serverapp, kernel_id, code, timeout=120)
    assert out.status == "ok" and not out.errors, (code, out.stdout, out.stderr, out.errors)
    return out


async def kernel_caps(jp_fetch, kernel_id: str) -> list:
    response = await jp_fetch("api", "gpu-quota", "kernels", kernel_id)
    return json.loads(response.body)["devices"]


ALLOCATE_15 = "x = torch.empty(int(0.15 * total), dtype=torch.uint8, device='cuda:0')"


async def test_lowered_cap_gives_an_explained_oom_and_raising_it_lets_the_allocation_through(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    at_start = (await kernel_caps(jp_fetch, kernel_id))[0]
    await ok(jp_serverapp, kernel_id, "import torch\ntotal = torch.cuda.get_device_properties(0).total_memory")
    start_fraction = await ok(jp_serverapp, kernel_id, "print(torch.cuda.get_per_process_memory_fraction(0))")
    figure("fraction_at_first_cuda_use (default_cap 0.2)", start_fraction.stdout.strip())

    lowered = await ok(jp_serverapp, kernel_id, "%gpucap 0.1")
    assert "gpu-quota: granted" in lowered.stdout
    cap_bytes = (await kernel_caps(jp_fetch, kernel_id))[0]["cap"]
    figure("cap_after_%gpucap_0.1_bytes", cap_bytes)
    figure("ledger_record_at_kernel_start", at_start)

    oom = await run_cell(jp_serverapp, kernel_id, ALLOCATE_15, timeout=120)
    assert [e["ename"] for e in oom.errors] == ["OutOfMemoryError"], (oom.stdout, oom.stderr)
    assert "allowed;" in oom.errors[0]["evalue"]
    explanation = [line for line in oom.stderr.splitlines() if line.startswith("gpu-quota:")]
    figure("oom_torch_text", oom.errors[0]["evalue"].replace("\n", " ")[:400])
    figure("oom_explanation", explanation)
    assert len(explanation) == 1
    assert f"your GPU quota on cuda:0 was the limit: {format_bytes(cap_bytes)} allowed" in explanation[0]

    raised = await ok(jp_serverapp, kernel_id, "%gpucap 0.3")
    assert "gpu-quota: granted" in raised.stdout
    done = await ok(jp_serverapp, kernel_id, ALLOCATE_15 + "\nprint(torch.cuda.memory_reserved(0), total)")
    figure("reserved_after_0.15_allocation_and_total", done.stdout.strip())


async def test_cap_asked_for_before_cuda_starts_is_the_one_applied(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    out = await ok(jp_serverapp, kernel_id, "%gpucap 0.1")
    assert "applies at its first use" in out.stdout
    await ok(jp_serverapp, kernel_id, "import torch\ntotal = torch.cuda.get_device_properties(0).total_memory")
    fraction = await ok(jp_serverapp, kernel_id, "print(torch.cuda.get_per_process_memory_fraction(0))")
    figure("fraction_applied_lazily_after_%gpucap_0.1", fraction.stdout.strip())
    assert 0.095 < float(fraction.stdout) < 0.105
    oom = await run_cell(jp_serverapp, kernel_id, ALLOCATE_15, timeout=120)
    assert [e["ename"] for e in oom.errors] == ["OutOfMemoryError"]


async def test_request_over_max_cap_is_clamped(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    await ok(jp_serverapp, kernel_id, "import torch\ntotal = torch.cuda.get_device_properties(0).total_memory")
    out = await ok(jp_serverapp, kernel_id, "%gpucap 0.9")
    assert "gpu-quota: clamped" in out.stdout
    device = (await kernel_caps(jp_fetch, kernel_id))[0]
    assert device["cap"] == device["max_cap"]
    fraction = await ok(jp_serverapp, kernel_id, "print(torch.cuda.get_per_process_memory_fraction(0), total)")
    applied, torch_total = fraction.stdout.split()
    figure("fraction_after_clamp_to_max_cap_0.5 (of torch's total; the cap is 0.5 of NVML's)", applied)
    # The cap is bytes (0.5 of NVML's total); torch's total is ~615 MiB smaller, so its fraction is a bit above 0.5.
    assert abs(float(applied) * int(torch_total) - device["cap"]) < (1 << 20)
    over = await run_cell(
        jp_serverapp, kernel_id, "y = torch.empty(int(0.6 * total), dtype=torch.uint8, device='cuda:0')"
    )
    assert [e["ename"] for e in over.errors] == ["OutOfMemoryError"]


async def test_panel_numbers_equal_torchs_while_a_loop_allocates(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    out = await ok(
        jp_serverapp,
        kernel_id,
        "import time, torch\n"
        "from gpu_quota_ext.kernel.panel import GpuUsagePanel\n"
        "from gpu_quota_ext.shared.sizes import format_bytes\n"
        "torch.zeros(1, device='cuda:0')\n"
        "panel = GpuUsagePanel(interval=0.1)\n"
        "display(panel)\n"
        "held, pairs = [], []\n"
        "for step in range(8):\n"
        "    held.append(torch.empty(256 << 20, dtype=torch.uint8, device='cuda:0'))\n"
        "    torch.cuda.synchronize()\n"
        "    shown, deadline = f'allocated {format_bytes(torch.cuda.memory_allocated(0))}', time.monotonic() + 30\n"
        "    while shown not in panel.rows.children[0].children[-1].value:  # the panel's thread shows it\n"
        "        assert time.monotonic() < deadline, shown\n"
        "        time.sleep(0.02)\n"
        "    row = panel.view().rows[0]\n"
        "    pairs.append((row.allocated, torch.cuda.memory_allocated(0), row.reserved, torch.cuda.memory_reserved(0), "
        "row.cap))\n"
        "print(pairs)\n"
        "panel.close()\n",
    )
    pairs = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    for allocated, torch_allocated, reserved, torch_reserved, _cap in pairs:
        assert allocated == torch_allocated and reserved == torch_reserved
    figure("panel_vs_torch (allocated, torch, reserved, torch, cap)", pairs)
    # The thread pushed the same figures to the browser while the cell ran.
    details = [
        m["content"]["data"]["state"]["value"]
        for m in out.messages
        if m["msg_type"] == "comm_msg"
        and "value" in m["content"]["data"].get("state", {})
        and "allocated" in str(m["content"]["data"]["state"]["value"])
    ]
    figure("panel_updates_sent_during_the_cell", len(details))
    assert f"allocated {format_bytes(pairs[-1][0])}" in details[-1]


async def test_allocator_usage_reaches_the_server(jp_fetch, jp_serverapp):
    import asyncio

    kernel_id = await start_kernel(jp_fetch)
    out = await ok(
        jp_serverapp,
        kernel_id,
        "import torch\nx = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:0')\n"
        "print(torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0))",
    )
    allocated, reserved = map(int, out.stdout.split())
    for _ in range(50):
        device = (await kernel_caps(jp_fetch, kernel_id))[0]
        if device.get("reported_at"):
            break
        await asyncio.sleep(0.1)
    if not device.get("reported_at"):  # say why: the same report, sent in the foreground
        probe = await ok(
            jp_serverapp,
            kernel_id,
            "from gpu_quota_ext.kernel import magic, usage\nc = magic._loaded[0]\n"
            "body = {'devices': usage.usage_report(c.state, usage.read_usage())}\n"
            "print(body, c.client._send('POST', c.client.kernel_url('usage'), body, 5))",
        )
        figure("usage_probe", probe.stdout.strip())
    figure("usage_record_on_the_server", device)
    assert (device["allocated"], device["reserved"]) == (allocated, reserved)
