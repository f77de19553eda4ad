"""`GET /api/gpu-quota/status` latency with 200 kernels, p50 / p95, against a real jupyter_server.

The server runs in a child process (this script with --serve): the extension loaded with a static
inventory of 8 devices and the fake NVML, 200 grants made directly in its ledger, and 200 real processes
carrying those kernels' ids in their environment (found by the monitor through /proc/PID/environ) that the
fake NVML says use memory, plus an allocator report per kernel, so every kernel's entry is complete. The
monitor samples at 1 Hz throughout. This process times sequential requests over one keep-alive connection.

    python benchmarks/status_api_bench.py [--kernels 200] [--requests 1000]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import percentile, save  # noqa: E402

DEVICES = 8


def serve(port: int, token: str, kernels: int) -> None:
    from jupyter_server.serverapp import ServerApp
    from traitlets.config import Config

    from gpu_quota_ext.names import KERNEL_ID
    from gpu_quota_ext.policy import GiB, resolve
    from gpu_quota_ext.provisioner import SETTINGS_KEY
    from gpu_quota_ext.testing import FakeNvml

    config = Config(
        {
            "ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}, "port": port, "open_browser": False},
            "IdentityProvider": {"token": token},
            "GpuQuota": {
                "inventory_class": "gpu_quota_ext.devices.StaticInventory",
                "nvml_class": "gpu_quota_ext.testing.FakeNvml",
                "default_cap": "0.02",
                "poll_interval": 1.0,
            },
            "StaticInventory": {"devices": [{"name": f"Bench GPU {i}", "total": "80GiB"} for i in range(DEVICES)]},
        }
    )
    app = ServerApp.instance(config=config, allow_root=True, log_level="WARN")
    app.initialize(argv=[])
    service = app.web_app.settings[SETTINGS_KEY]
    children = []
    for number in range(kernels):
        kernel_id = f"bench-{number:04d}-{secrets.token_hex(4)}"
        grant = service.ledger.grant(kernel_id, service.user, "python3", resolve(service.policy, service.user, "python3"))
        child = subprocess.Popen(["sleep", "3600"], env={**os.environ, KERNEL_ID: kernel_id})
        children.append(child)
        device = grant.devices[0]
        FakeNvml.set_usage(child.pid, f"static-{device}", GiB + number)
        service.monitor.report(kernel_id, [{"index": device, "allocated": number, "reserved": 2 * number, "peak": 3 * number}])
    try:
        app.start()
    finally:
        for child in children:
            child.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=200)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--token", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also write the JSON result to this file")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.token, args.kernels)
        return

    port, token = free_port(), secrets.token_hex(16)
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--token", token, "--kernels", str(args.kernels)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        headers = {"Authorization": f"token {token}"}
        deadline = time.monotonic() + 120
        while True:  # until the server answers and the monitor has attributed every kernel's process
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                connection.request("GET", "/api/gpu-quota/status", headers=headers)
                response = connection.getresponse()
                state = json.loads(response.read())
                if response.status == 200 and sum(1 for k in state["kernels"] if k["devices"][0]["used"]) == args.kernels:
                    break
            except (OSError, ValueError, KeyError):
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the server did not come up:\n{server.stderr.read() if server.poll() is not None else ''}")
            time.sleep(0.5)

        latencies, size = [], 0
        for number in range(args.requests + 50):
            began = time.perf_counter()
            connection.request("GET", "/api/gpu-quota/status", headers=headers)
            response = connection.getresponse()
            body = response.read()
            elapsed = time.perf_counter() - began
            assert response.status == 200
            if number >= 50:  # the first requests warm caches
                latencies.append(elapsed)
                size = len(body)
        state = json.loads(body)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()

    save(
        "status_api_bench",
        {
            "kernels": len(state["kernels"]),
            "devices": len(state["devices"]),
            "monitor_state": state["monitor"]["state"],
            "requests": len(latencies),
            "response_bytes": size,
            "latency_ms_p50": round(1000 * percentile(latencies, 0.5), 2),
            "latency_ms_p95": round(1000 * percentile(latencies, 0.95), 2),
            "latency_ms_p99": round(1000 * percentile(latencies, 0.99), 2),
            "latency_ms_max": round(1000 * max(latencies), 2),
            "goal": "p95 under 20 ms",
        },
        args.out,
    )


if __name__ == "__main__":
    main()
