"""What fast_park on adds to a kernel's start, measured alone: the same server starts every kernel, half of them
with the fast park library in LD_PRELOAD and half without, so that only the preload differs.

kernel_start_bench.py --fast-park-ab compares two servers (fast_park on, fast_park off) from POST /api/kernels to
the first execute_reply over the websocket, as a browser sees it. That path carries jupyter_server's nudge (a
start falls in one of two modes 0.5 s apart) and two servers' own drift, so a 2 % difference is lost in its
spread (100 paired rounds on the H200: 1.044, 95 % interval 0.968 to 1.114). Here:

- one jupyter_server with the extension and fast_park on makes every kernel's environment, library included;
- two kernelspecs differ only in what runs the kernel: `env python -m ipykernel_launcher ...` (the library
  kept) and `env -u LD_PRELOAD python -m ipykernel_launcher ...` (removed); both pass through `env`, which starts
  with the library in both arms, so the one difference is the kernel's own Python process with or without it;
- each start is timed from POST /api/kernels to the kernel's kernel_info_reply on its shell channel, asked over
  ZMQ from its connection file (no websocket, so no nudge): the server's launch hook, the process, the loader,
  IPython and our startup file, everything a kernel's start is made of up to the moment it answers;
- each kernel then says whether the library is mapped in it (/proc/self/maps); a kernel in the wrong arm stops
  the run.

The websocket's handshake that follows is the same in both arms, so the ratio of these times is an upper bound of
the ratio a user sees. The paired rounds alternate which arm starts first.

Where starts spread widely (the H200 machine's: 1.3 to 1.6 s, drifting over minutes), `--process` measures the
same difference without the server or ZMQ's round trips: a Python process that does what the kernel does at start
(`IPKernelApp.initialize`: imports, sockets bound, the shell made, our startup file run) and exits, started with
the library in LD_PRELOAD or without, its wall time and its own CPU time (user + system, from wait4) paired. The
preload's only cost at start is the loader's (mapping a 35 KB library that depends on libc alone, and one more
library in every symbol lookup): CPU work in the process, which its CPU time shows with less noise than wall time.
That process has no grant's environment (no server gave it one), so our startup file finds nothing to cap and
watches no parks: its start is a little lighter than a real kernel's, which makes the ratio, if anything, larger.

    python benchmarks/kernel_start_preload_bench.py --rounds 200                     # static inventory (no GPU)
    python benchmarks/kernel_start_preload_bench.py --nvml --library .probe/libgqx_pages.so --rounds 200 --save
    python benchmarks/kernel_start_preload_bench.py --process --rounds 1000 --save  # the kernel's process alone

Goal (issue 29): fast_park on keeps kernel start within 1.02 of fast_park off.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq
from jupyter_client.asynchronous import AsyncKernelClient
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_save_options, paired_difference_ci, ratio_of_medians_ci, report  # noqa: E402
from kernel_start_bench import check_extension, seed_library_cache, start_server, wait_ready  # noqa: E402

from gpu_quota_ext.launch_env import STARTUP_FILE  # noqa: E402
from gpu_quota_ext.parking.pages import build as pages_build  # noqa: E402

ARMS = {"kept": "gq-bench-preload-kept", "removed": "gq-bench-preload-removed"}
MAPPED = f"{pages_build.LIBRARY_NAME!r} in open('/proc/self/maps').read()"
START_LIMIT = 120.0  # seconds: a kernel-like start that takes longer is killed, and the run stops with its words


def write_kernelspecs(data_dir: Path) -> None:
    """The two kernelspecs (JUPYTER_PATH=data_dir): the same kernel, run through `env`, with or without -u."""
    env = shutil.which("env") or "/usr/bin/env"
    launcher = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    for arm, name in ARMS.items():
        unset = ["-u", "LD_PRELOAD"] if arm == "removed" else []
        folder = data_dir / "kernels" / name
        folder.mkdir(parents=True)
        spec = {"argv": [env, *unset, *launcher], "display_name": name, "language": "python"}
        (folder / "kernel.json").write_text(json.dumps(spec))


async def shell_reply(client: AsyncKernelClient, msg_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        reply = await client.get_shell_msg(timeout=max(0.01, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply


async def time_start(base: str, runtime_dir: Path, kernelspec: str) -> tuple:
    """(seconds from POST /api/kernels to the kernel_info_reply, whether the library is mapped in the kernel)."""
    http = AsyncHTTPClient()
    started = time.perf_counter()
    response = await http.fetch(
        HTTPRequest(f"{base}/api/kernels?token=bench", method="POST", body=json.dumps({"name": kernelspec}))
    )
    kernel_id = json.loads(response.body)["id"]
    client = AsyncKernelClient()
    # The kernel binds its ports after the POST has answered: ZMQ then tries to connect again every RECONNECT_IVL
    # (100 ms by default), which would round each start up to the next try.
    client.context.setsockopt(zmq.RECONNECT_IVL, 1)
    done = False
    try:
        client.load_connection_file(str(runtime_dir / f"kernel-{kernel_id}.json"))
        client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
        await shell_reply(client, client.kernel_info(), timeout=120)
        elapsed = time.perf_counter() - started
        # Read after the clock stopped: the same cell in both arms, not part of the start.
        reply = await shell_reply(
            client, client.execute("", silent=True, user_expressions={"mapped": MAPPED}), timeout=60
        )
        mapped = reply["content"]["user_expressions"]["mapped"]["data"]["text/plain"] == "True"
        done = True
    finally:
        client.stop_channels()
        try:
            await http.fetch(HTTPRequest(f"{base}/api/kernels/{kernel_id}?token=bench", method="DELETE"))
        except Exception:  # broad: where the start failed (a dead kernel answers 404), its own error is the one told
            if done:
                raise
    return elapsed, mapped


# The kernel's start up to its event loop, then an exit whose code says whether the library is mapped (ipykernel
# has taken over the process's stdout by then).
KERNEL_INIT = f"""
import os, sys
from ipykernel.kernelapp import IPKernelApp
IPKernelApp.instance().initialize(["-f", sys.argv[1]])
os._exit(10 if {MAPPED} else 11)
"""


def time_process(connection_file: Path, library: str | None, cpu: int | None = None) -> tuple:
    """(wall seconds, the child's CPU seconds, whether the library was mapped) of one kernel-like start."""
    env = dict(os.environ, PYTHONSTARTUP=str(STARTUP_FILE))
    env.pop("LD_PRELOAD", None)
    if library:
        env["LD_PRELOAD"] = library
    log = connection_file.with_suffix(".log")  # ipykernel's warnings, every start: read only when one fails
    with open(log, "w") as stderr:
        started = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-c", KERNEL_INIT, str(connection_file)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            preexec_fn=None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu})),
        )
        stuck = threading.Timer(START_LIMIT, child.kill)  # a start that hangs ends the run instead of stalling it
        stuck.start()
        try:
            _, status, usage = os.wait4(child.pid, 0)
        finally:
            stuck.cancel()
        elapsed = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    if child.returncode not in (10, 11):
        raise RuntimeError(f"the kernel-like start failed: exit {child.returncode}: {log.read_text()[-2000:]}")
    log.unlink()
    return elapsed, usage.ru_utime + usage.ru_stime, child.returncode == 10


