"""One closing line for `./run test`: every runner's counts added up ("N passed, N failed, N skipped").

Reads pytest's JUnit XML and its terminal output, jest's JSON and Playwright's JSON report from the
folder given; a runner whose report is missing (`./run test ARGS` runs pytest alone) counts as nothing,
an unreadable one as a failure. Exit status 1 when no test passed or any failed.

Tests that pytest deselected (by default the GPU tests: `-m 'not gpu'` in pyproject.toml) are in no
report but its terminal output; they count as skipped in the closing line, so that "N passed" never
hides tests that did not run, and the line before it says how many they are.
"""

import json
import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DESELECTED = re.compile(r"\b(\d+) deselected\b")


def pytest_counts(path: Path):
    suite = ElementTree.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    return total - failed - skipped, failed, skipped


def pytest_deselected(path: Path) -> int:
    """How many tests pytest deselected, from its closing line ("5 passed, 17 deselected in 3.1s")."""
    lines = [_ANSI.sub("", line) for line in path.read_text(errors="replace").splitlines()]
    for line in reversed(lines):
        if re.search(r"\b(passed|failed|error|errors|skipped|deselected|no tests ran)\b", line) and " in " in line:
            match = _DESELECTED.search(line)
            return int(match.group(1)) if match else 0
    return 0


def jest_counts(path: Path):
    report = json.loads(path.read_text())
    return report["numPassedTests"], report["numFailedTests"], report.get("numPendingTests", 0)


def playwright_counts(path: Path):
    stats = json.loads(path.read_text())["stats"]
    return stats.get("expected", 0) + stats.get("flaky", 0), stats.get("unexpected", 0), stats.get("skipped", 0)


def main(folder: Path) -> int:
    passed = failed = skipped = 0
    for name, read in (("pytest.xml", pytest_counts), ("jest.json", jest_counts), ("ui.json", playwright_counts)):
        path = folder / name
        if not path.exists():
            continue
        try:
            p, f, s = read(path)
        except Exception as error:
            print(f"{name}: unreadable report ({error})", file=sys.stderr)
            p, f, s = 0, 1, 0
        passed, failed, skipped = passed + p, failed + f, skipped + s
    output = folder / "pytest.out"
    deselected = pytest_deselected(output) if output.exists() else 0
    if deselected:
        print(
            f"pytest deselected {deselected} test(s), counted as skipped below: by default these are the GPU "
            "tests (-m 'not gpu'), which run on a machine with an NVIDIA GPU (bash tests/gpu/run_on_device.sh)"
        )
    print(f"{passed} passed, {failed} failed, {skipped + deselected} skipped")
    return 0 if passed and not failed else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
