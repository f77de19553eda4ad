"""./run test's closing line (tests/summary.py): every runner added up, deselected GPU tests counted."""

from __future__ import annotations

import json
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


FAILING = """
import pytest

def test_fine():
    pass

def test_broken():
    assert 1 == 2

class TestGroup:
    @pytest.mark.parametrize("n", [1, 2])
    def test_odd(self, n):
        assert n % 2
"""


def real_pytest_report(tmp_path: Path, **modules: str) -> Path:
    """A JUnit report written by pytest itself, of a package's test modules."""
    package = tmp_path / "suite" / "tests" / "unit"
    package.mkdir(parents=True)
    (tmp_path / "suite" / "tests" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    for name, text in modules.items():
        (package / f"{name}.py").write_text(text)
    reports = tmp_path / "reports"
    reports.mkdir()
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={reports / 'pytest.xml'}"],
        cwd=tmp_path / "suite",
        capture_output=True,
        text=True,
        timeout=120,
    )
    return reports


JEST = {
    "numPassedTests": 3,
    "numFailedTests": 1,
    "numRuntimeErrorTestSuites": 1,
    "numPendingTests": 0,
    "testResults": [
        {
            "name": "/src/labextension/src/__tests__/chart.spec.ts",
            "status": "failed",
            "assertionResults": [
                {"fullName": "chart draws the cap", "title": "draws the cap", "status": "failed"},
                {"fullName": "chart draws usage", "title": "draws usage", "status": "passed"},
            ],
        },
        {"name": "/src/labextension/src/__tests__/model.spec.ts", "status": "failed", "assertionResults": []},
    ],
}
PLAYWRIGHT = {
    "stats": {"expected": 4, "unexpected": 1, "skipped": 0, "flaky": 1},
    "suites": [
        {
            "title": "park.spec.ts",
            "specs": [],
            "suites": [
                {
                    "title": "parking",
                    "specs": [
                        {"title": "a parked kernel resumes", "tests": [{"status": "unexpected"}]},
                        {"title": "a flaky one passes on retry", "tests": [{"status": "flaky"}]},
                        {"title": "the banner shows", "tests": [{"status": "expected"}]},
                    ],
                }
            ],
        }
    ],
}


def test_the_closing_lines_name_what_failed_in_every_runner(tmp_path):
    """Issue 31 item 3: the last lines of ./run test name each failed test, in a form its runner takes back."""
    reports = real_pytest_report(tmp_path, test_some=FAILING)
    (reports / "jest.json").write_text(json.dumps(JEST))
    (reports / "ui.json").write_text(json.dumps(PLAYWRIGHT))
    result = run_summary(reports)
    assert result.returncode == 1
    assert result.stdout.strip().splitlines()[-7:] == [
        "failed (5):",
        "  pytest tests/unit/test_some.py::test_broken",
        "  pytest tests/unit/test_some.py::TestGroup::test_odd[2]",
        "  jest   /src/labextension/src/__tests__/chart.spec.ts › chart draws the cap",
        "  jest   /src/labextension/src/__tests__/model.spec.ts (did not run)",
        "  ui     park.spec.ts › parking › a parked kernel resumes",
        "10 passed, 5 failed, 0 skipped",
    ]


def test_a_module_that_cannot_be_collected_is_named(tmp_path):
    reports = real_pytest_report(tmp_path, test_some=FAILING, test_syntax="def test_(:\n")
    lines = run_summary(reports).stdout.strip().splitlines()
    assert "  pytest tests/unit/test_syntax.py (could not be collected)" in lines[-3:]


def test_a_run_where_nothing_failed_names_nothing(tmp_path):
    (tmp_path / "pytest.xml").write_text(JUNIT)
    (tmp_path / "pytest.out").write_text("4 passed, 1 skipped in 1.00s\n")
    assert "failed (" not in run_summary(tmp_path).stdout


def test_an_unreadable_report_is_named_as_a_failure(tmp_path):
    (tmp_path / "pytest.xml").write_text(JUNIT)
    (tmp_path / "ui.json").write_text("{not json")
    lines = run_summary(tmp_path).stdout.strip().splitlines()
    assert lines[-3:] == ["failed (1):", "  ui     ui.json: unreadable report", "4 passed, 1 failed, 1 skipped"]


def test_pytest_ids_are_the_ones_pytest_runs_again():
    from tests.summary import pytest_id

    assert pytest_id("tests.unit.test_a", "test_b[x-1]") == "tests/unit/test_a.py::test_b[x-1]"
    assert pytest_id("tests.unit.test_a.TestB.TestC", "test_d") == "tests/unit/test_a.py::TestB::TestC::test_d"
    assert pytest_id("", "tests.unit.test_broken") == "tests/unit/test_broken.py (could not be collected)"
