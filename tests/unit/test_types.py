"""The listed modules pass the type checker: mypy with the modules and options pyproject.toml lists ([tool.mypy]).
A finding fails the test command with mypy's own lines."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "pyproject.toml"


def mypy(*args: str, cache: Path) -> subprocess.CompletedProcess:
    # The cache in the test's own temp folder: the tree stays clean and no run reads another's.
    command = [sys.executable, "-m", "mypy", "--config-file", str(CONFIG), "--cache-dir", str(cache), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_mypy_finds_nothing_in_the_pure_modules(tmp_path):
    done = mypy(cache=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout


def test_mypy_would_find_a_wrong_type(tmp_path):
    # The check above can fail: the same configuration refuses a None where an int is declared.
    bad = tmp_path / "bad.py"
    bad.write_text("from typing import Optional\n\n\ndef room(budget: Optional[int]) -> int:\n    return budget - 1\n")
    done = mypy(str(bad), cache=tmp_path / "cache")
    assert done.returncode == 1 and 'Unsupported operand types for - ("None" and "int")' in done.stdout
