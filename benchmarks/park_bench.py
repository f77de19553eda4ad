"""What parking costs on a real GPU: park and resume through the server vs the raw driver calls, paired.

One real jupyter_server with gpu_quota_ext (real NVML, the real CUDA checkpoint driver). For each size,
one kernel holds that many bytes in a torch tensor; each round, in alternating order,
  - server: POST kernels/<id>/park until the status says "parked" (and the server's own `since` times of
    parking -> parked), then POST .../resume until it is back;
  - raw: the same driver calls from this process (lock + checkpoint, restore + unlock), timed around them;
and then the first cell after a park (the resume it triggers included) against the same cell unparked,
and the bytes NVML saw the kernel's process give back. Prints medians and the median of the per-round
ratios (server / raw; goal of issue 13: within 10 %); writes JSON only when asked.

    python benchmarks/park_bench.py                          # 2 and 20 GiB, 3 rounds each
    python benchmarks/park_bench.py --sizes 2 --rounds 5 --save
`--save` writes benchmarks/results/park-<date>-<device>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, add_save_options, free_port, report  # noqa: E402

from gpu_quota_ext.parking.checkpoint import CheckpointUnavailable, CudaCheckpointDriver  # noqa: E402

GiB = 1 << 30
TOKEN = "park-bench"
# The checksum 16 Mi elements at a time: a whole-tensor int64 sum makes torch allocate 8x the uint8 tensor
# (20 GiB -> an OOM asking 160 GiB; 2 GiB -> 16 GiB kept reserved), so the kernel would not hold what it says.
CHECKSUM = "sum(int(part.sum(dtype=torch.int64)) for part in x.split(1 << 24))"
HOLD = (
    "import torch\n"
    "x = torch.empty({n}, dtype=torch.uint8, device='cuda'); x.random_(0, 251); torch.cuda.synchronize()\n"
    f"print({CHECKSUM})\n"
)
CHECK = f"print({CHECKSUM})"


class BenchServer:
    DEFAULTS = ("--GpuQuota.default_cap=0.75", "--GpuQuota.max_cap=1.0", "--GpuQuota.poll_interval=0.25")

    def __init__(self, workdir: Path, settings=DEFAULTS):
        self.port = free_port()
        self.runtime = workdir / "runtime"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_QUOTA_")}
        env.update(JUPYTER_RUNTIME_DIR=str(self.runtime), JUPYTER_CONFIG_DIR=str(workdir / "config"))
        args = [
            sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
            f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={workdir}",
            "--ServerApp.jpserver_extensions={'gpu_quota_ext': True}", *settings,
        ]
        if os.getuid() == 0:
            args.append("--allow-root")
        self.log = open(workdir / "server.log", "w")
        self.process = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                self.api("/api/gpu-quota/status")
                return
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the server did not start; see " + str(workdir / "server.log")) from None
                time.sleep(0.2)

    def api(self, path, method="GET", body=None):
        request = urllib.request.Request(
            self.url + path, method=method, data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {TOKEN}"},
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            return json.loads(answer.read() or b"null")

    def park_state(self, kernel_id):
        return next(k for k in self.api("/api/gpu-quota/status")["kernels"] if k["id"] == kernel_id)["park"]

    def wait(self, kernel_id, states, timeout=600, step=0.01):
        deadline = time.monotonic() + timeout
        while True:
            park = self.park_state(kernel_id)
            if park["state"] in states:
                return park
            if "parked" in states and (park["reason"] or "").startswith("did not park"):
                raise SystemExit(f"kernel {kernel_id} did not park: {park}")
            if time.monotonic() > deadline:
                raise SystemExit(f"kernel {kernel_id}: not {states} within {timeout} s: {park}")
            time.sleep(step)

    def wait_parkable(self, kernel_id, timeout=60):
        """Until the monitor has sampled the kernel's memory (after a resume the next sample shows it)."""
        deadline = time.monotonic() + timeout
        while not self.park_state(kernel_id)["parkable"]:
            if time.monotonic() > deadline:
                raise SystemExit(f"kernel not parkable: {self.park_state(kernel_id)}")
            time.sleep(0.05)

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def run_cell(connection_file: Path, code: str, timeout=600) -> str:
    from jupyter_client import BlockingKernelClient

    client = BlockingKernelClient(connection_file=str(connection_file))
    client.load_connection_file()
    client.start_channels(hb=False)  # a busy GPU host can miss a beat: only the timeout decides
    try:
        client.wait_for_ready(timeout=timeout)
        out = []
        reply = client.execute_interactive(
            code, timeout=timeout,
            output_hook=lambda m: out.append(m["content"]["text"]) if m["msg_type"] == "stream" else None,
        )
        if reply["content"]["status"] != "ok":
            raise SystemExit(f"cell failed: {code}\n{reply['content']}")
        return "".join(out)
    finally:
        client.stop_channels()


def nvml_used(pid: int) -> int:
    import pynvml

    pynvml.nvmlInit()
    used = 0
    for i in range(pynvml.nvmlDeviceGetCount()):
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
            if process.pid == pid:
                used += process.usedGpuMemory or 0
    return used


def device_name() -> str:
    import pynvml

    pynvml.nvmlInit()
    name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    name = name.decode() if isinstance(name, bytes) else name
    count = pynvml.nvmlDeviceGetCount()
    slug = re.sub(r"[^a-z0-9]+", "", name.lower().replace("nvidia", ""))
    return f"{slug}x{count}" if count > 1 else slug


