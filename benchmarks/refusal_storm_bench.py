"""A storm of refused kernel starts against a real jupyter_server: what it costs and what it leaves behind.

The server runs in a child process (this script with --serve): the extension with a static inventory of
one 16 GiB device, a budget of half of it (overcommit 0.5), 8 GiB caps and on_full="refuse". One real
kernel fills the budget, so every later start is refused. This process then

  1. times GET /api/status (sequential, one keep-alive connection) and reads what the server holds;
  2. sends --count POST /api/kernels (default 10,000; at most --concurrency at once, loopback only),
     every one of which must be refused with HTTP 503;
  3. times GET /api/status again and reads what the server holds now.

What the server holds: connection files in its runtime directory, ports reserved in jupyter_client's
port cache, pending kernels, kernels, grants and kernel secrets (read through a route the --serve process
adds for this benchmark), and its threads, open files and RSS (psutil). After the storm each must be what
it was before, and the p95 latency the same. The run stops by itself (--count, or --timeout seconds).

    python benchmarks/refusal_storm_bench.py [--count 10000] [--concurrency 32] [--save]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import free_port, percentile, save  # noqa: E402

LEFTOVERS_ROUTE = "/bench/leftovers"


def serve(port: int, token: str) -> None:
    """The server: one full device, on_full refuse, and a route that reports what the server holds."""
    import threading

    from jupyter_client.connect import LocalPortCache
    from jupyter_server.base.handlers import APIHandler
    from jupyter_server.serverapp import ServerApp
    from tornado import web
    from traitlets.config import Config

    from gpu_quota_ext.manager import SETTINGS_KEY
    from gpu_quota_ext.usage.kernels import pending_kernels

    class Leftovers(APIHandler):
        @web.authenticated
        def get(self):
            km = self.kernel_manager
            manager = self.settings[SETTINGS_KEY]
            self.finish(
                json.dumps(
                    {
                        "reserved ports": len(LocalPortCache.instance().currently_used_ports),
                        "pending kernels": len(pending_kernels(km) or {}),
                        "kernels": len(km.list_kernel_ids()),
                        "grants": len(manager.ledger.grants()),
                        "kernel secrets": len(manager._tokens),
                        "python threads": threading.active_count(),
                    }
                )
            )

    config = Config(
        {
            "ServerApp": {
                "jpserver_extensions": {"gpu_quota_ext": True},
                "port": port,
                "ip": "127.0.0.1",
                "open_browser": False,
            },
            "IdentityProvider": {"token": token},
            "GpuQuota": {
                "inventory_class": "gpu_quota_ext.devices.StaticInventory",
                "default_cap": "0.5",
                "max_cap": "0.5",
                "overcommit": 0.5,
                "on_full": "refuse",
            },
            "StaticInventory": {"devices": [{"name": "Bench GPU", "total": "16GiB"}]},
        }
    )
    app = ServerApp.instance(config=config, allow_root=True, log_level="INFO")
    app.initialize(argv=[])
    app.web_app.add_handlers(".*$", [(LEFTOVERS_ROUTE, Leftovers)])
    app.start()


class Server:
    def __init__(self, port: int, token: str, runtime: Path):
        self.port, self.runtime = port, runtime
        self.headers = {"Authorization": f"token {token}"}
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def request(self, method: str, path: str, body: str = None):
        try:
            self.connection.request(method, path, body=body, headers=self.headers)
            response = self.connection.getresponse()
        except (OSError, http.client.HTTPException):
            self.connection.close()  # a new connection on the next request
            raise
        return response.status, response.read()

    def status_latencies(self, requests: int) -> list:
        latencies = []
        for number in range(requests + 20):
            began = time.perf_counter()
            status, _ = self.request("GET", "/api/status")
            elapsed = time.perf_counter() - began
            assert status == 200, status
            if number >= 20:  # the first requests warm caches
                latencies.append(elapsed)
        return latencies

    def holds(self, process: psutil.Process, settle_below: dict = None) -> dict:
        """What the server holds now. With `settle_below` (the figures before), wait up to 10 s for the
        server to close the storm's sockets and end its idle threads before reading threads and files."""
        deadline = time.monotonic() + 10
        while settle_below and time.monotonic() < deadline:
            if process.num_fds() <= settle_below["open files"] and process.num_threads() <= settle_below["OS threads"]:
                break
            time.sleep(0.1)
        status, body = self.request("GET", LEFTOVERS_ROUTE)
        assert status == 200, (status, body)
        held = json.loads(body)
        held["connection files"] = len(list(self.runtime.glob("kernel-*.json")))
        held["OS threads"] = process.num_threads()
        held["open files"] = process.num_fds()
        held["RSS MiB"] = round(process.memory_info().rss / 2**20, 1)
        return held


async def run_one_cell(port: int, token: str, kernel_id: str) -> None:
    """Run one cell in the kernel that fills the budget: once it answers, its start (imports, bootstrap)
    no longer weighs on the latencies measured before the storm."""
    from kernel_start_bench import execute_request
    from tornado.websocket import websocket_connect

    ws = await websocket_connect(f"ws://127.0.0.1:{port}/api/kernels/{kernel_id}/channels?token={token}")
    request = execute_request("x = 1")
    await ws.write_message(json.dumps(request))
    while True:
        message = await asyncio.wait_for(ws.read_message(), 120)
        if message is None:
            raise RuntimeError("the kernel's websocket closed")
        if isinstance(message, str):
            data = json.loads(message)
            if (
                data.get("msg_type") == "execute_reply"
                and data["parent_header"].get("msg_id") == request["header"]["msg_id"]
            ):
                break
    ws.close()


