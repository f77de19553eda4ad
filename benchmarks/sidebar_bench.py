"""The GPU quota sidebar with 200 kernels: render and update time per poll in a real Chromium (median),
and the server's CPU while ten browser tabs poll. Goals: an update under 16 ms; ten tabs under 2% of one
core. Prints the figures as JSON; --save also writes them under benchmarks/results/.

    python benchmarks/sidebar_bench.py [--kernels 200] [--polls 50] [--tabs 10] [--seconds 30] [--save]

Needs what tests/ui/run.sh installs (Chromium, tests/ui/node_modules, the built extension). It starts
`jupyter lab` on a free loopback port with the extension, a static two-GPU inventory and the ledger filled
with --kernels grants (benchmarks/sidebar_bench_server.py), then:
- render: one tab whose status answers are replaced by --kernels synthetic kernels with usage that moves
  on every poll (every bar changes), --polls updates timed (script, and script + style + layout);
- tabs: --tabs tabs of the real server; the server process's CPU time over --seconds, first with the
  panel closed (JupyterLab's own polling), then with the panel open in every tab (2 s polls of the real
  status route with --kernels grants). The panel's cost is the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import add_save_options, free_port, report  # noqa: E402

from gpu_quota_ext.shared.contract import STATUS_PATH  # noqa: E402

CONFIG = """
c.ServerApp.ip = "127.0.0.1"
c.ServerApp.port = {port}
c.ServerApp.open_browser = False
c.ServerApp.root_dir = {root!r}
c.IdentityProvider.token = ""
c.ServerApp.password = ""
c.ServerApp.disable_check_xsrf = True
c.LabApp.expose_app_in_browser = True
c.LabApp.workspaces_dir = {workspaces!r}
c.ServerApp.jpserver_extensions.update({{"gpu_quota_ext": True, "sidebar_bench_server": True}})
c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"
c.StaticInventory.devices = [{{"name": "Test GPU 0", "total": "80GiB"}}, {{"name": "Test GPU 1", "total": "80GiB"}}]
"""


def start_server(work: Path, kernels: int):
    port = free_port()
    (work / "root").mkdir()
    (work / "workspaces").mkdir()
    config = work / "config.py"
    config.write_text(CONFIG.format(port=port, root=str(work / "root"), workspaces=str(work / "workspaces")))
    env = dict(
        os.environ,
        GQ_BENCH_KERNELS=str(kernels),
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    )
    log = open(work / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--config", str(config), "--allow-root", "--no-browser"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + STATUS_PATH, timeout=2) as response:
                status = json.loads(response.read())
            if len(status["kernels"]) >= kernels:
                return proc, url
        except Exception:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"jupyter lab exited; see {work / 'server.log'}")
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"the server did not come up with {kernels} grants; see {work / 'server.log'}")


def status_request_cost(url: str, n: int = 200) -> dict:
    """Server CPU per status request with the filled ledger (sequential GETs, keep-alive off)."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        with urllib.request.urlopen(url + STATUS_PATH, timeout=5) as response:
            body = response.read()
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return {"requests": n, "latency_ms_median": round(times[len(times) // 2], 2), "bytes": len(body)}


def run_render(url: str, kernels: int, polls: int) -> dict:
    out = subprocess.run(
        ["node", str(HERE / "sidebar_bench_browser.js"), "render", url, str(kernels), str(polls)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise SystemExit(f"the render run failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def run_tabs(url: str, server: psutil.Process, tabs: int, seconds: int) -> dict:
    node = subprocess.Popen(
        ["node", str(HERE / "sidebar_bench_browser.js"), "tabs", url, str(tabs), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    marks = {}
    for line in node.stdout:
        word, _, rest = line.strip().partition(" ")
        if word in ("BASELINE_START", "BASELINE_END", "PANEL_START", "PANEL_END"):
            marks[word] = (time.perf_counter(), cpu_seconds(server), int(rest))
        elif word == "ROWS":
            marks["rows"] = int(rest)
    if node.wait() != 0:
        raise SystemExit("the tabs run failed")

    def phase(start: str, end: str) -> dict:
        (w0, c0, r0), (w1, c1, r1) = marks[start], marks[end]
        return {
            "seconds": round(w1 - w0, 1),
            "server_cpu_percent_of_one_core": round(100 * (c1 - c0) / (w1 - w0), 2),
            "status_requests_per_s": round((r1 - r0) / (w1 - w0), 2),
        }

    closed = phase("BASELINE_START", "BASELINE_END")
    opened = phase("PANEL_START", "PANEL_END")
    return {
        "tabs": tabs,
        "rows_in_panel": marks.get("rows"),
        "panel_closed": closed,
        "panel_open": opened,
        "panel_cost_cpu_percent_of_one_core": round(
            opened["server_cpu_percent_of_one_core"] - closed["server_cpu_percent_of_one_core"], 2
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=200)
    parser.add_argument("--polls", type=int, default=50)
    parser.add_argument("--tabs", type=int, default=10)
    parser.add_argument("--seconds", type=int, default=30)
    add_save_options(parser)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="gq-sidebar-bench-") as tmp:
        proc, url = start_server(Path(tmp), args.kernels)
        try:
            server = psutil.Process(proc.pid)
            render = run_render(url, args.kernels, args.polls)
            print("render:", json.dumps(render), flush=True)
            cost = status_request_cost(url)
            print("status route:", json.dumps(cost), flush=True)
            tabs = run_tabs(url, server, args.tabs, args.seconds)
            print("tabs:", json.dumps(tabs), flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    report(
        "sidebar_bench",
        {
            "command": "python benchmarks/sidebar_bench.py " + " ".join(sys.argv[1:]),
            "browser": subprocess.run(
                [os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium"), "--version"], capture_output=True, text=True
            ).stdout.strip(),
            "render": render,
            "status_route_with_grants": cost,
            "ten_tabs": tabs,
            "goals": {
                "update_under_16_ms": render["update_with_layout_ms_median"] < 16,
                "tabs_under_2_percent_of_one_core": tabs["panel_cost_cpu_percent_of_one_core"] < 2,
            },
        },
        save=args.save,
        out=args.out,
    )


if __name__ == "__main__":
    main()
