"""`%gpucap`, the usage panel, OOM explanations and the per-cell report, in real kernels started by a
real jupyter_server (pytest-jupyter) through POST /api/kernels, as a notebook user would see them.

CI has no GPU and a CPU-only torch: the static inventory gives each kernel an 80 GiB device on paper,
so every cap decision is real (ledger, REST, kernel state, environment) while CUDA never starts.
"""

from __future__ import annotations

import json
import os
import re
from typing import List

import pytest
from tornado.httpclient import HTTPClientError
from traitlets.config import Config

from gpu_quota_ext.kernel.magic import NO_SERVER
from gpu_quota_ext.shared.contract import KERNEL_TOKEN_HEADER as TOKEN_HEADER  # noqa: E402
from gpu_quota_ext.shared.sizes import GiB

from ..kernel_transport import short_directory
from .cell_output import CellOutput, run_cell
from .fake_gpu import wait_for
from .kernels import (
    execute,
    restart_kernel,
    start_kernel,
    static_devices_config,
)
from .servers import serving

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours the inspector's headings

DEVICE_TOTAL = 80 * GiB


@pytest.fixture
def jp_server_config():
    return Config(static_devices_config("80GiB", "80GiB", default_cap="0.25", max_cap="0.5"))


@pytest.fixture(scope="module")
def shared(short_tmp):
    """One server (the same config) and one kernel for the checks that leave its caps as they were:
    `%gpucap`'s table, its help, refused lines, the CPU-only panel, OOM explanations."""
    config = static_devices_config("80GiB", "80GiB", default_cap="0.25", max_cap="0.5")
    with serving(short_directory(short_tmp), config) as server:
        yield server, server.start_kernel()


async def ledger_record(jp_fetch, kernel_id: str) -> dict:
    response = await jp_fetch("api", "gpu-quota", "kernels", kernel_id)
    return json.loads(response.body)


async def put_cap(jp_fetch, kernel_id: str, token: str, body: dict):
    return await jp_fetch(
        "api", "gpu-quota", "kernels", kernel_id, method="PUT", body=json.dumps(body), headers={TOKEN_HEADER: token}
    )


def caps_of(record: dict) -> List[int]:
    return [d["cap"] for d in record["devices"]]


def assert_usage_error(out: CellOutput) -> str:
    """An argument %gpucap cannot read: IPython's usage error, as its own magics give: the cell's status is
    "error" (a notebook run stops there), one line "UsageError: ..." on stderr, no traceback."""
    assert out.status == "error", out
    assert out.stdout == "" and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("UsageError: "), out
    return lines[0]


def assert_one_error_line(out: CellOutput) -> str:
    """A request the server refused, or one that failed: the cell succeeds, no traceback, exactly one line on
    stderr, nothing on stdout."""
    assert out.status == "ok", out
    assert out.errors == []
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("gpu-quota: error: "), lines
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout
    return lines[0]


# --- the magic is there, and shows the kernel's caps -----------------------------------------------


def test_gpucap_exists_without_load_ext_and_shows_the_table(shared):
    server, kernel_id = shared
    out = server.run(kernel_id, "%gpucap")
    header = out.splitlines()[0]
    for column in ("device", "cap", "allocated", "reserved", "peak", "device total", "cap set by"):
        assert column in header
    row = out.splitlines()[1]
    assert row.startswith("cuda:0 (server GPU ")
    assert "20.0 GiB" in row  # 0.25 of 80 GiB
    assert "80.0 GiB" in row
    assert "the server, at kernel start" in row
    assert "you may ask for up to 40.0 GiB" in out  # max_cap 0.5
    assert "no server" not in out


# --- cap changes go through the server's ledger ------------------------------------------------------


