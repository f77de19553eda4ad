"""./run test's closing line (tests/summary.py): every runner added up, deselected GPU tests counted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SUMMARY = Path(__file__).resolve().parents[1] / "summary.py"
JUNIT = '<testsuites><testsuite name="pytest" tests="5" failures="0" errors="0" skipped="1"></testsuite></testsuites>'


def run_summary(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SUMMARY), str(folder)], capture_output=True, text=True, timeout=60)


def test_deselected_gpu_tests_count_as_skipped_in_the_closing_line(tmp_path):
    (tmp_path / "pytest.xml").write_text(JUNIT)
    # pytest's own closing line, coloured as on a terminal
    (tmp_path / "pytest.out").write_text(
        "....s\n\x1b[32m4 passed\x1b[0m, \x1b[33m1 skipped\x1b[0m, \x1b[33m17 deselected\x1b[0m in 3.10s\n"
    )
    result = run_summary(tmp_path)
    assert result.returncode == 0
    *before, closing = result.stdout.strip().splitlines()
    assert closing == "4 passed, 0 failed, 18 skipped"
    assert "deselected 17 test(s)" in before[-1] and "GPU" in before[-1]


def test_nothing_deselected_says_nothing_more(tmp_path):
    (tmp_path / "pytest.xml").write_text(JUNIT)
    (tmp_path / "pytest.out").write_text("4 passed, 1 skipped in 1.00s\n")
    assert run_summary(tmp_path).stdout.strip().splitlines() == ["4 passed, 0 failed, 1 skipped"]
