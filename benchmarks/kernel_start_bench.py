"""Kernel start to first execute_reply through the REST API, with the extension vs without.

Two real jupyter_servers run side by side (one with gpu_quota_ext enabled, one with it disabled); each
round starts one kernel on each, in alternating order, and times POST /api/kernels until the
execute_reply of a one-line cell arrives over the kernel websocket, as a browser sees it.

Per-start times are bimodal (measured here: about 0.5 s apart). The servers run with --debug, and for
each start the script counts in the server's log the "Nudge: attempt N" lines of jupyter_server's
websocket connection: before it lets a websocket through, it sends kernel_info_request on shell and
control and waits for an IOPub message, and it repeats that every 0.5 s. When the first nudge's IOPub
message is lost (the kernel published it before the server's IOPub subscription had reached it), the
start takes one more 0.5 s round. The result shows each mode with its nudge count, so the split is
measured, not guessed. That wait belongs to jupyter_server, with or without the extension; but which mode
a start falls in shifts the median by a whole mode, so the figure is the ratio of the medians with a
bootstrap 95% confidence interval over paired rounds (resampled with replacement), and the rounds that
the default gives keep that interval narrow enough to tell a 5% difference.

    python benchmarks/kernel_start_bench.py                       # static 2-device inventory (no GPU)
    python benchmarks/kernel_start_bench.py --nvml                # the machine's real GPUs
    python benchmarks/kernel_start_bench.py --rounds 100 --save   # also write benchmarks/results/
    python benchmarks/kernel_start_bench.py --fast-park-ab        # fast_park on vs off, both with the extension
    python benchmarks/kernel_start_bench.py --nvml --fast-park-ab --library .probe/libgqx_pages.so
                                          # on a GPU machine without a compiler: the library built elsewhere
Goal (issue 2): ratio at most 1.05.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.websocket import websocket_connect

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_save_options, free_port, ratio_of_medians_ci, report  # noqa: E402

from gpu_quota_ext.parking.pages import build as pages_build  # noqa: E402
from gpu_quota_ext.shared.contract import STATUS_PATH  # noqa: E402

NUDGE = re.compile(r"Nudge: attempt (\d+) on kernel ([0-9a-f-]{36})")


def start_server(extension_on: bool, nvml: bool, workdir: Path, fast_park: str = "", extra_env=None):
    """The server process, its URL and its log; `extra_env` is added to its environment (kernelspecs, runtime dir)."""
    port = free_port()
    args = [
        sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
        "--IdentityProvider.token=bench", f"--ServerApp.root_dir={workdir}",
        f"--ServerApp.jpserver_extensions=gpu_quota_ext={extension_on}",
        "--debug",  # the Nudge lines, for the modes
    ]
    if os.getuid() == 0:
        args.append("--allow-root")
    if extension_on and not nvml:
        config = workdir / "static_inventory.json"
        config.write_text(json.dumps({
            "GpuQuota": {"inventory_class": "gpu_quota_ext.devices.StaticInventory"},
            "StaticInventory": {"devices": [{"total": "80GiB"}, {"total": "80GiB"}]},
        }))
        args.append(f"--config={config}")
    env = dict(os.environ)
    if fast_park:
        args.append(f"--GpuQuota.fast_park={fast_park}")
        env["XDG_CACHE_HOME"] = str(workdir / "cache")  # the library is built at the first launch, as a user's is
    env.update(extra_env or {})
    name = f"fast-park-{fast_park}" if fast_park else ("on" if extension_on else "off")
    log_path = workdir / f"server-{name}.log"
    log = open(log_path, "w")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    return process, f"http://127.0.0.1:{port}", log_path


async def wait_ready(base: str, timeout: float = 60) -> None:
    client = AsyncHTTPClient()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            await client.fetch(f"{base}/api/status?token=bench")
            return
        except Exception:
            await asyncio.sleep(0.2)
    raise RuntimeError(f"server at {base} did not start")


def execute_request(code: str) -> dict:
    msg_id = uuid.uuid4().hex
    return {
        "header": {
            "msg_id": msg_id,
            "username": "bench",
            "session": uuid.uuid4().hex,
            "msg_type": "execute_request",
            "version": "5.3",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        },
        "parent_header": {},
        "metadata": {},
        "channel": "shell",
        "buffers": [],
        "content": {
            "code": code,
            "silent": False,
            "store_history": False,
            "user_expressions": {},
            "allow_stdin": False,
        },
    }


async def check_extension(base: str, expected: bool) -> None:
    """The paired servers must differ by the extension and nothing else: ask each for its status route."""
    try:
        body = (await AsyncHTTPClient().fetch(f"{base}{STATUS_PATH}?token=bench")).body
        present, devices = True, len(json.loads(body)["devices"])
    except Exception:
        present, devices = False, 0
    if present != expected:
        raise RuntimeError(f"{base}: extension {'missing' if expected else 'unexpectedly loaded'}")
    if expected:
        print(f"extension on: {devices} device(s) in its inventory", file=sys.stderr)


async def time_kernel_start(base: str):
    """(seconds from POST /api/kernels to the first execute_reply, seconds until the websocket opened, kernel id)."""
    client = AsyncHTTPClient()
    started = time.perf_counter()
    response = await client.fetch(HTTPRequest(f"{base}/api/kernels?token=bench", method="POST", body="{}"))
    kernel_id = json.loads(response.body)["id"]
    ws = await websocket_connect(f"{base.replace('http', 'ws')}/api/kernels/{kernel_id}/channels?token=bench")
    opened = time.perf_counter() - started
    request = execute_request("x = 1")
    await ws.write_message(json.dumps(request))
    while True:
        message = await asyncio.wait_for(ws.read_message(), 120)
        if message is None:
            raise RuntimeError("websocket closed")
        if isinstance(message, bytes):
            continue
        data = json.loads(message)
        if (
            data.get("msg_type") == "execute_reply"
            and data["parent_header"].get("msg_id") == request["header"]["msg_id"]
        ):
            break
    elapsed = time.perf_counter() - started
    ws.close()
    await client.fetch(HTTPRequest(f"{base}/api/kernels/{kernel_id}?token=bench", method="DELETE"))
    return elapsed, opened, kernel_id


def seed_library_cache(library: Path, cache_home: Path) -> None:
    """The fast park library where the server looks for it under XDG_CACHE_HOME=cache_home (pages/build.py's
    cache_dir), so that a machine without a C compiler runs the fast_park A/B with one built elsewhere."""
    target = pages_build.cache_dir(cache_home)
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(library, target / pages_build.LIBRARY_NAME)


def nudges_per_kernel(log_path: Path) -> dict:
    """kernel id -> how many kernel_info nudges jupyter_server sent before it let the websocket through."""
    counts: dict = {}
    for match in NUDGE.finditer(log_path.read_text(errors="replace")):
        counts[match.group(2)] = max(counts.get(match.group(2), 0), int(match.group(1)))
    return counts


def modes(samples, nudges) -> dict:
    """Per number of nudges: how many starts, and their median time (ms)."""
    groups = collections.defaultdict(list)
    for seconds, count in zip(samples, nudges):
        groups[count].append(seconds)
    return {
        str(count): {
            "starts": len(times),
            "median_ms": round(1000 * statistics.median(times), 1),
            "min_ms": round(1000 * min(times), 1),
            "max_ms": round(1000 * max(times), 1),
        }
        for count, times in sorted(groups.items())
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rounds", type=int, default=200, help="paired rounds (default 200: see the interval it gives)"
    )
    parser.add_argument("--nvml", action="store_true", help="use the machine's GPUs through NVML")
    parser.add_argument(
        "--fast-park-ab",
        action="store_true",
        help="both servers with the extension: fast_park on (the library preloaded into every kernel) vs off",
    )
    parser.add_argument(
        "--library",
        help="with --fast-park-ab: a fast park library built elsewhere, put in the server's cache (else built there)",
    )
    add_save_options(parser)
    options = parser.parse_args()
    if options.library and not (options.fast_park_ab and Path(options.library).is_file()):
        parser.error(f"--library {options.library}: a library file, with --fast-park-ab")

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        ab = options.fast_park_ab
        if ab and options.library:
            seed_library_cache(Path(options.library), workdir / "cache")
        on, on_url, on_log = start_server(True, options.nvml, workdir, "on" if ab else "")
        off, off_url, off_log = start_server(ab, options.nvml, workdir, "off" if ab else "")
        try:
            await asyncio.gather(wait_ready(on_url), wait_ready(off_url))
            await time_kernel_start(on_url)  # warm both (imports into the page cache; the library built)
            await time_kernel_start(off_url)
            await check_extension(on_url, expected=True)
            await check_extension(off_url, expected=ab)
            runs = {"with": [], "without": []}
            for round_number in range(options.rounds):
                order = [(on_url, "with"), (off_url, "without")]
                if round_number % 2:
                    order.reverse()  # alternate which server goes first
                for url, key in order:
                    runs[key].append(await time_kernel_start(url))
        finally:
            for process in (on, off):
                process.terminate()
                process.wait(timeout=30)
        nudges = {"with": nudges_per_kernel(on_log), "without": nudges_per_kernel(off_log)}
        built = sorted(str(p.relative_to(workdir)) for p in (workdir / "cache").rglob("*.so"))

    with_ext = [r[0] for r in runs["with"]]
    without_ext = [r[0] for r in runs["without"]]
    counts = {key: [nudges[key].get(r[2], 0) for r in runs[key]] for key in runs}
    ratio = statistics.median(with_ext) / statistics.median(without_ext)
    low, high = ratio_of_medians_ci(with_ext, without_ext)
    figures = {
        "what": "kernel start to first execute_reply (REST + websocket)"
        + (": 'with' = fast_park on (library preloaded), 'without' = fast_park off" if options.fast_park_ab else ""),
        "inventory": "nvml" if options.nvml else "static 2 x 80GiB",
        "rounds": options.rounds,
        "median_with_ms": round(1000 * statistics.median(with_ext), 1),
        "median_without_ms": round(1000 * statistics.median(without_ext), 1),
        "ratio_of_medians": round(ratio, 3),
        "ratio_of_medians_95ci": [round(low, 3), round(high, 3)],
        "median_paired_ratio": round(statistics.median(a / b for a, b in zip(with_ext, without_ext)), 3),
        "modes_by_nudges_with": modes(with_ext, counts["with"]),
        "modes_by_nudges_without": modes(without_ext, counts["without"]),
        "websocket_open_median_ms": {key: round(1000 * statistics.median(r[1] for r in runs[key]), 1) for key in runs},
        "with_extension_s": [round(x, 4) for x in with_ext],
        "without_extension_s": [round(x, 4) for x in without_ext],
        "nudges_with": counts["with"],
        "nudges_without": counts["without"],
        "goal_ratio": 1.05,
    }
    if options.fast_park_ab:
        # The 'with' server's kernels preload it: built at its first launch, or the one --library put in its cache.
        if options.library:
            figures["fast_park_library_seeded_from"] = options.library
            figures["fast_park_library_sha256"] = hashlib.sha256(Path(options.library).read_bytes()).hexdigest()
        else:
            figures["fast_park_library_built_at_first_launch"] = built
    name = "kernel_start" + ("_fast_park_ab" if options.fast_park_ab else "") + ("_nvml" if options.nvml else "_static")
    report(name, figures, save=options.save, out=options.out)
    with_name, without_name = ("fast park on", "fast park off") if options.fast_park_ab else ("with", "without")
    print(f"kernel start, {options.rounds} paired rounds ({figures['inventory']}):")
    print(f"  {with_name:>13}: median {figures['median_with_ms']:7.1f} ms")
    print(f"  {without_name:>13}: median {figures['median_without_ms']:7.1f} ms")
    print(f"  ratio of medians         {ratio:.3f}  (95% bootstrap interval {low:.3f} to {high:.3f}; goal <= 1.05)")
    for key in ("with", "without"):
        for count, mode in figures[f"modes_by_nudges_{key}"].items():
            print(
                f"  {key:>7} extension, {count} nudge(s): {mode['starts']:3d} starts, median {mode['median_ms']:7.1f} "
                "ms"
            )


if __name__ == "__main__":
    asyncio.run(main())
