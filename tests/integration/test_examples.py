"""examples/01-gpu-quota-tour.ipynb runs top to bottom both ways a new user runs it, and says which.

In demo mode, as on binder and with `./run demo`: a real jupyter_server configured by
binder/jupyter_server_config.py (the demo's two simulated GPUs) starts a kernel through its REST API, so
the launch hook gives the kernel its cap, its secret and the server's address; nbclient then runs every
cell of the notebook in that kernel, and `%gpucap` talks to the server for real. Any cell error fails the
test, including in the cell tagged `raises-exception` (on a CPU machine it must not raise: only a real
GPU's out-of-memory error may).

With no server: `jupyter nbconvert --execute`, as a subprocess, in a plain kernel; the tour loads
`%gpucap` itself and every cell runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

from gpu_quota_ext.shared.sizes import format_bytes

from .kernels import start_kernel
from .test_magic import repeated_words

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "01-gpu-quota-tour.ipynb"
DEMO_CONFIG = ROOT / "binder" / "jupyter_server_config.py"


@pytest.fixture
def jp_server_config(request):
    if request.node.get_closest_marker("gpu"):
        # The machine's real GPUs through NVML, with the demo's policy.
        return Config({"ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}},
                       "GpuQuota": {"default_cap": "0.25", "max_cap": "0.5", "on_over_max": "clamp"}})
    return PyFileConfigLoader(DEMO_CONFIG.name, path=str(DEMO_CONFIG.parent)).load_config()


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


async def run_tour(jp_fetch, jp_serverapp):
    """Start a kernel through the server (the launch hook caps it), run every cell in it with nbclient."""
    kernel_id = await start_kernel(jp_fetch)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    km = jp_serverapp.kernel_manager.get_kernel(kernel_id)
    client = NotebookClient(nb, km=km, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    try:
        await client.async_execute()  # raises CellExecutionError on an error in any cell not tagged raises-exception
    finally:
        if os.environ.get("GPU_QUOTA_TOUR_OUT"):  # keep the executed notebook to read (device runs)
            nbformat.write(nb, os.environ["GPU_QUOTA_TOUR_OUT"])
    return kernel_id, nb


def oom_cell(nb):
    (cell,) = [c for c in nb.cells if "raises-exception" in c.metadata.get("tags", [])]
    return cell


def cell_text(cell, stream: str) -> str:
    return "".join(
        o.get("text", "")
        for o in cell.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == stream
    )


def find_cell(nb, source: str):
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and c.source.strip() == source]
    return cell


def magic_output(nb) -> str:
    """Everything gpu-quota-ext said: the first cell and the %gpucap cells (not torch's own warnings)."""
    cells = [nb.cells[1]] + [c for c in nb.cells if c.cell_type == "code" and c.source.lstrip().startswith("%gpucap")]

    def ours(cell) -> str:
        return "".join(line for line in cell_text(cell, "stderr").splitlines(True) if line.startswith("gpu-quota"))

    return "".join(cell_text(c, "stdout") + ours(c) for c in cells)


async def grant_of(jp_fetch, kernel_id: str) -> dict:
    return json.loads((await jp_fetch("api", "gpu-quota", "kernels", kernel_id)).body)


async def test_demo_config_shows_two_simulated_devices_that_say_so(jp_fetch):
    status = json.loads((await jp_fetch("api", "gpu-quota", "status")).body)
    assert status["gpu"] is True
    assert len(status["devices"]) == 2
    text = json.dumps(status["devices"])
    assert text.count("simulated, no real GPU") == 2, status["devices"]
    assert status["policy"]["default_cap"] == "0.25" and status["policy"]["max_cap"] == "0.5"


@pytest.mark.timeout(240)
@pytest.mark.slow
async def test_tour_notebook_runs_top_to_bottom_in_demo_mode(jp_fetch, jp_serverapp):
    kernel_id, nb = await run_tour(jp_fetch, jp_serverapp)
    # After `%gpucap reset` the ledger is back at the cap the kernel started with.
    end = await grant_of(jp_fetch, kernel_id)
    (device,) = end["devices"]
    total = {0: 80, 1: 40}[device["index"]] * 2**30

    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, "\n".join("\n".join(o["traceback"]) for o in errors)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert "error:" not in cell_text(cell, "stderr"), (cell.source, cell_text(cell, "stderr"))

    assert "started by a Jupyter server with gpu-quota-ext" in cell_text(nb.cells[1], "stdout")
    assert repeated_words(magic_output(nb)) == [], magic_output(nb)
    # What the user reads matches the server's ledger.
    shown = cell_text(find_cell(nb, "%gpucap"), "stdout")
    assert format_bytes(device["cap"]) in shown and device["cap"] == int(0.25 * total), shown
    assert f"you may ask for up to {format_bytes(int(0.5 * total))}" in shown, shown
    panel = find_cell(nb, "%gpucap panel")
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in panel.outputs), panel.outputs
    assert "your GPU quota on cuda:0 was the limit" in cell_text(oom_cell(nb), "stdout")
    assert "granted" in cell_text(find_cell(nb, "%gpucap 0.4"), "stdout")
    assert "clamped" in cell_text(find_cell(nb, "%gpucap 0.9"), "stdout")
    assert format_bytes(device["cap"]) in cell_text(find_cell(nb, "%gpucap reset\n%gpucap"), "stdout")


@pytest.mark.gpu
@pytest.mark.timeout(240)
async def test_tour_notebook_on_a_real_gpu(jp_fetch, jp_serverapp):
    """The same notebook where CUDA exists (the device machine): the one out-of-memory error is the cap's."""
    if not cuda_available():
        pytest.skip("needs torch with CUDA and a GPU")
    kernel_id, nb = await run_tour(jp_fetch, jp_serverapp)
    errors = [(c, o) for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert [c for c, _ in errors] == [oom_cell(nb)], "\n".join("\n".join(o["traceback"]) for _, o in errors)
    assert errors[0][1]["ename"] == "OutOfMemoryError"
    assert "your GPU quota on cuda:0 was the limit" in cell_text(oom_cell(nb), "stderr")
    assert "allocated under the new cap" in "".join(cell_text(c, "stdout") for c in nb.cells if c.cell_type == "code")
    assert "granted" in cell_text(find_cell(nb, "%gpucap 0.4"), "stdout")
    assert "clamped" in cell_text(find_cell(nb, "%gpucap 0.9"), "stdout")


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_tour_notebook_runs_under_nbconvert_without_a_server(tmp_path):
    """What a new user tries first: `jupyter nbconvert --execute` in a kernel no server started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_QUOTA_") and k != "PYTHONSTARTUP"}
    env.update(JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    nbconvert = Path(sys.executable).with_name("jupyter-nbconvert")
    result = subprocess.run(
        [
            str(nbconvert),
            "--to",
            "notebook",
            "--execute",
            str(NOTEBOOK),
            "--output-dir",
            str(tmp_path),
            "--ExecutePreprocessor.timeout=180",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    nb = nbformat.read(tmp_path / NOTEBOOK.name, as_version=4)
    first = cell_text(nb.cells[1], "stdout")
    assert "Loading %gpucap with %load_ext gpu_quota_ext:" in first
    assert first.count("no server started this kernel") == 1, first  # the banner, said once
    said = magic_output(nb)
    assert "gpu-quota: error" not in said, said
    assert "recorded for every device by this kernel alone" in cell_text(find_cell(nb, "%gpucap 0.4"), "stdout")
    assert "local caps removed" in cell_text(find_cell(nb, "%gpucap reset\n%gpucap"), "stdout")
    assert repeated_words(said) == [], said
