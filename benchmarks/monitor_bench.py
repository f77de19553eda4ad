"""The monitor's CPU cost: 200 kernels over 8 devices, one sample a second.

Fake NVML (default): 200 real "kernels" (a shell each, with a child process that the fake NVML says
uses 1 GiB on one of 8 devices), so the PID -> kernel mapping walks the real /proc. --real: the machine's
GPUs through NVML (the same 200 kernels, which hold no GPU memory: what is measured is NVML's cost).

The cost is process CPU time (all threads: the loop and the monitor's thread) over a wall-clock window,
as a percentage of one core. Goal: under 1 % at 1 Hz.

    python benchmarks/monitor_bench.py [--real] [--kernels 200] [--devices 8] [--seconds 30] [--save]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_save_options, percentile, report  # noqa: E402

from gpu_quota_ext.devices import Device
from gpu_quota_ext.devices.fake_nvml import FakeNvml  # noqa: E402
from gpu_quota_ext.devices.inventory import read_nvml_devices
from gpu_quota_ext.devices.nvml import PynvmlBackend  # noqa: E402
from gpu_quota_ext.ledger.local import LocalLedger  # noqa: E402
from gpu_quota_ext.manager import GpuQuotaManager  # noqa: E402
from gpu_quota_ext.policy import build_policy, resolve  # noqa: E402
from gpu_quota_ext.shared.sizes import GiB  # noqa: E402
from gpu_quota_ext.usage.watchdog_settings import build_watchdog_settings  # noqa: E402


class Kernels:
    def __init__(self, roots):
        self._roots = roots
        self._since = datetime.datetime.now(datetime.timezone.utc)

    def kernel_ids(self):
        return list(self._roots.values())

    def roots(self):
        return dict(self._roots)

    def starting_ids(self):  # all started before the run
        return set()

    def activity(self, kernel_id):  # what the history and the parker read per sample: idle since the run began
        return "idle", self._since

    def exit_code(self, kernel_id):  # none ends during the run
        return None

    def on_restart(self, kernel_id, callback):  # nor restarts
        pass

    def on_dead(self, kernel_id, callback):  # these "kernels" have no restarter
        pass

    async def dead_ids(self):  # and none dies during the run
        return []

    async def act(self, kernel_id, action):  # never over cap here
        raise AssertionError(action)


def start_kernels(count: int):
    """`count` shells, each with one child: (shell, child) pairs. The child is what 'uses' the GPU."""
    pairs = []
    for _ in range(count):
        shell = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        child = int(shell.stdout.readline())
        pairs.append((shell, child))
    return pairs


async def measure(manager: GpuQuotaManager, seconds: float, warmup: int):
    """Sample timings, and the CPU of everything the manager runs per poll (sampling, the watchdog's
    review, the lifecycle's poll)."""
    monitor = manager.monitor
    timings = []
    original = monitor.sample

    def timed(*args):
        began = time.perf_counter()
        try:
            return original(*args)
        finally:
            timings.append(time.perf_counter() - began)

    monitor.sample = timed
    manager.start()
    while monitor.ticks < warmup:
        await asyncio.sleep(0.01)
    wall0, cpu0, ticks0 = time.monotonic(), time.process_time(), monitor.ticks
    await asyncio.sleep(seconds)
    wall, cpu, ticks = time.monotonic() - wall0, time.process_time() - cpu0, monitor.ticks - ticks0
    await manager.stop()
    return wall, cpu, ticks, timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", action="store_true", help="sample the machine's GPUs through NVML")
    parser.add_argument("--kernels", type=int, default=200)
    parser.add_argument("--devices", type=int, default=8, help="fake devices (ignored with --real)")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=1.0)
    add_save_options(parser)
    args = parser.parse_args()

    if args.real:
        devices, problem = read_nvml_devices()
        if problem:
            sys.exit(problem)
        backend = PynvmlBackend()
    else:
        devices = [Device(i, f"Fake {i}", f"fake-{i}", 80 * GiB, i) for i in range(args.devices)]
        backend = FakeNvml()
    policy = build_policy("0.02", "1.0")
    ledger = LocalLedger(devices, policy)
    pairs = start_kernels(args.kernels)
    try:
        roots = {}
        for number, (shell, child) in enumerate(pairs):
            kernel_id = f"kernel-{number:04d}"
            roots[shell.pid] = kernel_id
            grant = ledger.grant(kernel_id, "bench", "python3", resolve(policy, "bench", "python3"))
            if not args.real:
                FakeNvml.set_usage(child, devices[grant.devices[0]].uuid, GiB)
        manager = GpuQuotaManager(
            policy,
            devices,
            ledger,
            Kernels(roots),
            backend,
            build_watchdog_settings("warn", "1GiB", 0, args.interval),
            user="bench",
        )
        monitor = manager.monitor
        wall, cpu, ticks, timings = asyncio.run(measure(manager, args.seconds, warmup=3))
        attributed = sum(len(v) for v in monitor.latest.kernels.values())
        assert monitor.latest.state == "ok", monitor.latest.message
        if not args.real:
            assert len(monitor.latest.kernels) == args.kernels, "every kernel's child process was attributed"
    finally:
        for shell, child in pairs:
            for pid in (child, shell.pid):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            shell.wait()

    steady = timings[3:] or timings
    report(
        "monitor_bench" + ("_real" if args.real else ""),
        {
            "backend": "pynvml" if args.real else "fake",
            "kernels": args.kernels,
            "devices": len(devices),
            "device_names": sorted({d.name for d in devices}),
            "poll_interval_s": args.interval,
            "window_s": round(wall, 2),
            "ticks": ticks,
            "cpu_s": round(cpu, 4),
            "cpu_percent_of_one_core": round(100 * cpu / wall, 3),
            "sample_ms_first": round(1000 * timings[0], 2),
            "sample_ms_p50": round(1000 * percentile(steady, 0.5), 3),
            "sample_ms_p95": round(1000 * percentile(steady, 0.95), 3),
            "kernels_with_usage": len(monitor.latest.kernels),
            "kernel_device_pairs": attributed,
            "goal": "under 1% of one core at 1 Hz",
        },
        save=args.save,
        out=args.out,
    )


if __name__ == "__main__":
    main()
