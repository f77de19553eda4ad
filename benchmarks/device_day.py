"""A scripted day of notebook use on a real GPU, under overcommit: what users wait for, what idle kernels hold and
give back, and whether any kernel is lost (issue 28).

One real jupyter_server with gpu_quota_ext (real NVML, the real checkpoint driver), `--kernels` kernels whose caps
add up to more than the device (default 8 x 0.35 = 2.8 devices, overcommit 3), mixed torch and CuPy. Each kernel
follows a seeded schedule (`schedule()`, the same one benchmarks/broker_day.py replays with `--schedule`): its
first cell makes its working set (random bytes, a checksum kept in the kernel), then a cell every 20 to 120 s
that prints a start marker first, checks the checksum, and computes for 1 to 5 s. Parking runs as an admin would
set it for a busy day: idle kernels park after `--idle-after` seconds, the broker parks kernels idle at least
`--min-idle` seconds to make room.

Measured, in the units the literature uses (NotebookOS, ASPLOS '26):
  - cell-start delay: from the execute_request sent to the cell's first line (its marker, stamped by the kernel
    with the same clock), p50/p95/p99 and worst;
  - GPU-GiB-hours held by idle kernels (NVML bytes of kernels idle on the device) and returned (bytes parked);
  - kernels lost: a checksum that changed, a variable gone (a restart), a park state "lost" (must be 0);
  - host memory's lowest point (available), and OOM kills in `dmesg` during the day.

    python benchmarks/device_day.py --out day.json                  # 8 kernels, 10 minutes, seed 28
    python benchmarks/device_day.py --schedule-only --out sched.json # the schedule alone (no GPU needed)
    python benchmarks/device_day.py --fast-park on --out day.json   # torch kernels park by the fast path

On the lent device a call ends at 10 minutes, so a 10-minute day takes two calls on the warm machine: the first
starts it detached and writes under /tmp (each call gets a fresh copy of the working tree, so ignored folders in
it, .day/ say, are gone at the next call; /tmp stays while the machine is warm), the second, within the 30 s the
machine stays warm, waits for the JSON and copies it to $OUT:
    setsid nohup timeout 900 python3 benchmarks/device_day.py --deadline-s 840 --out /tmp/day/day.json \
        > /tmp/day/log 2>&1 < /dev/null &
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import percentile, report  # noqa: E402

GiB = 1 << 30
CHUNK = 1 << 24


@dataclass(frozen=True)
class KernelPlan:
    name: str
    framework: str  # "torch" or "cupy"
    working_set: float  # fraction of the device its first cell makes
    cells: List[float]  # seconds from the day's start when each cell is sent (the first makes the working set)
    work: List[float]  # seconds each cell computes


@dataclass(frozen=True)
class Schedule:
    seed: int
    minutes: float
    cap: float
    kernels: List[KernelPlan]


def schedule(
    seed: int = 28, kernels: int = 8, minutes: float = 10.0, cap: float = 0.35, cupy_every: int = 4
) -> Schedule:
    """The day, drawn from `seed` alone: every `cupy_every`-th kernel is CuPy, working sets 0.09 to 0.21 of the
    device, the first cell within 20 s, then a cell every 20 to 120 s, each computing 1 to 5 s."""
    rng = random.Random(seed)
    plans = []
    for index in range(kernels):
        framework = "cupy" if index % cupy_every == cupy_every - 1 else "torch"
        working_set = round(rng.uniform(0.09, 0.21), 3)
        at, cells, work = rng.uniform(0, 20), [], []
        while at < minutes * 60:
            cells.append(round(at, 1))
            work.append(round(rng.uniform(1, 5), 1))
            at += rng.uniform(20, 120)
        plans.append(KernelPlan(f"k{index}", framework, working_set, cells, work))
    return Schedule(seed, minutes, cap, plans)


MAKE = {
    "torch": (
        "import time, torch\n"
        "x = torch.empty({n}, dtype=torch.uint8, device='cuda'); x.random_(0, 251); torch.cuda.synchronize()\n"
        f"def _day_sum(): return sum(int(p.sum(dtype=torch.int64)) for p in x.split({CHUNK}))\n"
        "def _day_work(s):\n"
        "    end = time.time() + s\n"
        "    while time.time() < end:\n"
        "        x[:1 << 26].float().mul_(1.0001); torch.cuda.synchronize()\n"
        "expected = _day_sum(); print('DAY-MADE', expected)\n"
    ),
    "cupy": (
        "import time, cupy as cp\n"
        # Filled a chunk at a time: cp.random.randint on the whole array allocates several times its size
        # (its int64 draw first), which a cap of 0.35 refuses for a working set of 0.15 (seen on the H200).
        "x = cp.empty({n}, dtype=cp.uint8)\n"
        "for _i in range(0, x.size, 1 << 28):\n"
        "    x[_i:_i + (1 << 28)] = cp.random.randint(0, 251, min(1 << 28, x.size - _i), dtype=cp.uint8)\n"
        "cp.cuda.Device().synchronize()\n"
        f"def _day_sum(): return sum(int(x[i:i + {CHUNK}].sum(dtype=cp.int64)) for i in range(0, x.size, {CHUNK}))\n"
        "def _day_work(s):\n"
        "    end = time.time() + s\n"
        "    while time.time() < end:\n"
        "        (x[:1 << 26].astype(cp.float32) * 1.0001).sum(); cp.cuda.Device().synchronize()\n"
        "expected = _day_sum(); print('DAY-MADE', expected)\n"
    ),
}
CELL = (
    "import time as _t; print('DAY-START', repr(_t.time()), flush=True)\n"
    "_s = _day_sum(); _day_work({work}); print('DAY-OK' if _s == expected else f'DAY-CHANGED {{_s}} {{expected}}')\n"
)


@dataclass
class Outcome:
    name: str
    delays: List[float] = field(default_factory=list)  # seconds, cell sent -> its first line
    cell_errors: List[str] = field(default_factory=list)
    lost: List[str] = field(default_factory=list)
    pid: Optional[int] = None


def run_cell(connection: Path, code: str, timeout: float) -> tuple:
    """(sent at, wall clock; stdout; the error's name and value or None)."""
    from jupyter_client import BlockingKernelClient

    client = BlockingKernelClient(connection_file=str(connection))
    client.load_connection_file()
    client.start_channels(hb=False)
    try:
        client.wait_for_ready(timeout=timeout)
        out: List[str] = []
        error: List[str] = []

        def hook(msg):
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                error.append(f"{msg['content']['ename']}: {msg['content']['evalue']}"[:500])

        sent = time.time()
        client.execute_interactive(code, timeout=timeout, output_hook=hook)
        return sent, "".join(out), (error[0] if error else None)
    finally:
        client.stop_channels()


def drive(server, plan: KernelPlan, kernel_id: str, start: float, total: int, outcome: Outcome, stop: threading.Event):
    connection = server.runtime / f"kernel-{kernel_id}.json"
    made = False  # its working set exists: from then on a variable gone is a kernel lost
    for index, (at, work) in enumerate(zip(plan.cells, plan.work)):
        delay = start + at - time.time()
        if delay > 0 and stop.wait(delay):
            return
        # The first cell makes the working set; where it failed (the device full), the next cell tries again.
        making = not made
        code = MAKE[plan.framework].format(n=int(plan.working_set * total)) if making else CELL.format(work=work)
        try:
            sent, out, error = run_cell(connection, code, timeout=900)
        except Exception as failure:  # a cell that never answered: counted, the day goes on
            outcome.cell_errors.append(f"cell {index}: {failure!r}"[:300])
            continue
        if error:
            outcome.cell_errors.append(f"cell {index}{' (making the working set)' if making else ''}: {error}")
            if "NameError" in error and made:
                outcome.lost.append(f"cell {index}: variables gone ({error})")
            continue
        made = made or ("DAY-MADE" in out)
        waited = ""
        for line in out.splitlines():
            if line.startswith("DAY-START "):
                outcome.delays.append(float(line.split()[1]) - sent)
                waited = f" (started {outcome.delays[-1]:.1f} s after it was sent)"
            elif line.startswith("DAY-CHANGED"):
                outcome.lost.append(f"cell {index}: checksum changed ({line})")
        said = out.strip().splitlines()[-1:]
        print(f"{time.time() - start:6.1f} s {plan.name} cell {index}: {said}{waited}", flush=True)


class Sampler(threading.Thread):
    """Every second: each kernel's park state and bytes (the server's status), host memory; integrates
    GPU-GiB-hours held by idle kernels and given back by parked ones."""

    def __init__(self, server, kernels: Dict[str, str]):
        super().__init__(daemon=True)
        self.server, self.kernels = server, kernels
        self.stop = threading.Event()
        self.idle_gib_s = 0.0
        self.returned_gib_s = 0.0
        self.host_lowest = None
        self.states: Dict[str, List] = {name: [] for name in kernels}
        self.lost: Dict[str, str] = {}
        self.short_episodes = 0

    def run(self):
        import psutil

        last = time.time()
        while not self.stop.wait(1.0):
            try:
                status = self.server.api("/api/gpu-quota/status")
            except Exception:
                continue
            now = time.time()
            dt, last = now - last, now
            available = psutil.virtual_memory().available
            self.host_lowest = available if self.host_lowest is None else min(self.host_lowest, available)
            by_id = {k["id"]: k for k in status["kernels"]}
            for name, kernel_id in self.kernels.items():
                kernel = by_id.get(kernel_id)
                if kernel is None:
                    continue
                park = kernel.get("park") or {}
                state = park.get("state")
                used = sum((d.get("used") or 0) for d in kernel.get("devices", []))
                if state == "idle":
                    self.idle_gib_s += used / GiB * dt
                if state in ("parked", "waiting"):
                    self.returned_gib_s += (park.get("host_bytes") or 0) / GiB * dt
                if state == "lost":
                    self.lost[name] = park.get("reason") or "lost"
                history = self.states[name]
                if not history or history[-1][1] != state:
                    history.append((round(now, 1), state))


def oom_kills() -> int:
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except Exception:
        return -1
    return sum(1 for line in out.splitlines() if "Out of memory: Killed process" in line or "oom-kill:" in line)


def use_pages_library(workdir: Path, given: str) -> None:
    """The server's cache folder (a fresh one, in the environment the server inherits), holding the fast park
    library given where there is one: the GPU machine may have no C compiler (docs/admin/fast-park.md)."""
    from gpu_quota_ext.parking.pages import build as pages_build

    os.environ["XDG_CACHE_HOME"] = str(workdir / "cache")
    if Path(given).exists():
        target = pages_build.cache_dir() / pages_build.LIBRARY_NAME
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(given, target)


def day(options) -> dict:
    from park_bench import BenchServer, device_name

    # A hard end for the whole run (the device machine's calls end at 10 minutes): the cells still out by then
    # are cut off and counted, and the figures of the rest are written all the same.
    end_by = None if options.deadline_s is None else STARTED + options.deadline_s - 40

    plan = schedule(options.seed, options.kernels, options.minutes, options.cap)
    workdir = Path(tempfile.mkdtemp(prefix="device-day-"))
    settings = [
        f"--GpuQuota.default_cap={plan.cap}",
        f"--GpuQuota.max_cap={plan.cap}",
        f"--GpuQuota.overcommit={options.overcommit}",
        "--GpuQuota.placement=pack",
        "--GpuQuota.poll_interval=1",
        f"--GpuQuota.park_idle_after={options.idle_after}s",
        f"--GpuQuota.park_min_idle={options.min_idle}s",
        f"--GpuQuota.park_wait_limit={options.wait_limit}s",
    ]
    if options.fast_park == "on":
        settings.append("--GpuQuota.fast_park=on")
        use_pages_library(workdir, options.pages_library)
    kills = oom_kills()
    server = BenchServer(workdir, settings)
    import pynvml

    pynvml.nvmlInit()
    total = int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
    outcomes = {p.name: Outcome(p.name) for p in plan.kernels}
    kernels: Dict[str, str] = {}
    sampler = None
    cut_off: List[str] = []
    stop = threading.Event()
    try:
        for p in plan.kernels:
            kernels[p.name] = server.api("/api/kernels", "POST", {"name": "python3"})["id"]
        for p in plan.kernels:
            connection = server.runtime / f"kernel-{kernels[p.name]}.json"
            said = run_cell(connection, "import os; print(os.getpid())", 120)[1]
            outcomes[p.name].pid = int(said.strip().splitlines()[-1])
        print(f"{len(kernels)} kernels up; the day begins ({plan.minutes:g} min)", flush=True)
        sampler = Sampler(server, kernels)
        sampler.start()
        start = time.time()
        threads = [
            threading.Thread(
                target=drive, args=(server, p, kernels[p.name], start, total, outcomes[p.name], stop), daemon=True
            )
            for p in plan.kernels
        ]
        for thread in threads:
            thread.start()
        last = start + plan.minutes * 60 + 900 if end_by is None else min(end_by, start + plan.minutes * 60 + 900)
        for thread in threads:
            thread.join(timeout=max(0.1, last - time.time()))
        stop.set()
        running = {p.name for p, thread in zip(plan.kernels, threads) if thread.is_alive()}
        cut_off = sorted(running)
        elapsed = time.time() - start
        for p in plan.kernels:  # a kernel restarted under us is a kernel lost, whatever its cells said
            if p.name in running:
                continue  # its cell is still out: not checked (said in cells_cut_off_at_the_deadline)
            connection = server.runtime / f"kernel-{kernels[p.name]}.json"
            try:
                # The last line: a parked kernel's cell may say it came back first (older servers said it on stdout).
                pid = int(run_cell(connection, "import os; print(os.getpid())", 300)[1].strip().splitlines()[-1])
            except Exception as failure:
                outcomes[p.name].lost.append(f"no answer at the end: {failure!r}"[:200])
                continue
            if pid != outcomes[p.name].pid:
                outcomes[p.name].lost.append(f"restarted (pid {outcomes[p.name].pid} -> {pid})")
    finally:
        stop.set()
        if sampler is not None:
            sampler.stop.set()
            sampler.join(timeout=5)
        server.stop()
    delays = [d for o in outcomes.values() for d in o.delays]
    lost = {name: o.lost for name, o in outcomes.items() if o.lost}
    for name, why in (sampler.lost if sampler else {}).items():
        lost.setdefault(name, []).append(f"park state lost: {why}")
    after = oom_kills()
    return {
        "device": device_name(),
        "schedule": asdict(plan),
        "settings": settings,
        "fast_park": options.fast_park,
        "device_total": total,
        "elapsed_s": round(elapsed, 1),
        "cells": len(delays),
        "cells_cut_off_at_the_deadline": cut_off,
        "cell_start_delay_s": {
            "p50": round(percentile(delays, 0.50), 2),
            "p95": round(percentile(delays, 0.95), 2),
            "p99": round(percentile(delays, 0.99), 2),
            "worst": round(max(delays), 2) if delays else None,
            "mean": round(statistics.mean(delays), 2) if delays else None,
        },
        "gpu_gib_hours_held_by_idle_kernels": round(sampler.idle_gib_s / 3600, 3) if sampler else None,
        "gpu_gib_hours_returned_by_parking": round(sampler.returned_gib_s / 3600, 3) if sampler else None,
        "kernels_lost": len(lost),
        "lost": lost,
        "cell_errors": {name: o.cell_errors for name, o in outcomes.items() if o.cell_errors},
        "host_available_lowest_gib": round(sampler.host_lowest / GiB, 2) if sampler and sampler.host_lowest else None,
        "oom_kills_in_dmesg": None if kills < 0 or after < 0 else after - kills,
        "states": sampler.states if sampler else {},
    }


STARTED = time.time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=28)
    parser.add_argument("--kernels", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--cap", type=float, default=0.35)
    parser.add_argument("--overcommit", type=float, default=3.0)
    parser.add_argument("--idle-after", type=float, default=30.0, help="park_idle_after, seconds")
    parser.add_argument("--min-idle", type=float, default=10.0, help="park_min_idle, seconds")
    parser.add_argument("--wait-limit", type=float, default=300.0, help="park_wait_limit, seconds")
    parser.add_argument("--fast-park", choices=("off", "on"), default="off", help="the server's fast_park setting")
    parser.add_argument(
        "--pages-library",
        default=str(Path(__file__).resolve().parents[1] / ".probe" / "libgqx_pages.so"),
        help="with --fast-park on: a fast park library built elsewhere, for a machine without a C compiler",
    )
    parser.add_argument("--schedule-only", action="store_true", help="write the schedule and stop (no GPU)")
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument(
        "--deadline-s", type=float, help="end the whole run within this many seconds of its start, figures written"
    )
    options = parser.parse_args()
    if options.schedule_only:
        text = json.dumps(asdict(schedule(options.seed, options.kernels, options.minutes, options.cap)), indent=2)
        print(text)
        if options.out:
            Path(options.out).write_text(text + "\n")
        return
    report("device_day", day(options), out=options.out)


if __name__ == "__main__":
    main()
