"""`GET /api/gpu-quota/status` latency with 200 kernels, p50 / p95, against a real jupyter_server.

The server runs in a child process (this script with --serve): the extension loaded with a static
inventory of 8 devices and the fake NVML. It starts 200 real kernels through its own kernel manager (the
code path of `POST /api/kernels`), each of a kernelspec whose process is an idle `sleep`: real kernels to
the server (listed, alive, each with its grant from the launch hook), at the cost of a process each
instead of an ipykernel each. The fake NVML says each kernel's process uses memory, and each kernel has an
allocator report, so every kernel's entry is complete. The monitor samples at 1 Hz throughout. This
process times sequential requests over one keep-alive connection, prints the figures, and writes them
under benchmarks/results/ only with --save. Every kernel process is gone when it returns.

    python benchmarks/status_api_bench.py [--kernels 200] [--requests 1000] [--save]

(Before, the 200 kernels were grants made directly in the ledger, for kernels the server did not know:
since the monitor releases the grants of kernels that are gone, it released them, and the wait for 200
kernels in the status never ended.)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_save_options, free_port, percentile, report  # noqa: E402

from gpu_quota_ext.shared.contract import STATUS_PATH  # noqa: E402

DEVICES = 8
KERNELSPEC = "gpu-quota-bench-idle"


def write_kernelspec(data_dir: Path) -> None:
    """An idle process as a kernel: the server starts, lists, watches and shuts it down like any other."""
    spec_dir = data_dir / "kernels" / KERNELSPEC
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {"argv": ["sleep", "900"], "display_name": "gpu-quota-ext bench: an idle process", "language": "none"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))


def serve(port: int, token: str, kernels: int, pid_file: str) -> None:
    from jupyter_server.serverapp import ServerApp
    from traitlets.config import Config

    from gpu_quota_ext.devices.fake_nvml import FakeNvml
    from gpu_quota_ext.manager import SETTINGS_KEY
    from gpu_quota_ext.shared.sizes import GiB

    config = Config(
        {
            "ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}, "port": port, "open_browser": False},
            "IdentityProvider": {"token": token},
            "GpuQuota": {
                "inventory_class": "gpu_quota_ext.devices.StaticInventory",
                "nvml_class": "gpu_quota_ext.devices.fake_nvml.FakeNvml",
                "default_cap": "0.02",
                "poll_interval": 1.0,
            },
            "StaticInventory": {"devices": [{"name": f"Bench GPU {i}", "total": "80GiB"} for i in range(DEVICES)]},
        }
    )
    app = ServerApp.instance(config=config, allow_root=True, log_level="WARN")
    app.initialize(argv=[])
    manager = app.web_app.settings[SETTINGS_KEY]

    async def start_kernels() -> None:
        kernel_manager = app.kernel_manager
        for number in range(kernels):
            kernel_id = await kernel_manager.start_kernel(kernel_name=KERNELSPEC)
            pid = kernel_manager.get_kernel(kernel_id).provisioner.process.pid
            with open(pid_file, "a") as pids:
                pids.write(f"{pid}\n")
            device = manager.ledger.get(kernel_id).devices[0]
            FakeNvml.set_usage(pid, f"static-{device}", GiB + number)
            manager.reports.report(
                kernel_id, [{"index": device, "allocated": number, "reserved": 2 * number, "peak": 3 * number}]
            )

    app.io_loop.add_callback(start_kernels)
    app.start()  # until SIGTERM; shutting down, the server stops every kernel


def status(connection: http.client.HTTPConnection, headers: dict):
    connection.request("GET", STATUS_PATH, headers=headers)
    response = connection.getresponse()
    return response.status, response.read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=200)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--token", help=argparse.SUPPRESS)
    parser.add_argument("--pids", help=argparse.SUPPRESS)
    add_save_options(parser)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.token, args.kernels, args.pids)
        return

    port, token = free_port(), secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="gq-status-bench-") as tmp:
        work = Path(tmp)
        write_kernelspec(work / "data")
        pid_file = work / "kernel-pids"
        env = dict(os.environ, JUPYTER_PATH=str(work / "data"), JUPYTER_RUNTIME_DIR=str(work / "runtime"))
        server = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve",
                str(port),
                "--token",
                token,
                "--kernels",
                str(args.kernels),
                "--pids",
                str(pid_file),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=work,
        )
        headers = {"Authorization": f"token {token}"}
        try:
            deadline = time.monotonic() + 60 + args.kernels
            began = time.monotonic()
            while True:  # until the server answers with every kernel, its process attributed by the monitor
                try:
                    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                    code, body = status(connection, headers)
                    state = json.loads(body)
                    if (
                        code == 200
                        and sum(1 for k in state["kernels"] if k["devices"] and k["devices"][0]["used"]) == args.kernels
                    ):
                        break
                except (OSError, ValueError, KeyError):
                    pass
                if server.poll() is not None:
                    sys.exit(f"the server exited:\n{server.stderr.read()}")
                if time.monotonic() > deadline:
                    sys.exit(f"{args.kernels} kernels were not all in the status after {deadline - began:.0f} s")
                time.sleep(0.5)
            print(
                f"{args.kernels} kernels running and attributed after {time.monotonic() - began:.1f} s", file=sys.stderr
            )

            latencies, size = [], 0
            for number in range(args.requests + 50):
                started = time.perf_counter()
                code, body = status(connection, headers)
                elapsed = time.perf_counter() - started
                assert code == 200
                if number >= 50:  # the first requests warm caches
                    latencies.append(elapsed)
                    size = len(body)
            state = json.loads(body)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            left = []
            for line in pid_file.read_text().split() if pid_file.exists() else []:
                try:
                    os.kill(int(line), signal.SIGKILL)  # only if the server did not stop it
                    left.append(int(line))
                except ProcessLookupError:
                    pass
            if left:
                print(f"killed {len(left)} kernel process(es) the server left behind", file=sys.stderr)

    report(
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
            "kernel_processes_left_behind": len(left),
            "goal": "p95 under 20 ms",
        },
        save=args.save,
        out=args.out,
    )


if __name__ == "__main__":
    main()
