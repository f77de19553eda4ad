"""The code passes the project's linter: ruff with the rules pyproject.toml selects ([tool.ruff]), on the
package, the tests, the benchmarks, the demo config and the docs extension. A finding fails the test command
with ruff's own lines."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ["gpu_quota_ext", "tests", "benchmarks", "binder", "docs/_ext", "scripts"]


def ruff() -> list:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: it comes with the [test] extra (pip install -e '.[test]')")
    return [found]


def test_ruff_finds_nothing():
    done = subprocess.run(
        [*ruff(), "check", "--no-cache", *CHECKED], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_would_find_a_long_line(tmp_path):
    # The check above can fail: the same configuration refuses a line over 120 characters.
    bad = tmp_path / "bad.py"
    bad.write_text("x = '" + "y" * 130 + "'\n")
    done = subprocess.run(
        [*ruff(), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "E501" in done.stdout
