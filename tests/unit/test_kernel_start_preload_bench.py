"""The kernel-start preload benchmark (benchmarks/kernel_start_preload_bench.py) runs its process arms as it says:
each start in the arm it claims (the script stops the run otherwise), both arms counted, the figures written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_start_preload_bench.py"
PROBE = BENCH.parent / "fast_park_probe.py"


def test_two_paired_process_rounds_are_counted_in_their_arms(tmp_path):
    build = subprocess.run(
        [sys.executable, str(PROBE), "--build-only", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert build.returncode == 0, build.stderr
    library = next(tmp_path.glob("*.so"))
    out = tmp_path / "figures.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--process", "--rounds", "2", "--library", str(library), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["rounds"] == 2
    for measure in ("wall", "cpu"):
        assert len(figures[measure]["kept_s"]) == len(figures[measure]["removed_s"]) == 2
        assert all(seconds > 0 for seconds in figures[measure]["kept_s"] + figures[measure]["removed_s"])
    assert "paired rounds" in run.stdout


def test_nvml_without_a_server_is_refused():
    run = subprocess.run(
        [sys.executable, str(BENCH), "--process", "--nvml"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and "--process starts no server" in run.stderr
