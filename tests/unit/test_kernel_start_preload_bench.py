"""The kernel-start preload benchmark (benchmarks/kernel_start_preload_bench.py) runs its process arms as it says:
each start in the arm it claims (the script stops the run otherwise), both arms counted, the figures written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_start_preload_bench.py"
PROBE = BENCH.parent / "fast_park_probe.py"
CPU = min(os.sched_getaffinity(0))  # one this process may run on (a container may not have CPU 0)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """The fast park library built as the probe builds it, in a folder of the test's own."""
    folder = tmp_path_factory.mktemp("library")
    build = subprocess.run(
        [sys.executable, str(PROBE), "--build-only", "--out", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert build.returncode == 0, build.stderr
    return next(folder.glob("*.so"))


def test_two_paired_process_rounds_are_counted_in_their_arms(tmp_path, library):
    out = tmp_path / "figures.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--process", "--rounds", "2", "--library", str(library), "--out", str(out)]
        + ["--pin-cpu", str(CPU)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["rounds"] == 2 and figures["pinned_to_cpu"] == CPU
    for measure in ("wall", "cpu"):
        assert len(figures[measure]["kept_s"]) == len(figures[measure]["removed_s"]) == 2
        assert all(seconds > 0 for seconds in figures[measure]["kept_s"] + figures[measure]["removed_s"])
    assert "paired rounds" in run.stdout


def test_a_run_that_did_no_round_says_so_and_writes_nothing(tmp_path, library):
    out = tmp_path / "figures.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--process", "--max-seconds", "0", "--library", str(library), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1 and "no round done within --max-seconds 0" in run.stderr, run.stderr[-2000:]
    assert not out.exists()


@pytest.mark.parametrize(
    "arguments, words",
    [
        (["--process", "--nvml"], "--process starts no server"),
        (["--process", "--pin-cpu", "100000"], "one of this process's CPUs"),
        (["--pin-cpu", str(CPU)], "with --process"),  # the server's kernels are not pinned
        (["--process", "--rounds", "0"], "at least 1"),
    ],
)
def test_options_that_mean_nothing_are_refused_before_anything_starts(arguments, words):
    run = subprocess.run([sys.executable, str(BENCH), *arguments], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and words in run.stderr, run.stderr
