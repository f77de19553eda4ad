"""Process facts from /proc by hand vs through psutil: parent PID, uids, existence, environment.

processes.ProcTable reads these for every PID NVML lists that is not a known kernel's own, each sample.
psutil is the library way; this says per fact whether it costs the same. Each round reads the fact of
every process on the machine; the figure is the median round time in microseconds per process.

    python benchmarks/proc_read_bench.py [--rounds 21] [--save]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
from _common import add_save_options, report  # noqa: E402

from gpu_quota_ext.usage.attribution import (  # noqa: E402
    parse_environ_kernel_id,
    parse_ppid,
    parse_uids,
)


def _read(pid: int, name: str, binary: bool = False):
    try:
        with open(f"/proc/{pid}/{name}", "rb" if binary else "r") as handle:
            return handle.read()
    except (OSError, ValueError):
        return None


def proc_ppid(pid):
    text = _read(pid, "stat")
    return parse_ppid(text) if text else None


def psutil_ppid(pid):
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def proc_uids(pid):
    text = _read(pid, "status")
    return parse_uids(text) if text else ()


def psutil_uids(pid):
    try:
        return tuple(psutil.Process(pid).uids())
    except psutil.Error:
        return ()


def proc_exists(pid):
    return os.path.exists(f"/proc/{pid}")


def psutil_exists(pid):
    return psutil.pid_exists(pid)


def proc_environ(pid):
    data = _read(pid, "environ", binary=True)
    return parse_environ_kernel_id(data) if data else None


def psutil_environ(pid):
    try:
        return psutil.Process(pid).environ().get("GPU_QUOTA_KERNEL_ID")
    except psutil.Error:
        return None


FACTS = {
    "ppid": (proc_ppid, psutil_ppid),
    "uids": (proc_uids, psutil_uids),
    "exists": (proc_exists, psutil_exists),
    "environ": (proc_environ, psutil_environ),
}


def median_us_per_process(read, pids, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        for pid in pids:
            read(pid)
        times.append(time.perf_counter() - began)
    return statistics.median(times) / len(pids) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    add_save_options(parser)
    args = parser.parse_args()
    pids = psutil.pids()
    figures = {"processes": len(pids), "rounds": args.rounds, "psutil": psutil.__version__, "us_per_process": {}}
    for fact, (by_hand, by_psutil) in FACTS.items():
        hand = median_us_per_process(by_hand, pids, args.rounds)
        lib = median_us_per_process(by_psutil, pids, args.rounds)
        figures["us_per_process"][fact] = {
            "proc": round(hand, 2),
            "psutil": round(lib, 2),
            "ratio": round(lib / hand, 2),
        }
    report("proc_read", figures, save=args.save, out=args.out)


if __name__ == "__main__":
    main()