def process_rounds(rounds: int, library: str, workdir: Path, deadline: float, cpu: int | None = None) -> dict:
    """Paired kernel-like starts, alternating which arm goes first; a start in the wrong arm stops the run."""
    runs: dict = {"kept": [], "removed": [], "kept_cpu": [], "removed_cpu": []}
    for round_number in range(-1, rounds):  # round -1 warms the page cache, not counted
        if time.monotonic() > deadline:
            print(f"--max-seconds: stopped after {max(0, round_number)} rounds", file=sys.stderr, flush=True)
            break
        order = ["kept", "removed"] if round_number % 2 else ["removed", "kept"]
        for arm in order:
            connection_file = workdir / f"kernel-{round_number}-{arm}.json"
            wall, used, mapped = time_process(connection_file, library if arm == "kept" else None, cpu)
            connection_file.unlink(missing_ok=True)
            if mapped != (arm == "kept"):
                raise RuntimeError(f"round {round_number}, arm {arm}: the library's mapping is wrong")
            if round_number >= 0:
                runs[arm].append(wall)
                runs[f"{arm}_cpu"].append(used)
        if round_number >= 0 and (round_number + 1) % 100 == 0:
            print(f"[{round_number + 1}/{rounds}]", file=sys.stderr, flush=True)
    return runs


