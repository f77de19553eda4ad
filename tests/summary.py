"""One closing line for `./run test`: every runner's counts added up ("N passed, N failed, N skipped").

Reads pytest's JUnit XML, jest's JSON and Playwright's JSON report from the folder given; a runner whose
report is missing (`./run test ARGS` runs pytest alone) counts as nothing, an unreadable one as a
failure. Exit status 1 when no test passed or any failed.
"""

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def pytest_counts(path: Path):
    suite = ElementTree.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    return total - failed - skipped, failed, skipped


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
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 0 if passed and not failed else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