async def test_granted_cap_is_recorded_applied_to_the_env_and_survives_restart(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    before = await ledger_record(jp_fetch, kernel_id)
    assert caps_of(before) == [int(0.25 * DEVICE_TOTAL)]

    out = await execute(jp_serverapp, kernel_id, "%gpucap 0.3")
    assert "gpu-quota: granted" in out
    assert "cap now 24.0 GiB on cuda:0" in out
    # CUDA never started here, so the lazy hook applies the recorded cap later.
    assert "applies at its first use" in out

    record = await ledger_record(jp_fetch, kernel_id)
    assert caps_of(record) == [int(0.3 * DEVICE_TOTAL)]
    assert record["source"] == "kernel request"

    # The kernel's own record (what the lazy hook applies at first CUDA use) and its child env.
    state = await execute(
        jp_serverapp,
        kernel_id,
        "from gpu_quota_ext.kernel import state; import os\n"
        "print(state.STATE.caps_by_ordinal()); print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))",
    )
    caps_line, conf_line = state.strip().splitlines()[-2:]
    assert caps_line == str([int(0.3 * DEVICE_TOTAL)])
    assert "per_process_memory_fraction:0.299999" in conf_line or "per_process_memory_fraction:0.300000" in conf_line

    await restart_kernel(jp_fetch, kernel_id)
    assert caps_of(await ledger_record(jp_fetch, kernel_id)) == [int(0.3 * DEVICE_TOTAL)]
    after_restart = await execute(jp_serverapp, kernel_id, "%gpucap")
    assert "24.0 GiB" in after_restart.splitlines()[1]
    assert "kernel request" in after_restart  # who set the cap survives the restart too


async def test_request_above_max_cap_is_clamped(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    out = await execute(jp_serverapp, kernel_id, "%gpucap 90%")
    assert "gpu-quota: clamped" in out
    assert "cap now 40.0 GiB on cuda:0" in out
    assert caps_of(await ledger_record(jp_fetch, kernel_id)) == [int(0.5 * DEVICE_TOTAL)]


async def test_reset_returns_to_the_policy_cap(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "%gpucap 12GiB")
    assert caps_of(await ledger_record(jp_fetch, kernel_id)) == [12 * GiB]
    out = await execute(jp_serverapp, kernel_id, "%gpucap reset")
    assert "cap now 20.0 GiB on cuda:0" in out
    assert caps_of(await ledger_record(jp_fetch, kernel_id)) == [int(0.25 * DEVICE_TOTAL)]


class TestRefuse:
    @pytest.fixture
    def jp_server_config(self):
        return Config(static_devices_config("80GiB", default_cap="0.25", max_cap="0.5", on_over_max="refuse"))

    async def test_request_above_max_cap_is_refused_and_nothing_changes(self, jp_fetch, jp_serverapp):
        kernel_id = await start_kernel(jp_fetch)
        out = await run_cell(jp_serverapp, kernel_id, "%gpucap 0.9")
        line = assert_one_error_line(out)
        assert "refused by the server" in line and "max_cap" in line
        assert "caps unchanged (20.0 GiB on cuda:0)" in line
        assert caps_of(await ledger_record(jp_fetch, kernel_id)) == [int(0.25 * DEVICE_TOTAL)]
        table = await execute(jp_serverapp, kernel_id, "%gpucap")
        assert "20.0 GiB" in table.splitlines()[1]


async def test_a_cap_set_from_outside_the_kernel_reaches_it_after_its_next_cell(jp_fetch, jp_serverapp):
    # The sidebar (or an admin script) changes the cap through the API with the server's own token.
    kernel_id = await start_kernel(jp_fetch)
    answer = await jp_fetch("api", "gpu-quota", "kernels", kernel_id, method="PUT", body=json.dumps({"cap": "0.4"}))
    assert json.loads(answer.body)["kernel"]["source"] == "user request"
    await execute(jp_serverapp, kernel_id, "x = 1")  # any cell: after it, the kernel checks its grant
    seen = await execute(
        jp_serverapp,
        kernel_id,
        "import os, time\n"
        "from gpu_quota_ext.kernel.state import STATE\n"
        "deadline = time.monotonic() + 30\n"
        "while STATE.devices[0].cap == %d and time.monotonic() < deadline:  # the background check's answer\n"
        "    time.sleep(0.02)\n"
        "print(STATE.devices[0].cap, os.environ['PYTORCH_CUDA_ALLOC_CONF'])" % int(0.25 * DEVICE_TOTAL),
    )
    cap, conf = seen.split()
    assert int(cap) == int(0.4 * DEVICE_TOTAL)
    assert conf == "per_process_memory_fraction:0.400000"
    assert "user request" in await execute(jp_serverapp, kernel_id, "%gpucap")


# --- one kernel's secret cannot change another kernel's cap ------------------------------------------


async def test_forged_or_foreign_secret_is_refused_through_the_api(jp_fetch, jp_serverapp):
    kernel_a = await start_kernel(jp_fetch)
    kernel_b = await start_kernel(jp_fetch)
    token_b = (await execute(jp_serverapp, kernel_b, "from gpu_quota_ext.kernel.state import STATE; "
        "print(STATE.token)")).strip()
    assert token_b

    for token in ("forged-secret", token_b):
        with pytest.raises(HTTPClientError) as refused:
            await put_cap(jp_fetch, kernel_a, token, {"cap": "0.4"})
        assert refused.value.code == 403
    assert caps_of(await ledger_record(jp_fetch, kernel_a)) == [int(0.25 * DEVICE_TOTAL)]

    # The right secret for the right kernel works: the 403s above were about the secret.
    response = await put_cap(jp_fetch, kernel_b, token_b, {"cap": "0.4"})
    assert json.loads(response.body)["outcome"] == "granted"


async def test_kernel_start_loads_only_a_stand_in_until_first_use(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    loaded = (
        "import sys; print(sorted(m for m in ('gpu_quota_ext.kernel.magic', 'gpu_quota_ext.kernel.client', "
        "'gpu_quota_ext.kernel.panel', 'urllib.request') if m in sys.modules))"
    )
    assert (await execute(jp_serverapp, kernel_id, loaded)).strip() == "[]"
    table = await execute(jp_serverapp, kernel_id, "%gpucap")
    assert "20.0 GiB" in table
    assert "gpu_quota_ext.kernel.magic" in await execute(jp_serverapp, kernel_id, loaded)


async def test_forged_or_foreign_secret_is_refused_through_the_magic(jp_fetch, jp_serverapp):
    kernel_a = await start_kernel(jp_fetch)
    kernel_b = await start_kernel(jp_fetch)
    token_b = (
        await execute(jp_serverapp, kernel_b, "from gpu_quota_ext.kernel.state import STATE; print(STATE.token)")
    ).strip()
    for kernel_id in (kernel_a, kernel_b):
        await execute(jp_serverapp, kernel_id, "%gpucap")  # loads the full magic (kernel start has a stand-in)
    # Kernel B's magic aimed at kernel A: B's own secret is not A's.
    out = await run_cell(
        jp_serverapp,
        kernel_b,
        f"from gpu_quota_ext.kernel import magic\nmagic._loaded[0].client.kernel_id = {kernel_a!r}\n%gpucap 0.4",
    )
    line = assert_one_error_line(out)
    assert "(403)" in line
    assert token_b not in out.stdout + out.stderr
    # And a forged secret in kernel A's own magic.
    out = await run_cell(
        jp_serverapp,
        kernel_a,
        "from gpu_quota_ext.kernel import magic\nmagic._loaded[0].client._token = 'forged'\n%gpucap 0.4",
    )
    assert "(403)" in assert_one_error_line(out)
    assert caps_of(await ledger_record(jp_fetch, kernel_a)) == [int(0.25 * DEVICE_TOTAL)]


# --- bad input: one line, no traceback, nothing changes ----------------------------------------------


@pytest.mark.parametrize(
    "line, says",
    [
        ("abc", "is not a cap"),
        ("1.5", "at most 1"),
        ("-1", "is not a cap"),
        ("0", "above 0"),
        ("999TiB", "larger than any GPU"),
        ("--device 7 0.3", "no cuda:7"),
        ("0.3 0.4", "unrecognized arguments"),
    ],
)
def test_bad_input_is_a_usage_error_and_changes_nothing(shared, line, says):
    server, kernel_id = shared
    out = server.cell(kernel_id, f"%gpucap {line}")
    assert says in assert_usage_error(out)
    assert caps_of(server.api(f"/api/gpu-quota/kernels/{kernel_id}")) == [int(0.25 * DEVICE_TOTAL)]
    state = server.run(kernel_id, "from gpu_quota_ext.kernel import state; print(state.STATE.caps_by_ordinal())")
    assert state.strip() == str([int(0.25 * DEVICE_TOTAL)])


@pytest.mark.parametrize("line", ["--help", "help", "-h"])
def test_help(shared, line):
    server, kernel_id = shared
    out = server.cell(kernel_id, f"%gpucap {line}")
    assert out.status == "ok" and out.errors == [] and out.stderr == ""
    assert "%gpucap --device 1 8GiB" in out.stdout
    assert "--cells" in out.stdout


def test_the_question_mark_shows_the_magics_docstring(shared):
    # What JupyterLab's pager shows for `%gpucap?`: the reply's payload, not the cell's output.
    server, kernel_id = shared
    out = server.cell(kernel_id, "%gpucap?")
    assert out.status == "ok" and len(out.pages) == 1, out
    page = ANSI.sub("", out.pages[0])
    assert "<no docstring>" not in page
    assert "%gpucap [CAP | reset | panel | park | resume | help]" in page, page
    assert "%gpucap --device 1 8GiB" in page and "%gpucap help" in page


# --- the usage panel ----------------------------------------------------------------------------------


def widget_models(out: CellOutput) -> dict:
    """comm id -> the widget model's state as the browser ends up with it (comm_open, then updates)."""
    models: dict = {}
    for message in out.messages:
        content = message["content"]
        if message["msg_type"] == "comm_open" and content.get("target_name") == "jupyter.widget":
            models[content["comm_id"]] = dict(content["data"]["state"])
        elif message["msg_type"] == "comm_msg" and content["data"].get("method") == "update":
            models.setdefault(content["comm_id"], {}).update(content["data"]["state"])
    return models


def test_panel_with_a_cpu_only_torch_shows_the_grant_and_why_usage_is_not_available(shared):
    # The simulated demo's case: the kernel holds a grant, its torch is a CPU build.
    server, kernel_id = shared
    out = server.cell(kernel_id, "import torch\n%gpucap panel")
    assert out.status == "ok" and out.errors == [], out
    models = widget_models(out)
    html = " ".join(m["value"] for m in models.values() if m.get("_model_name") == "HTMLModel")
    assert "usage not available: this kernel&#x27;s torch" in html and "built without CUDA" in html, html
    assert "cuda:0 (server GPU " in html  # the grant's row
    assert "cap 20.0 GiB · device 80.0 GiB · cap set by the server, at kernel start" in html, html
    shown = [m["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] for m in out.comm("display_data")]
    assert len(shown) == 1 and models[shown[0]]["_model_name"] == "VBoxModel"
    table = server.run(kernel_id, "%gpucap")
    assert "allocated/reserved/peak: not available: this kernel's torch" in table and "built without CUDA" in table
    assert "20.0 GiB" in table.splitlines()[1]


THREADS = (
    "import threading; print(sum(1 for t in threading.enumerate() if t.name == 'gpu-quota-panel'), "
    "threading.active_count())"
)


@pytest.mark.slow
async def test_thirty_panels_leave_one_thread_and_a_closed_panel_none(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "%gpucap")  # the full magic loaded: its own imports are not counted
    before_panels, before_all = map(int, (await execute(jp_serverapp, kernel_id, THREADS)).split())
    assert before_panels == 0
    for _ in range(30):
        out = await run_cell(jp_serverapp, kernel_id, "%gpucap panel")
        assert out.status == "ok" and out.comm("display_data"), out
    panels, threads = map(int, (await execute(jp_serverapp, kernel_id, THREADS)).split())
    assert panels == 1 and threads == before_all + 1, (panels, threads, before_all)
    # The panel the user sees is the newest; closing its widget (the browser's close, or this) stops it.
    closed = await execute(
        jp_serverapp,
        kernel_id,
        "from gpu_quota_ext.kernel import magic\n"
        "panel = magic._loaded[0].panels[-1]\n"
        "panel.widget.close()\n"
        "panel._thread.join(timeout=10)\n"
        "print(panel.running)",
    )
    assert closed.strip() == "False"
    panels, threads = map(int, (await execute(jp_serverapp, kernel_id, THREADS)).split())
    assert (panels, threads) == (0, before_all)


async def test_panel_thread_updates_widgets_while_a_cell_runs_and_stops_on_close(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    # CUDA cannot start here: feed the panel fake allocator readings to see its thread at work.
    out = await run_cell(
        jp_serverapp,
        kernel_id,
        "import time\n"
        "from gpu_quota_ext.kernel import panel as panel_module\n"
        "from gpu_quota_ext.kernel.usage import DeviceUsage\n"
        "from gpu_quota_ext.kernel.panel import GpuUsagePanel\n"
        "reading = {'allocated': 0}\n"
        "panel_module.read_usage = lambda ordinals=None: {0: DeviceUsage(0, reading['allocated'], 8 << 30, 9 << 30, 0, "
        "80 << 30)}\n"
        "p = GpuUsagePanel(interval=0.1)\n"
        "display(p)\n"
        "def shown(step):\n"
        "    return any(f'allocated {step}.0 GiB' in row.children[-1].value for row in p.rows.children)\n"
        # Up to 6: a reading is on show before its update is sent; 6 on show means 5's update went out.
        "for step in range(1, 7):\n"
        "    reading['allocated'] = step << 30\n"
        "    deadline = time.monotonic() + 30\n"
        "    while not shown(step):  # the panel's thread, not this cell, puts the reading on show\n"
        "        assert time.monotonic() < deadline, f'the panel did not show {step} GiB'\n"
        "        time.sleep(0.02)\n"
        "print(p.running)\n",
    )
    assert out.status == "ok" and out.errors == [], out
    assert out.stdout.strip() == "True"
    updates = [m["data"]["state"] for m in out.comm("comm_msg") if m["data"].get("method") == "update"]
    details = [str(u["value"]) for u in updates if "value" in u and "allocated" in str(u["value"])]
    # The loop moved allocated from 1 to 5 GiB while the cell was still running: the thread sent updates.
    assert any("allocated 3.0 GiB" in d for d in details), details
    assert any("allocated 5.0 GiB" in d for d in details), details
    closed = await run_cell(jp_serverapp, kernel_id, "p.close(); print(p.running)")
    assert closed.stdout.strip() == "False"
    assert closed.comm("comm_close")


# --- OOM explanations and the per-cell report ---------------------------------------------------------

OOM_CAP_TEXT = (
    "CUDA out of memory. Tried to allocate 30.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
    "60.00 GiB is free. Of the allocated memory 18.00 GiB is allocated by PyTorch, and 1.00 GiB is reserved "
    "by PyTorch but unallocated. 19.80 GiB allowed; 19.00 GiB reserved"
)
OOM_DEVICE_TEXT = (  # a request within the cap (torch still says "allowed;" once a fraction is set)
    "CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
    "2.00 GiB is free. Process 4242 has 70.00 GiB memory in use. 19.80 GiB allowed; Of the allocated memory "
    "0 bytes is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated."
)


def test_oom_at_the_cap_is_explained_after_the_unchanged_traceback(shared):
    server, kernel_id = shared
    out = server.cell(kernel_id, f"import torch\nraise torch.OutOfMemoryError({OOM_CAP_TEXT!r})")
    assert out.status == "error"
    assert [e["ename"] for e in out.errors] == ["OutOfMemoryError"]
    assert OOM_CAP_TEXT in out.errors[0]["evalue"]  # the original exception, unchanged
    lines = [line for line in out.stderr.splitlines() if line.startswith("gpu-quota:")]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("gpu-quota: your GPU quota on cuda:0 was the limit: 20.0 GiB allowed")
    assert "30.0 GiB more" in lines[0]
    assert "%gpucap" in lines[0] and "torch.cuda.empty_cache()" in lines[0]
    # The line comes after the traceback.
    order = [
        m["msg_type"] if m["msg_type"] == "error" else "explanation"
        for m in out.messages
        if m["msg_type"] == "error" or (m["msg_type"] == "stream" and "gpu-quota:" in m["content"]["text"])
    ]
    assert order == ["error", "explanation"]


def test_oom_of_a_full_device_says_so_and_other_errors_say_nothing(shared):
    server, kernel_id = shared
    out = server.cell(kernel_id, f"import torch\nraise torch.OutOfMemoryError({OOM_DEVICE_TEXT!r})")
    lines = [line for line in out.stderr.splitlines() if line.startswith("gpu-quota:")]
    assert len(lines) == 1, out.stderr
    assert "cuda:0 itself is full (2.0 GiB free for 3.0 GiB more): other processes hold the rest" in lines[0]
    assert "the quota was not the limit" in lines[0]
    other = server.cell(kernel_id, "raise ValueError('not memory')")
    assert other.status == "error" and other.errors[0]["ename"] == "ValueError"
    assert "gpu-quota" not in other.stderr


async def test_per_cell_report_is_opt_in(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    quiet = await run_cell(jp_serverapp, kernel_id, "x = 1")
    assert quiet.stdout == ""
    # One line, and nothing before a mistyped switch's usage error (issue 31 item 5): the report starts with
    # the next cell, so the cell that switches it on is not reported as "no GPU memory" too.
    mistyped = await run_cell(jp_serverapp, kernel_id, "%gpucap --cells yes")
    assert mistyped.stdout == "" and mistyped.stderr.startswith("UsageError: argument --cells: invalid choice: 'yes'")
    switched = await run_cell(jp_serverapp, kernel_id, "%gpucap --cells on")
    assert switched.stdout == "gpu-quota: per-cell report on, from the next cell\n" and switched.stderr == ""
    loud = await run_cell(jp_serverapp, kernel_id, "print('mine')")
    assert loud.stdout == "mine\n"  # the user's own output only: the report goes beside it (issue 31)
    assert loud.stderr.strip() == "gpu-quota: this cell used no GPU memory (CUDA not started)"
    await run_cell(jp_serverapp, kernel_id, "%gpucap --cells off")
    quiet = await run_cell(jp_serverapp, kernel_id, "x = 3")
    assert quiet.stdout == "" and quiet.stderr == ""


# --- usage reports to the server ------------------------------------------------------------------------


async def test_allocator_usage_is_reported_after_each_cell(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    # At kernel start a stand-in waits for CUDA to start before loading the reporter; CUDA cannot start
    # here, so load the full magic (its first use does) and give it fake readings, as torch would give.
    await execute(jp_serverapp, kernel_id, "%gpucap")
    await execute(
        jp_serverapp,
        kernel_id,
        "from gpu_quota_ext.kernel import usage\n"
        "usage.read_usage = lambda ordinals=None: {0: usage.DeviceUsage(0, 3 << 30, 4 << 30, 5 << 30, 5 << 30, 80 << "
        "30)}",
    )
    await execute(jp_serverapp, kernel_id, "x = 1")  # post_run_cell sends the report, off the cell's thread

    async def reported():
        device = (await ledger_record(jp_fetch, kernel_id))["devices"][0]
        return device if device.get("reported_at") else None

    device = await wait_for(reported, timeout=30)
    assert (device["allocated"], device["reserved"], device["peak"]) == (3 * GiB, 4 * GiB, 5 * GiB)


# --- a kernel no server started ------------------------------------------------------------------------


async def test_load_ext_in_a_plain_kernel_says_there_is_no_server_and_works_locally(tmp_path, short_tmp):
    from jupyter_client.manager import AsyncKernelManager

    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_QUOTA_") and k != "PYTHONSTARTUP"}
    # On IPC sockets named after its connection file, as every test's kernel (tests/kernel_transport.py).
    connection_file = short_directory(short_tmp) / "kernel-plain.json"
    manager = AsyncKernelManager(kernel_name="python3", transport="ipc", connection_file=str(connection_file))
    await manager.start_kernel(env=env, cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=60)

        async def cell(code: str) -> CellOutput:
            out = CellOutput(status="")

            def on_output(msg) -> None:
                if msg["msg_type"] == "stream":
                    if msg["content"]["name"] == "stdout":
                        out.stdout += msg["content"]["text"]
                    else:
                        out.stderr += msg["content"]["text"]
                elif msg["msg_type"] == "error":
                    out.errors.append(msg["content"])

            reply = await client.execute_interactive(code, output_hook=on_output, timeout=60)
            out.status = reply["content"]["status"]
            return out

        missing = await cell("%gpucap")
        assert "`%gpucap` not found" in missing.stderr  # not loaded: no server, no bootstrap here
        loaded = await cell("%load_ext gpu_quota_ext")
        assert loaded.stdout.strip() == NO_SERVER  # the banner, once
        table = await cell("%gpucap")
        assert NO_SERVER not in table.stdout  # not on every %gpucap
        assert (
            "no device to show yet: this kernel's torch has not started CUDA (no server started this kernel)"
            in table.stdout
        )
        local = await cell("%gpucap 0.3")
        assert NO_SERVER not in local.stdout
        assert "cap 0.3 recorded for every device by this kernel alone" in local.stdout
        state = await cell(
            "from gpu_quota_ext.kernel import state; print({k: str(v) for k, v in state.STATE.local_caps.items()})"
        )
        assert state.stdout.strip() == "{None: '0.3'}"
        bad = await cell("%gpucap abc")
        assert "'abc' is not a cap" in assert_usage_error(bad)
    finally:
        client.stop_channels()
        await manager.shutdown_kernel(now=True)


# --- what the user reads: each thing said once, and why there is no GPU ------------------------------------


def repeated_words(text: str) -> list:
    """Phrases said twice in a row: "clamped: clamped", "policy (policy)", "no GPU: no GPU: ..."."""
    found = []
    for line in text.splitlines():
        words = re.findall(r"[a-z][\w-]*|\d[\d.,]*", line.lower())  # numbers count: "20 GiB, 40 GiB" is fine
        found += [f"{a} {b}" for a, b in zip(words, words[1:]) if a == b and not a[0].isdigit()]
        segments = [segment.split() for segment in line.lower().split(": ")]
        found += [" ".join(b[:2]) for a, b in zip(segments, segments[1:]) if len(a) > 1 and a[:2] == b[:2]]
    return found


async def test_answers_say_each_thing_once(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    said = ""
    for line in ("", "0.3", "0.9", "reset", "", "--device 0 10GiB", "abc"):
        out = await run_cell(jp_serverapp, kernel_id, f"%gpucap {line}")
        said += out.stdout + out.stderr
    assert "gpu-quota: granted; cap now 24.0 GiB on cuda:0" in said
    assert "gpu-quota: clamped to max_cap 40.0 GiB on device " in said
    assert re.search(r"80\.0 GiB\s+server policy$", said, re.M), said  # after reset, not "server policy (policy)"
    assert repeated_words(said) == [], said


class TestNoGpuOnTheServer:
    @pytest.fixture
    def jp_server_config(self):
        return Config(static_devices_config())  # a server whose inventory lists no GPU

    async def test_gpucap_and_the_panel_say_why(self, jp_fetch, jp_serverapp):
        kernel_id = await start_kernel(jp_fetch)
        table = await run_cell(jp_serverapp, kernel_id, "%gpucap")
        first = table.stdout.splitlines()[0]
        assert first.startswith("gpu-quota: no GPU on this server"), table.stdout
        assert "no NVIDIA driver" in first or "may use" in first
        assert repeated_words(table.stdout) == []
        change = await run_cell(jp_serverapp, kernel_id, "%gpucap 0.3")
        assert "no GPU on this server" in assert_one_error_line(change) and "there is no cap to change" in change.stderr
        panel = await run_cell(jp_serverapp, kernel_id, "%gpucap panel")
        html = " ".join(m.get("value", "") for m in widget_models(panel).values())
        assert "no GPU on this server" in html


class TestCpuOnlyBecauseTheBudgetIsFull:
    @pytest.fixture
    def jp_server_config(self):
        return Config(static_devices_config("80GiB", default_cap="0.6", max_cap="0.6", overcommit=1.0))

    async def test_the_first_cell_and_gpucap_say_the_kernel_got_no_gpu(self, jp_fetch, jp_serverapp):
        await start_kernel(jp_fetch)  # takes 0.6 of the only device
        kernel_id = await start_kernel(jp_fetch)  # does not fit: starts CPU-only
        first = await run_cell(jp_serverapp, kernel_id, "x = 1")
        assert first.stderr.startswith(
            "gpu-quota: this kernel started without a GPU (CPU-only): no GPU has 0.6 of budget left"
        )
        second = await run_cell(jp_serverapp, kernel_id, "x = 2")
        assert second.stderr == ""  # said once
        table = await execute(jp_serverapp, kernel_id, "%gpucap")
        assert table.startswith("gpu-quota: this kernel started without a GPU (CPU-only): no GPU has 0.6")
        assert repeated_words(table) == []


async def test_a_failing_startup_is_said_in_the_notebook_not_on_the_servers_stderr(
    jp_fetch, jp_serverapp, tmp_path, monkeypatch, capfd
):
    startup = tmp_path / "startup.py"
    startup.write_text("raise NameError('in my own startup file')\n")
    monkeypatch.setenv("PYTHONSTARTUP", str(startup))
    kernel_id = await start_kernel(jp_fetch)
    first = await run_cell(jp_serverapp, kernel_id, "x = 1")
    assert (
        f"gpu-quota: problem: your PYTHONSTARTUP {startup} failed: NameError('in my own startup file')" in first.stderr
    )
    table = await execute(jp_serverapp, kernel_id, "%gpucap")
    assert "in my own startup file" in table
    # The kernel process's own stderr is this test's (inherited): nothing of ours went there.
    assert "gpu-quota" not in capfd.readouterr().err
