"""Kernel start with the host quota service vs the local ledger, and the grant round trip to the service.

A real JupyterHub (with configurable-http-proxy) runs the host quota service (configure_host_service) and
two users' servers on one static 80 GiB device: "remote" asks the service for every grant (RemoteLedger),
"local" keeps its own ledger (a pre_spawn_hook takes the service's URL out of its environment). Each
round starts one kernel on each server through the hub's proxy, in alternating order, timing
POST /api/kernels (admission, the launch hook, the kernel process up), then shuts both down. The figure is
the ratio of the medians with a bootstrap 95% interval over the paired rounds.

The grant round trip: a RemoteLedger in this process, with the remote user's hub token, times grant,
change and release calls against the same service (HubAuth included: the service caches the hub's answer
about a token for a few seconds, as it does for a user server).

    python benchmarks/remote_ledger_bench.py                    # needs `bash tests/hub/setup.sh`
    python benchmarks/remote_ledger_bench.py --rounds 40 --save # also write benchmarks/results/
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_save_options, percentile, ratio_of_medians_ci, report  # noqa: E402

from gpu_quota_ext.devices import Device  # noqa: E402
from gpu_quota_ext.ledger.remote import RemoteLedger  # noqa: E402
from gpu_quota_ext.shared.sizes import GiB, parse_cap  # noqa: E402
from tests.hub.hubtools import Hub, missing_setup  # noqa: E402
from tests.hub.quota_service import quota_service_config  # noqa: E402

UUID = "GPU-bench-0"
SINGLE_USER_CONFIG = f"""
c.ServerApp.jpserver_extensions = {{"gpu_quota_ext": True}}
c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"
c.StaticInventory.devices = [{{"name": "Bench GPU", "total": "80GiB", "uuid": {UUID!r}}}]
c.GpuQuota.default_cap = "0.01"
"""
HUB_CONFIG = """
c.Spawner.args = ["--allow-root", "--config={single_user_config}"]
from gpu_quota_ext.hub.service.configure import configure_host_service
configure_host_service(c, default={{"default_cap": "0.01"}}, port={port}, args=["--config={service_config}"], admin_roles=["hub-test-admin"])

def _local_ledger_for_local(spawner):
    # The "local" user's server keeps its own ledger: the comparison's baseline.
    if spawner.user.name == "local":
        spawner.environment = {{k: v for k, v in spawner.environment.items() if k != "GPU_QUOTA_SERVICE_URL"}}

c.Spawner.pre_spawn_hook = _local_ledger_for_local
"""


async def kernel_starts(hub: Hub, tokens, rounds: int):
    times = {"remote": [], "local": []}
    for n in range(rounds):
        order = ("remote", "local") if n % 2 == 0 else ("local", "remote")
        started = []
        for user in order:
            t0 = time.perf_counter()
            _, kernel = await hub.api("POST", f"/user/{user}/api/kernels", {"name": "python3"}, token=tokens[user])
            times[user].append(time.perf_counter() - t0)
            started.append((user, kernel["id"]))
        for user, kernel_id in started:
            await hub.api("DELETE", f"/user/{user}/api/kernels/{kernel_id}", token=tokens[user])
    return times


def round_trips(url: str, token: str, calls: int):
    ledger = RemoteLedger([Device(0, "Bench GPU", UUID, 80 * GiB)], url, token, server="bench")
    times = {"grant": [], "change": [], "release": []}
    try:
        for n in range(calls):
            kernel_id = f"bench-{n}"
            t0 = time.perf_counter()
            ledger.grant(kernel_id, "ignored", "python3", None)
            t1 = time.perf_counter()
            ledger.change(kernel_id, parse_cap("0.02"))
            t2 = time.perf_counter()
            ledger.release(kernel_id)
            t3 = time.perf_counter()
            times["grant"].append(t1 - t0)
            times["change"].append(t2 - t1)
            times["release"].append(t3 - t2)
    finally:
        ledger.close()
    return times


def ms(value: float) -> float:
    return round(value * 1000, 2)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="paired kernel starts (default 20)")
    parser.add_argument("--calls", type=int, default=200, help="grant/change/release round trips (default 200)")
    add_save_options(parser)
    args = parser.parse_args()
    problem = missing_setup()
    if problem:
        raise SystemExit(f"remote_ledger_bench: {problem}; run `bash tests/hub/setup.sh` first")

    with tempfile.TemporaryDirectory(prefix="remote-ledger-bench-") as folder:
        folder = Path(folder)
        single_user_config = folder / "single_user_config.py"
        single_user_config.write_text(SINGLE_USER_CONFIG)
        # Both servers run as this OS user: the service checks their kernels' PIDs against that Unix user.
        _, service = quota_service_config(
            folder,
            devices=({"name": "Bench GPU", "total": "80GiB", "uuid": UUID},),
            settings={"unix_user_template": getpass.getuser()},
        )
        hub = Hub(
            folder,
            textwrap.dedent(
                HUB_CONFIG.format(
                    single_user_config=single_user_config, port=service.port, service_config=service.config_path
                )
            ),
        )
        hub.start()
        try:
            await hub.wait_until_up()
            await hub.api("POST", "/hub/api/users", {"usernames": ["remote", "local"]})
            for user in ("remote", "local"):
                await hub.start_server(user)
            for user in ("remote", "local"):
                await hub.wait_for_server(user)
            tokens = {user: await hub.user_token(user) for user in ("remote", "local")}
            await kernel_starts(hub, tokens, 2)  # warm-up: imports, the first kernel of each server
            starts = await kernel_starts(hub, tokens, args.rounds)
            url = f"http://127.0.0.1:{service.port}{service.prefix}"
            trips = await asyncio.to_thread(round_trips, url, tokens["remote"], args.calls)
        finally:
            hub.stop()

    low, high = ratio_of_medians_ci(starts["remote"], starts["local"])
    ratio = statistics.median(starts["remote"]) / statistics.median(starts["local"])
    figures = {
        "rounds": args.rounds,
        "kernel_start_median_ms": {k: ms(statistics.median(v)) for k, v in starts.items()},
        "kernel_start_ratio_of_medians": round(ratio, 3),
        "kernel_start_ratio_95ci": [round(low, 3), round(high, 3)],
        "round_trip_calls": args.calls,
        "round_trip_ms": {
            k: {"p50": ms(percentile(v, 0.5)), "p95": ms(percentile(v, 0.95)), "max": ms(max(v))}
            for k, v in trips.items()
        },
    }
    report("remote_ledger", figures, save=args.save, out=args.out)
    print(
        f"  kernel start, service vs local ledger: ratio of medians {ratio:.3f} (95% interval {low:.3f} to {high:.3f})"
    )
    for key, row in figures["round_trip_ms"].items():
        print(f"  {key:>7} round trip: p50 {row['p50']} ms, p95 {row['p95']} ms")


if __name__ == "__main__":
    asyncio.run(main())