def server_round(server: BenchServer, kernel_id: str) -> dict:
    server.wait_parkable(kernel_id)
    began = time.perf_counter()
    answer = server.api(f"/api/gpu-quota/kernels/{kernel_id}/park", "POST", {})
    parked = server.wait(kernel_id, ("parked",))
    park_seen = time.perf_counter() - began
    began = time.perf_counter()
    server.api(f"/api/gpu-quota/kernels/{kernel_id}/resume", "POST", {})
    server.wait(kernel_id, ("idle", "busy"))
    resume_seen = time.perf_counter() - began
    figures = {"park_s": park_seen, "resume_s": resume_seen, "host_bytes": parked["host_bytes"]}
    if answer["park"]["state"] == "parking":  # the server's own clock: parking -> parked
        figures["park_server_clock_s"] = parked["since"] - answer["park"]["since"]
    return figures


def raw_round(driver: CudaCheckpointDriver, pid: int) -> dict:
    began = time.perf_counter()
    driver.lock(pid, 10_000)
    driver.checkpoint(pid)
    park = time.perf_counter() - began
    began = time.perf_counter()
    driver.restore(pid)
    driver.unlock(pid)
    return {"park_s": park, "resume_s": time.perf_counter() - began}


def first_cell(server: BenchServer, kernel_id: str, connection: Path, pid: int, checksum: str) -> dict:
    began = time.perf_counter()
    assert run_cell(connection, CHECK).strip() == checksum
    unparked = time.perf_counter() - began
    server.wait_parkable(kernel_id)
    before = nvml_used(pid)
    server.api(f"/api/gpu-quota/kernels/{kernel_id}/park", "POST", {})
    server.wait(kernel_id, ("parked",))
    during = nvml_used(pid)
    began = time.perf_counter()
    # Resumes it: the user's next cell. A resume over a second says so first ("gpu-quota: back on the GPU ...").
    out = run_cell(connection, CHECK).strip().splitlines()[-1]
    after_park = time.perf_counter() - began
    assert out == checksum, f"checksum changed: {out} != {checksum}"
    server.wait(kernel_id, ("idle", "busy"))
    return {
        "first_cell_unparked_s": unparked,
        "first_cell_after_park_s": after_park,
        "bytes_returned": before - during,
        "nvml_while_parked": during,
    }


def median(rows, key):
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,20", help="GiB held by the kernel, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    add_save_options(parser)
    options = parser.parse_args()
    driver = CudaCheckpointDriver()
    try:
        driver.open()
    except CheckpointUnavailable as error:
        raise SystemExit(f"park_bench needs the CUDA checkpoint driver: {error}") from None
    workdir = Path(tempfile.mkdtemp(prefix="park-bench-"))
    server = BenchServer(workdir)
    results = {}
    try:
        for gib in (float(s) for s in options.sizes.split(",")):
            nbytes = int(gib * GiB)
            kernel_id = server.api("/api/kernels", "POST", {"name": "python3"})["id"]
            connection = server.runtime / f"kernel-{kernel_id}.json"
            pid = int(run_cell(connection, "import os; print(os.getpid())").strip())
            checksum = run_cell(connection, HOLD.format(n=nbytes)).strip()
            rounds = []
            for index in range(options.rounds):
                order = ("server", "raw") if index % 2 == 0 else ("raw", "server")
                row = {}
                for which in order:
                    if which == "server":
                        row["server"] = server_round(server, kernel_id)
                    else:
                        row["raw"] = raw_round(driver, pid)
                row.update(first_cell(server, kernel_id, connection, pid, checksum))
                row["park_ratio"] = row["server"]["park_s"] / row["raw"]["park_s"]
                row["resume_ratio"] = row["server"]["resume_s"] / row["raw"]["resume_s"]
                rounds.append(row)
                print(f"{gib:g} GiB round {index + 1}: {json.dumps(row)}", flush=True)
            server.api(f"/api/kernels/{kernel_id}", "DELETE")
            results[f"{gib:g}GiB"] = {
                "bytes_held": nbytes,
                "server_park_s": median([r["server"] for r in rounds], "park_s"),
                "server_park_server_clock_s": median([r["server"] for r in rounds], "park_server_clock_s"),
                "raw_park_s": median([r["raw"] for r in rounds], "park_s"),
                "park_ratio_median": median(rounds, "park_ratio"),
                "server_resume_s": median([r["server"] for r in rounds], "resume_s"),
                "raw_resume_s": median([r["raw"] for r in rounds], "resume_s"),
                "resume_ratio_median": median(rounds, "resume_ratio"),
                "first_cell_unparked_s": median(rounds, "first_cell_unparked_s"),
                "first_cell_after_park_s": median(rounds, "first_cell_after_park_s"),
                "bytes_returned": median(rounds, "bytes_returned"),
                "nvml_while_parked": max(r["nvml_while_parked"] for r in rounds),
                "rounds": rounds,
            }
    finally:
        server.stop()
    device = device_name()
    figures = {"device": device, "rounds": options.rounds, "sizes": results}
    paths = [options.out] if options.out else []
    if options.save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        paths.append(str(RESULTS / f"park-{datetime.date.today().isoformat()}-{device}.json"))
    record = report("park", figures, out=paths[0] if paths else None)
    for path in paths[1:]:
        Path(path).write_text(json.dumps(record, indent=2) + "\n")
        print("saved " + path)


if __name__ == "__main__":
    main()
