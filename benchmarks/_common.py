"""Shared by the benchmark scripts: machine description, percentiles, saving results as dated JSON."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
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


def percentile(values, fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[position]


def save(name: str, figures: dict, out=None) -> Path:
    """Print the figures and write them to benchmarks/results/NAME-DATE-HOST.json (and to `out` if given)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"benchmark": name, "date": now.isoformat(timespec="seconds"), "machine": machine(), **figures}
    text = json.dumps(record, indent=2) + "\n"
    path = RESULTS / f"{name}-{now:%Y%m%dT%H%M%SZ}-{socket.gethostname()}.json"
    path.write_text(text)
    if out:
        Path(out).write_text(text)
    print(text, end="")
    print(f"saved {path}" + (f" and {out}" if out else ""))
    return path
