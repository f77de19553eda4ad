"""What the hard limit (NVIDIA MPS) costs: paired servers, hard_cap = "mps" (managed daemon) vs "off".

Two real jupyter_servers with gpu_quota_ext run side by side, the same but for c.GpuQuota.hard_cap; each
round starts one kernel on each, in alternating order, and times
  - kernel start: POST /api/kernels until the execute_reply of a one-line cell (the MPS check before
    each start included), and
  - first CUDA use: inside the kernel, after `import torch`, the time of `torch.ones(1, device="cuda")`
    and a synchronize (context creation; under MPS, also connecting to the MPS server).
Prints a table of medians and the median of the per-round ratios; saves JSON only with --save.

    python benchmarks/mps_bench.py --rounds 8                 # on a GPU machine with MPS
    python benchmarks/mps_bench.py --rounds 8 --fake          # no GPU: the fake control program, no CUDA part
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import free_port, save
from kernel_start_bench import execute_request, wait_ready
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.websocket import websocket_connect

from gpu_quota_ext.shared.contract import STATUS_PATH  # noqa: E402

FAKE_CONTROL = Path(__file__).parents[1] / "tests" / "fake_mps" / "nvidia-cuda-mps-control"
FIRST_CUDA = (
    "import time, torch\n"
    "began = time.perf_counter()\n"
    "torch.ones(1, device='cuda'); torch.cuda.synchronize()\n"
    "print('FIRST_CUDA', time.perf_counter() - began)\n"
)


def start_server(hard_cap: str, fake: bool, workdir: Path):
    port = free_port()
    runtime = Path(tempfile.mkdtemp(prefix=f"mps-{hard_cap}-", dir=workdir))
    args = [
        sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
        "--IdentityProvider.token=bench", f"--ServerApp.root_dir={workdir}",
        "--ServerApp.jpserver_extensions={'gpu_quota_ext': True}",
        f"--GpuQuota.hard_cap={hard_cap}", "--GpuQuota.default_cap=16GiB", "--GpuQuota.max_cap=16GiB",
    ]
    if os.getuid() == 0:
        args.append("--allow-root")
    if fake:
        args += [
            "--GpuQuota.inventory_class=gpu_quota_ext.devices.StaticInventory",
            '--StaticInventory.devices=[{"total": "80GiB", "uuid": "GPU-0000-bench"}]',
            f"--GpuQuota.mps_control={FAKE_CONTROL}",
        ]
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime))
    log = open(workdir / f"server-{hard_cap}.log", "w")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env), f"http://127.0.0.1:{port}"


async def run_cell(ws, code: str) -> str:
    request = execute_request(code)
    await ws.write_message(json.dumps(request))
    out = []
    while True:
        message = await asyncio.wait_for(ws.read_message(), 300)
        if message is None:
            raise RuntimeError("websocket closed")
        if isinstance(message, bytes):
            continue
        data = json.loads(message)
        if data["parent_header"].get("msg_id") != request["header"]["msg_id"]:
            continue
        if data.get("msg_type") == "stream":
            out.append(data["content"]["text"])
        elif data.get("msg_type") == "error":
            raise RuntimeError("\n".join(data["content"]["traceback"]))
        elif data.get("msg_type") == "execute_reply":
            return "".join(out)


async def one_round(base: str, cuda: bool) -> dict:
    client = AsyncHTTPClient()
    started = time.perf_counter()
    response = await client.fetch(HTTPRequest(f"{base}/api/kernels?token=bench", method="POST", body="{}"))
    kernel_id = json.loads(response.body)["id"]
    ws = await websocket_connect(f"{base.replace('http', 'ws')}/api/kernels/{kernel_id}/channels?token=bench")
    try:
        await run_cell(ws, "x = 1")
        figures = {"start_s": time.perf_counter() - started}
        if cuda:
            out = await run_cell(ws, FIRST_CUDA)
            figures["first_cuda_s"] = float(out.split("FIRST_CUDA", 1)[1].split()[0])
    finally:
        ws.close()
        await client.fetch(HTTPRequest(f"{base}/api/kernels/{kernel_id}?token=bench", method="DELETE"))
    return figures


async def check_modes(on: str, off: str) -> str:
    """The paired servers must differ by the hard limit and nothing else."""
    client = AsyncHTTPClient()
    states = []
    for base in (on, off):
        status = json.loads((await client.fetch(f"{base}{STATUS_PATH}?token=bench")).body)
        states.append(status["hard_cap"]["state"])
    if states != ["on", "off"]:
        raise RuntimeError(f"expected hard_cap on / off, the servers say {states}")
    return status["devices"][0]["name"] if status["devices"] else "no GPU"


def median_ms(values) -> float:
    return statistics.median(values) * 1000


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--fake", action="store_true", help="no GPU: fake MPS control, static inventory, no CUDA part")
    parser.add_argument("--save", action="store_true", help="write JSON to benchmarks/results/")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here (with --save)")
    options = parser.parse_args()
    cuda = not options.fake

    with tempfile.TemporaryDirectory(prefix="mpsb", dir="/tmp") as tmp:
        workdir = Path(tmp)
        on, on_url = start_server("mps", options.fake, workdir)
        off, off_url = start_server("off", options.fake, workdir)
        try:
            await asyncio.gather(wait_ready(on_url, 120), wait_ready(off_url, 120))
            device = await check_modes(on_url, off_url)
            await one_round(on_url, cuda)  # warm both (page cache, the MPS server's first start)
            await one_round(off_url, cuda)
            with_mps, without = [], []
            for number in range(options.rounds):
                order = [(on_url, with_mps), (off_url, without)]
                if number % 2:
                    order.reverse()
                for url, samples in order:
                    samples.append(await one_round(url, cuda))
        finally:
            for process in (on, off):
                process.terminate()
                process.wait(timeout=60)

    rows = [("kernel start to first reply", "start_s")]
    if cuda:
        rows.append(("first CUDA use (context)", "first_cuda_s"))
    figures = {
        "rounds": options.rounds,
        "device": device,
        "fake_control": options.fake,
        "with_mps": with_mps,
        "without_mps": without,
    }
    print(f"hard limit through MPS vs off, {options.rounds} paired rounds, {device}:")
    print(f"  {'':30s} {'with MPS':>10s} {'off':>10s} {'ratio':>7s}")
    for label, key in rows:
        a = [r[key] for r in with_mps]
        b = [r[key] for r in without]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        figures[key] = {"median_with_ms": median_ms(a), "median_without_ms": median_ms(b), "median_ratio": ratio}
        print(f"  {label:30s} {median_ms(a):8.1f}ms {median_ms(b):8.1f}ms {ratio:7.3f}")
    if options.save:
        save("mps_bench", figures, options.out)


if __name__ == "__main__":
    asyncio.run(main())
