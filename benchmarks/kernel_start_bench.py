"""Kernel start to first execute_reply through the REST API, with the extension vs without.

Two real jupyter_servers run side by side (one with gpu_quota_ext enabled, one with it disabled); each
round starts one kernel on each, in alternating order, and times POST /api/kernels until the
execute_reply of a one-line cell arrives over the kernel websocket. Paired rounds, medians, and the
median of the per-round ratios are printed and saved as JSON.

    python benchmarks/kernel_start_bench.py --rounds 15            # static 2-device inventory (no GPU)
    python benchmarks/kernel_start_bench.py --rounds 15 --nvml     # the machine's real GPUs
Goal (issue 2): median ratio at most 1.05.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.websocket import websocket_connect

RESULTS = Path(__file__).parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extension_on: bool, nvml: bool, workdir: Path):
    port = free_port()
    args = [
        sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
        "--IdentityProvider.token=bench", f"--ServerApp.root_dir={workdir}",
        f"--ServerApp.jpserver_extensions=gpu_quota_ext={extension_on}",
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
    log = open(workdir / f"server-{'on' if extension_on else 'off'}.log", "w")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


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
        "header": {"msg_id": msg_id, "username": "bench", "session": uuid.uuid4().hex, "msg_type": "execute_request",
                   "version": "5.3", "date": datetime.datetime.now(datetime.timezone.utc).isoformat()},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {}, "allow_stdin": False},
    }


async def check_extension(base: str, expected: bool) -> None:
    """The paired servers must differ by the extension and nothing else: ask each for its status route."""
    try:
        body = (await AsyncHTTPClient().fetch(f"{base}/api/gpu-quota/status?token=bench")).body
        present, devices = True, len(json.loads(body)["devices"])
    except Exception:
        present, devices = False, 0
    if present != expected:
        raise RuntimeError(f"{base}: extension {'missing' if expected else 'unexpectedly loaded'}")
    if expected:
        print(f"extension on: {devices} device(s) in its inventory", file=sys.stderr)


async def time_kernel_start(base: str) -> float:
    client = AsyncHTTPClient()
    started = time.perf_counter()
    response = await client.fetch(HTTPRequest(f"{base}/api/kernels?token=bench", method="POST", body="{}"))
    kernel_id = json.loads(response.body)["id"]
    ws = await websocket_connect(f"{base.replace('http', 'ws')}/api/kernels/{kernel_id}/channels?token=bench")
    request = execute_request("x = 1")
    await ws.write_message(json.dumps(request))
    while True:
        message = await asyncio.wait_for(ws.read_message(), 120)
        if message is None:
            raise RuntimeError("websocket closed")
        if isinstance(message, bytes):
            continue
        data = json.loads(message)
        if data.get("msg_type") == "execute_reply" and data["parent_header"].get("msg_id") == request["header"]["msg_id"]:
            break
    elapsed = time.perf_counter() - started
    ws.close()
    await client.fetch(HTTPRequest(f"{base}/api/kernels/{kernel_id}?token=bench", method="DELETE"))
    return elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--nvml", action="store_true", help="use the machine's GPUs through NVML")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write (default: benchmarks/results/)")
    options = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        on, on_url = start_server(True, options.nvml, workdir)
        off, off_url = start_server(False, options.nvml, workdir)
        try:
            await asyncio.gather(wait_ready(on_url), wait_ready(off_url))
            await time_kernel_start(on_url)  # warm both (imports into the page cache)
            await time_kernel_start(off_url)
            await check_extension(on_url, expected=True)
            await check_extension(off_url, expected=False)
            with_ext, without_ext = [], []
            for round_number in range(options.rounds):
                order = [(on_url, with_ext), (off_url, without_ext)]
                if round_number % 2:
                    order.reverse()  # alternate which server goes first
                for url, samples in order:
                    samples.append(await time_kernel_start(url))
        finally:
            for process in (on, off):
                process.terminate()
                process.wait(timeout=30)

    ratios = [a / b for a, b in zip(with_ext, without_ext)]
    result = {
        "benchmark": "kernel start to first execute_reply (REST + websocket)",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "inventory": "nvml" if options.nvml else "static 2 x 80GiB",
        "rounds": options.rounds,
        "with_extension_s": with_ext,
        "without_extension_s": without_ext,
        "median_with_s": statistics.median(with_ext),
        "median_without_s": statistics.median(without_ext),
        "median_ratio": statistics.median(ratios),
        "goal_ratio": 1.05,
    }
    print(f"kernel start, {options.rounds} paired rounds ({result['inventory']}):")
    print(f"  with extension    median {result['median_with_s'] * 1000:7.1f} ms")
    print(f"  without extension median {result['median_without_s'] * 1000:7.1f} ms")
    print(f"  median paired ratio      {result['median_ratio']:.3f}  (goal <= 1.05)")
    out = options.out or RESULTS / f"kernel_start_{result['date']}_{'nvml' if options.nvml else 'static'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    asyncio.run(main())