async def server_rounds(options, workdir: Path, deadline: float) -> dict:
    """Paired starts through one server with fast_park on (the two kernelspecs); a kernel in the wrong arm stops
    the run."""
    runtime_dir = workdir / "runtime"
    write_kernelspecs(workdir / "data")
    if options.library:
        seed_library_cache(Path(options.library), workdir / "cache")
    extra = {"JUPYTER_PATH": str(workdir / "data"), "JUPYTER_RUNTIME_DIR": str(runtime_dir)}
    server, url, _log = start_server(True, options.nvml, workdir, "on", extra_env=extra)
    runs: dict = {"kept": [], "removed": []}
    try:
        await wait_ready(url)
        await check_extension(url, expected=True)
        for arm, kernelspec in ARMS.items():  # warm: imports into the page cache, the library built
            _, mapped = await time_start(url, runtime_dir, kernelspec)
            if mapped != (arm == "kept"):
                raise RuntimeError(f"arm {arm}: the library is {'' if mapped else 'not '}mapped in the kernel")
        for round_number in range(options.rounds):
            if time.monotonic() > deadline:
                print(f"--max-seconds: stopped after {round_number} rounds", file=sys.stderr, flush=True)
                break
            order = list(ARMS.items())
            if round_number % 2:
                order.reverse()
            for arm, kernelspec in order:
                seconds, mapped = await time_start(url, runtime_dir, kernelspec)
                if mapped != (arm == "kept"):
                    raise RuntimeError(f"round {round_number}, arm {arm}: the library's mapping is wrong")
                runs[arm].append(seconds)
            if (round_number + 1) % 25 == 0:
                print(
                    f"[{round_number + 1}/{options.rounds}] median kept {statistics.median(runs['kept']):.4f} s, "
                    f"removed {statistics.median(runs['removed']):.4f} s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        server.terminate()  # it shuts its kernels down
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return runs


def compared(kept, removed, label: str) -> tuple:
    """The paired comparison's figures (ms) and its lines to print."""
    ratio = statistics.median(kept) / statistics.median(removed)
    low, high = ratio_of_medians_ci(kept, removed)
    difference = statistics.median(a - b for a, b in zip(kept, removed))
    difference_low, difference_high = paired_difference_ci(kept, removed)
    lines = [
        f"  {label}: library kept {1000 * statistics.median(kept):8.2f} ms, removed "
        f"{1000 * statistics.median(removed):8.2f} ms (medians)",
        f"    ratio of medians {ratio:.4f} (95% bootstrap interval {low:.4f} to {high:.4f}; goal <= 1.02)",
        f"    median paired difference {1000 * difference:+.2f} ms "
        f"(95% {1000 * difference_low:+.2f} to {1000 * difference_high:+.2f} ms)",
    ]
    figures = {
        "median_kept_ms": round(1000 * statistics.median(kept), 2),
        "median_removed_ms": round(1000 * statistics.median(removed), 2),
        "ratio_of_medians": round(ratio, 4),
        "ratio_of_medians_95ci": [round(low, 4), round(high, 4)],
        "median_paired_difference_ms": round(1000 * difference, 3),
        "median_paired_difference_95ci_ms": [round(1000 * difference_low, 3), round(1000 * difference_high, 3)],
        "kept_s": [round(x, 5) for x in kept],
        "removed_s": [round(x, 5) for x in removed],
    }
    return figures, lines


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200, help="paired rounds (default 200)")
    parser.add_argument("--nvml", action="store_true", help="use the machine's GPUs through NVML")
    parser.add_argument(
        "--process", action="store_true", help="the kernel's process alone (IPKernelApp.initialize), no server"
    )
    parser.add_argument(
        "--pin-cpu",
        type=int,
        help="with --process: every start on this one CPU (the same core's speed for both arms, no migrations)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        help="start no new round after this many seconds; the figures are of the rounds done (a lent machine's limit)",
    )
    parser.add_argument(
        "--library", help="a fast park library built elsewhere (else built here, or found in the cache, at start)"
    )
    add_save_options(parser)
    options = parser.parse_args()
    if options.rounds < 1:
        parser.error("--rounds: at least 1")
    if options.library and not Path(options.library).is_file():
        parser.error(f"--library {options.library}: not a file")
    if options.process and options.nvml:
        parser.error("--process starts no server: --nvml has no meaning there")
    if options.pin_cpu is not None and (not options.process or options.pin_cpu not in os.sched_getaffinity(0)):
        parser.error(f"--pin-cpu {options.pin_cpu}: with --process, one of this process's CPUs")
    deadline = time.monotonic() + options.max_seconds if options.max_seconds is not None else float("inf")

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if options.process:
            library = options.library or pages_build.preload_library()
            if not library:
                raise SystemExit("no fast park library: pass --library, or build it where a C compiler is")
            library = str(Path(library).resolve())
            runs = process_rounds(options.rounds, library, workdir, deadline, options.pin_cpu)
            sha256 = hashlib.sha256(Path(library).read_bytes()).hexdigest()
        else:
            runs = await server_rounds(options, workdir, deadline)
            built = sorted((workdir / "cache").rglob("*.so"))
            sha256 = hashlib.sha256(built[0].read_bytes()).hexdigest() if built else None

    if not runs["kept"]:
        raise SystemExit(f"no round done within --max-seconds {options.max_seconds}")
    if options.process:
        name = "kernel_start_preload_process"
        what = (
            "a kernel's process alone (IPKernelApp.initialize with our startup file, then exit), started with the "
            "fast park library in LD_PRELOAD ('kept') or without ('removed')"
        )
    else:
        name = "kernel_start_preload" + ("_nvml" if options.nvml else "_static")
        what = (
            "kernel start, POST /api/kernels to kernel_info_reply over ZMQ, one server with fast_park on: "
            "'kept' = the library in the kernel's LD_PRELOAD, 'removed' = taken out by the kernelspec (env -u)"
        )
    wall, lines = compared(runs["kept"], runs["removed"], "wall time")
    figures = {
        "what": what,
        "inventory": None if options.process else ("nvml" if options.nvml else "static 2 x 80GiB"),
        "rounds": len(runs["kept"]),
        "pinned_to_cpu": options.pin_cpu,
        "library_sha256": sha256,
        "goal_ratio": 1.02,
        "wall": wall,
    }
    if options.process:
        figures["cpu"], cpu_lines = compared(runs["kept_cpu"], runs["removed_cpu"], "the process's CPU (user + system)")
        lines += cpu_lines
    report(name, figures, options.save, options.out)
    print("\n".join([f"{name}, {len(runs['kept'])} paired rounds:", *lines]))


if __name__ == "__main__":
    asyncio.run(main())
