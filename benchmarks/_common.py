"""Shared by the benchmark scripts: machine description, percentiles, results printed as JSON and saved
(as dated JSON under benchmarks/results/) only when asked with --save."""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import socket
import statistics
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "host": socket.gethostname(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def free_port() -> int:
    """A loopback port free now, for a server the benchmark starts (another process could take it before the
    server binds it: on a busy machine a benchmark that fails to start is run again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values, fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[position]


def add_save_options(parser) -> None:
    """--save and --out: a run prints its figures; it writes them only when asked."""
    parser.add_argument(
        "--save", action="store_true", help="also write the JSON to benchmarks/results/NAME-DATE-HOST.json"
    )
    parser.add_argument("--out", help="also write the JSON to this file")


def report(name: str, figures: dict, save: bool = False, out=None) -> dict:
    """Print the figures as JSON; with `save`, also write benchmarks/results/NAME-DATE-HOST.json, and
    with `out` that file. Results are measurements worth keeping only when someone asks to keep them."""
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"benchmark": name, "date": now.isoformat(timespec="seconds"), "machine": machine(), **figures}
    text = json.dumps(record, indent=2) + "\n"
    print(text, end="")
    written = []
    if save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{name}-{now:%Y%m%dT%H%M%SZ}-{socket.gethostname()}.json"
        path.write_text(text)
        written.append(str(path))
    if out:
        Path(out).write_text(text)
        written.append(str(out))
    print("saved " + " and ".join(written) if written else "not saved (--save writes benchmarks/results/)")
    return record


def save(name: str, figures: dict, out=None) -> dict:
    """Print and write the figures: for a script that checks --save itself."""
    return report(name, figures, save=True, out=out)


def ratio_of_medians_ci(a, b, resamples: int = 5000, seed: int = 1):
    """95% bootstrap interval of median(a) / median(b), resampling paired rounds (a[i] with b[i])."""
    rng = random.Random(seed)
    n = len(a)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(statistics.median(a[i] for i in picks) / statistics.median(b[i] for i in picks))
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def paired_difference_ci(a, b, resamples: int = 5000, seed: int = 1) -> tuple:
    """95 % bootstrap interval of the median of a[i] - b[i] over paired rounds."""
    rng = random.Random(seed)
    differences = [x - y for x, y in zip(a, b)]
    medians = sorted(statistics.median(rng.choice(differences) for _ in differences) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]
