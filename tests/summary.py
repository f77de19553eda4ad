"""The closing lines of `./run test`: what failed, by name, then every runner's counts added up
("N passed, N failed, N skipped"), so that the reader of a long run's last screen knows what to run again.

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


# At most this many failures are named; a run where everything fails says how many more there were.
MOST_NAMED = 30


def pytest_id(classname: str, name: str) -> str:
    """pytest's node id from JUnit's classname and name: ("tests.unit.test_a.TestB", "test_c[1]") ->
    "tests/unit/test_a.py::TestB::test_c[1]", what `pytest` takes to run it again. A collection error has
    no classname: its name is the module's, dotted ("tests.unit.test_a")."""
    if not classname:
        return f"{name.replace('.', '/')}.py (could not be collected)"
    parts = classname.split(".")
    module = max((i for i, part in enumerate(parts) if not part[:1].isupper()), default=len(parts) - 1)
    return "::".join(["/".join(parts[: module + 1]) + ".py", *parts[module + 1 :], name])


def pytest_failures(path: Path) -> list:
    suite = ElementTree.parse(path).getroot()
    return [
        pytest_id(case.get("classname", ""), case.get("name", ""))
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]


def jest_failures(path: Path) -> list:
    names = []
    for suite in json.loads(path.read_text()).get("testResults", []):
        failed = [r for r in suite.get("assertionResults", []) if r.get("status") == "failed"]
        names += [f"{suite.get('name', '?')} › {r.get('fullName') or r.get('title')}" for r in failed]
        if not failed and suite.get("status") == "failed":  # the file itself did not run (a syntax error, an import)
            names.append(f"{suite.get('name', '?')} (did not run)")
    return names


def playwright_failures(path: Path) -> list:
    def walk(suite: dict, titles: list) -> list:
        titles = titles + [suite["title"]] if suite.get("title") else titles
        names = []
        for spec in suite.get("specs", []):
            if any(test.get("status") == "unexpected" for test in spec.get("tests", [])):
                names.append(" › ".join(titles + [spec.get("title", "?")]))
        for child in suite.get("suites", []):
            names += walk(child, titles)
        return names

    return [name for suite in json.loads(path.read_text()).get("suites", []) for name in walk(suite, [])]


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
    # A test file that did not run at all (a syntax or import error) has no failed test: count it as one.
    failed = report["numFailedTests"] + report.get("numRuntimeErrorTestSuites", 0)
    return report["numPassedTests"], failed, report.get("numPendingTests", 0)


def playwright_counts(path: Path):
    stats = json.loads(path.read_text())["stats"]
    return stats.get("expected", 0) + stats.get("flaky", 0), stats.get("unexpected", 0), stats.get("skipped", 0)


RUNNERS = (
    ("pytest", "pytest.xml", pytest_counts, pytest_failures),
    ("jest", "jest.json", jest_counts, jest_failures),
    ("ui", "ui.json", playwright_counts, playwright_failures),
)


def main(folder: Path) -> int:
    passed = failed = skipped = 0
    named = []  # (runner, what failed)
    for runner, name, read, failures in RUNNERS:
        path = folder / name
        if not path.exists():
            continue
        try:
            p, f, s = read(path)
            named += [(runner, failure) for failure in failures(path)]
        except Exception as error:
            print(f"{name}: unreadable report ({error})", file=sys.stderr)
            p, f, s = 0, 1, 0
            named.append((runner, f"{name}: unreadable report"))
        passed, failed, skipped = passed + p, failed + f, skipped + s
    output = folder / "pytest.out"
    deselected = pytest_deselected(output) if output.exists() else 0
    if deselected:
        print(
            f"pytest deselected {deselected} test(s), counted as skipped below: by default these are the GPU "
            "tests (-m 'not gpu'), which run on a machine with an NVIDIA GPU (bash tests/gpu/run_on_device.sh)"
        )
    if named:
        print(f"failed ({len(named)}):")
        for runner, failure in named[:MOST_NAMED]:
            print(f"  {runner:<6} {failure}")
        if len(named) > MOST_NAMED:
            print(f"  ... and {len(named) - MOST_NAMED} more (the reports are in {folder})")
    print(f"{passed} passed, {failed} failed, {skipped + deselected} skipped")
    return 0 if passed and not failed else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
