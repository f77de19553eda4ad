"""What the extension adds to every cell when room is there: execute_request to execute_reply of an empty cell,
a kernel of a server with gpu_quota_ext (overcommit 2, so the room check before each cell is armed) against a
kernel of a server without it, paired (issue 28: "the check at a cell's start costs nothing measurable when room
is there: <= 1 ms added per cell, median").

Both servers run side by side on a static 2-device inventory (no GPU needed; on a GPU machine add --nvml), one
kernel each, driven with jupyter_client over ZMQ as a notebook's cells are. Each round runs `--cells` cells on
one kernel, then on the other (the order alternates between rounds). What runs before each cell in the
extension's kernel: its pre_run_cell hooks (park_wait's wait while parked, room_check's test of the server's
last word, the usage sync's counters). The figure is the difference of the medians in milliseconds, with a
bootstrap 95% interval over the rounds, and the ratio of the medians.

    python benchmarks/cell_room_check_bench.py                 # 30 rounds of 50 cells
    python benchmarks/cell_room_check_bench.py --save          # also write benchmarks/results/
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_save_options, free_port, ratio_of_medians_ci, report  # noqa: E402

TOKEN = "bench"


class Server:
    """A jupyter_server with or without the extension, its kernels' connection files in its own runtime folder."""

    def __init__(self, workdir: Path, extension: bool, nvml: bool):
        self.port = free_port()
        self.runtime = workdir / "runtime"
        args = [
            sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
            f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={workdir}",
            f"--ServerApp.jpserver_extensions=gpu_quota_ext={extension}",
        ]
        if extension:
            config = {"GpuQuota": {"overcommit": 2.0, "default_cap": "0.4", "max_cap": "0.4"}}
            if not nvml:
                config["GpuQuota"]["inventory_class"] = "gpu_quota_ext.devices.StaticInventory"
                config["StaticInventory"] = {"devices": [{"total": "80GiB"}, {"total": "80GiB"}]}
            (workdir / "config.json").write_text(json.dumps(config))
            args.append(f"--config={workdir / 'config.json'}")
        if os.getuid() == 0:
            args.append("--allow-root")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_QUOTA_")}
        env.update(JUPYTER_RUNTIME_DIR=str(self.runtime), JUPYTER_CONFIG_DIR=str(workdir / "jupyter-config"))
        self.log = open(workdir / "server.log", "w")
        self.process = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.api("/api/status")
                break
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start; see {workdir / 'server.log'}") from None
                time.sleep(0.2)
        present = True
        try:
            self.api("/api/gpu-quota/status")
        except Exception:
            present = False
        if present != extension:
            raise SystemExit(f"the server {'lacks' if extension else 'has'} the extension: not a fair pair")

    def api(self, path: str, method: str = "GET", body=None):
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {TOKEN}"},
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read() or b"null")

    def client(self):
        from jupyter_client import BlockingKernelClient

        kernel_id = self.api("/api/kernels", "POST", {"name": "python3"})["id"]
        connection = self.runtime / f"kernel-{kernel_id}.json"
        deadline = time.monotonic() + 60
        while not connection.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"no connection file for kernel {kernel_id}")
            time.sleep(0.05)
        client = BlockingKernelClient(connection_file=str(connection))
        client.load_connection_file()
        client.start_channels(hb=False)
        client.wait_for_ready(timeout=60)
        return client

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def cell_seconds(client, cells: int) -> List[float]:
    """execute_request sent to execute_reply received, for `cells` empty cells, one after the other."""
    times = []
    for _ in range(cells):
        start = time.perf_counter()
        reply = client.execute("pass", store_history=False, reply=True, timeout=60)
        times.append(time.perf_counter() - start)
        if reply["content"]["status"] != "ok":
            raise SystemExit(f"a cell failed: {reply['content']}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--cells", type=int, default=50, help="cells per kernel per round")
    parser.add_argument("--nvml", action="store_true", help="the machine's GPUs through NVML")
    add_save_options(parser)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as on_dir, tempfile.TemporaryDirectory() as off_dir:
        servers = {"with": Server(Path(on_dir), True, options.nvml), "without": Server(Path(off_dir), False, False)}
        clients = {}
        try:
            clients = {name: server.client() for name, server in servers.items()}
            for client in clients.values():
                cell_seconds(client, 20)  # warm: imports, the first cells' own costs
            per_round = {name: [] for name in clients}
            every = {name: [] for name in clients}
            order = list(clients)
            for index in range(options.rounds):
                for name in (order if index % 2 == 0 else order[::-1]):
                    times = cell_seconds(clients[name], options.cells)
                    per_round[name].append(statistics.median(times))
                    every[name].extend(times)
        finally:
            for client in clients.values():
                client.stop_channels()
            for server in servers.values():
                server.stop()
    with_ext, without_ext = per_round["with"], per_round["without"]
    added_ms = 1000 * (statistics.median(with_ext) - statistics.median(without_ext))
    rng = random.Random(1)
    differences = []
    for _ in range(5000):
        pick = [rng.randrange(len(with_ext)) for _ in with_ext]
        a = statistics.median(with_ext[i] for i in pick)
        b = statistics.median(without_ext[i] for i in pick)
        differences.append(1000 * (a - b))
    differences.sort()
    low, high = ratio_of_medians_ci(with_ext, without_ext)
    figures = {
        "what": "an empty cell, execute_request to execute_reply, kernel of a server with gpu_quota_ext "
        "(overcommit 2: the room check armed) vs without, room there",
        "inventory": "nvml" if options.nvml else "static 2 x 80GiB",
        "rounds": options.rounds,
        "cells_per_round": options.cells,
        "median_with_ms": round(1000 * statistics.median(with_ext), 3),
        "median_without_ms": round(1000 * statistics.median(without_ext), 3),
        "added_ms_median": round(added_ms, 3),
        "added_ms_95ci": [round(differences[125], 3), round(differences[4874], 3)],
        "ratio_of_medians": round(statistics.median(with_ext) / statistics.median(without_ext), 3),
        "ratio_of_medians_95ci": [round(low, 3), round(high, 3)],
        "p95_every_cell_ms": {name: round(1000 * sorted(v)[int(0.95 * (len(v) - 1))], 3) for name, v in every.items()},
        "goal_added_ms": 1.0,
        "per_round_median_with_s": [round(x, 6) for x in with_ext],
        "per_round_median_without_s": [round(x, 6) for x in without_ext],
    }
    report("cell_room_check", figures, save=options.save, out=options.out)
    print(
        f"an empty cell: {figures['median_with_ms']} ms with the extension, {figures['median_without_ms']} ms "
        f"without; added {figures['added_ms_median']} ms (95% interval {figures['added_ms_95ci'][0]} to "
        f"{figures['added_ms_95ci'][1]}; goal <= 1 ms)"
    )


if __name__ == "__main__":
    main()