async def storm(port: int, token: str, count: int, concurrency: int, deadline: float) -> dict:
    """`count` POST /api/kernels, at most `concurrency` at once; the answers' status codes, counted."""
    from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

    client = AsyncHTTPClient(max_clients=concurrency, force_instance=True)
    url = f"http://127.0.0.1:{port}/api/kernels"
    codes: dict = {}
    messages: set = set()
    sent = 0

    async def one() -> None:
        try:
            response = await client.fetch(
                HTTPRequest(
                    url,
                    method="POST",
                    body=json.dumps({"name": "python3"}),
                    headers={"Authorization": f"token {token}"},
                    request_timeout=60,
                )
            )
            code = response.code
        except HTTPClientError as error:
            code = error.code
            if error.response is not None and len(messages) < 3:
                messages.add(json.loads(error.response.body).get("message"))
        codes[code] = codes.get(code, 0) + 1

    async def worker() -> None:
        nonlocal sent
        while sent < count and time.monotonic() < deadline:
            sent += 1
            await one()

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - began
    client.close()
    return {"sent": sent, "codes": codes, "messages": sorted(m for m in messages if m), "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=10_000, help="refused starts to send (default 10000)")
    parser.add_argument("--concurrency", type=int, default=32, help="starts in flight at once (default 32)")
    parser.add_argument(
        "--requests", type=int, default=500, help="GET /api/status timed before and after (default 500)"
    )
    parser.add_argument("--timeout", type=float, default=1200, help="stop the storm after this many seconds")
    parser.add_argument("--save", action="store_true", help="save the JSON under benchmarks/results/")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--token", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.token)
        return

    port, token = free_port(), secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as tmp:
        runtime, log_path = Path(tmp) / "runtime", Path(tmp) / "server.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_QUOTA_")}
        env.update(JUPYTER_RUNTIME_DIR=str(runtime), JUPYTER_CONFIG_DIR=str(Path(tmp) / "config"))
        with open(log_path, "w") as log:
            server_process = subprocess.Popen(
                [sys.executable, __file__, "--serve", str(port), "--token", token],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=tmp,
            )
        try:
            server = Server(port, token, runtime)
            deadline = time.monotonic() + 120
            while True:
                try:
                    if server.request("GET", "/api/status")[0] == 200:
                        break
                except OSError:
                    pass
                if server_process.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the server did not come up:\n{log_path.read_text()}")
                time.sleep(0.3)
            process = psutil.Process(server_process.pid)
            status, body = server.request("POST", "/api/kernels", json.dumps({"name": "python3"}))
            assert status == 201, (status, body)  # this kernel fills the budget
            holder = json.loads(body)["id"]
            asyncio.run(run_one_cell(port, token, holder))

            before_latencies = server.status_latencies(args.requests)
            before = server.holds(process)
            print(
                f"before: /api/status p95 {1000 * percentile(before_latencies, 0.95):.2f} ms; holds {before}",
                flush=True,
            )

            result = asyncio.run(storm(port, token, args.count, args.concurrency, time.monotonic() + args.timeout))
            print(f"storm: {result['sent']} starts in {result['seconds']:.1f} s, answers {result['codes']}", flush=True)

            after_latencies = server.status_latencies(args.requests)
            after = server.holds(process, settle_below=before)
            print(
                f"after:  /api/status p95 {1000 * percentile(after_latencies, 0.95):.2f} ms; holds {after}", flush=True
            )
            server.request("DELETE", f"/api/kernels/{holder}")
        finally:
            server_process.terminate()
            try:
                server_process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server_process.kill()
                server_process.wait()
        log_text = log_path.read_text(errors="replace")

    left_behind = {name: after[name] - before[name] for name in before if name != "RSS MiB"}
    figures = {
        "setup": "1 static 16 GiB device, overcommit 0.5, caps 0.5, on_full refuse, one kernel holding the budget",
        "refused_starts_sent": result["sent"],
        "concurrency": args.concurrency,
        "answers": {str(code): n for code, n in sorted(result["codes"].items())},
        "refusal_message": result["messages"],
        "storm_seconds": round(result["seconds"], 1),
        "refusals_per_second": round(result["sent"] / result["seconds"], 1),
        "status_requests_timed": args.requests,
        "status_ms_p50_before": round(1000 * percentile(before_latencies, 0.5), 2),
        "status_ms_p95_before": round(1000 * percentile(before_latencies, 0.95), 2),
        "status_ms_p50_after": round(1000 * percentile(after_latencies, 0.5), 2),
        "status_ms_p95_after": round(1000 * percentile(after_latencies, 0.95), 2),
        "server_before": before,
        "server_after": after,
        "left_behind": left_behind,
        "rss_growth_mib": round(after["RSS MiB"] - before["RSS MiB"], 1),
        "log_tracebacks": log_text.count("Traceback"),
        "log_bytes_per_refusal": round(len(log_text.encode()) / max(result["sent"], 1)),
    }
    if args.save:
        save("refusal_storm_bench", figures)
    else:
        print(json.dumps(figures, indent=2))
    ok = set(result["codes"]) == {503} and result["sent"] == args.count and not any(left_behind.values())
    print("nothing left behind" if ok else "SOMETHING WAS LEFT BEHIND, or a start was not refused")


if __name__ == "__main__":
    main()
