"""Turns what tests/gpu/run_on_device.sh brought back ($OUT: the pytest log or its JUnit XML, figures.jsonl,
nvidia-smi.txt) into one dated file under benchmarks/results/, the record of what passed on real hardware.

    python tests/gpu/save_results.py DIR --what "every GPU check after the move" [--name gpu_checks] [--device h200]

The file is benchmarks/results/NAME-YYYY-MM-DD-DEVICE.json; a run already saved that day is kept and the
new one is appended to its "runs".
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import xml.etree.ElementTree as ElementTree
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
TEST_LINE = re.compile(r"^(tests/\S+::\S+)")
OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def outcomes_from_junit(path: Path) -> dict:
    found = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        kinds = {child.tag for child in case}
        found[name] = "FAILED" if kinds & {"failure", "error"} else "SKIPPED" if "skipped" in kinds else "PASSED"
    return found


def outcomes_from_log(text: str) -> dict:
    """pytest -v -s: a test's name starts a line, its output follows, its outcome ends the test."""
    found, current = {}, None
    for line in text.splitlines():
        start = TEST_LINE.match(line)
        if start:
            current = start.group(1)
        if current is not None:
            outcome = OUTCOME.search(line[start.end() :] if start else line)
            if outcome:
                found[current], current = outcome.group(1), None
    return found


def summary_line(text: str) -> str:
    lines = [line.strip("= ") for line in text.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return lines[-1] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--what", required=True, help="what this run checked, in words")
    parser.add_argument("--name", default="gpu_checks")
    parser.add_argument("--device", default="h200")
    parser.add_argument("--command", default="bash tests/gpu/run_on_device.sh (device tool, carry .whl)")
    options = parser.parse_args()
    log = (options.dir / "gpu-tests.log").read_text() if (options.dir / "gpu-tests.log").exists() else ""
    junit = options.dir / "junit.xml"
    outcomes = outcomes_from_junit(junit) if junit.exists() else outcomes_from_log(log)
    figures_file = options.dir / "figures.jsonl"
    figures = (
        [json.loads(line) for line in figures_file.read_text().splitlines() if line.strip()]
        if figures_file.exists()
        else []
    )
    smi = (options.dir / "nvidia-smi.txt").read_text().strip() if (options.dir / "nvidia-smi.txt").exists() else ""
    today = datetime.date.today().isoformat()
    target = RESULTS / f"{options.name}-{today}-{options.device}.json"
    record = (
        json.loads(target.read_text())
        if target.exists()
        else {
            "date": today,
            "device": f"nvidia-{options.device}",
            "command": options.command,
            "runs": [],
        }
    )
    record["runs"].append(
        {
            "what": options.what,
            "at": datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M UTC"),
            "machine": smi,
            "summary": summary_line(log),
            "outcomes": outcomes,
            "figures": figures,
        }
    )
    target.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{target.relative_to(RESULTS.parents[1])}: {len(outcomes)} outcomes, {len(figures)} figures")


if __name__ == "__main__":
    main()
