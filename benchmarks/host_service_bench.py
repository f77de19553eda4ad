"""The host quota service: grant round trip (p50/p95) and the admin's status of 20 users × 10 kernels.

A real JupyterHub (with configurable-http-proxy, from tests/hub/setup.sh) starts the service as a
hub-managed service, with a static inventory of 2 × 80 GiB and the fake NVML; this process calls the
service directly at its own URL (not through the proxy), with users' hub tokens, over one keep-alive
connection, sequentially. The service asks the hub who owns a token once per `hub_cache_seconds` (10 s,
the default): the figures include those refreshes, as a real host's would.

- grant round trip: POST a grant, then DELETE it (a kernel start and a shutdown), `--grants` times;
- status: 20 users hold 10 kernels each; GET status as the hub admin, `--status` times.

    python benchmarks/host_service_bench.py [--grants 300] [--status 200] [--save]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_save_options, percentile, report  # noqa: E402

from gpu_quota_ext.shared.service_contract import GRANTS_PATH, STATUS_PATH  # noqa: E402
from tests.hub.hubtools import Hub, missing_setup  # noqa: E402
from tests.hub.quota_service import quota_service_config  # noqa: E402

USERS = 20
KERNELS = 10
DEVICES = [{"name": "Bench GPU", "total": "80GiB", "uuid": f"GPU-bench-{i}"} for i in range(2)]


class Client:
    def __init__(self, port: int, prefix: str):
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.prefix = prefix

    def call(self, method: str, path: str, token: str, body=None, ok=(200, 201, 204)):
        data = None if body is None else json.dumps(body)
        start = time.perf_counter()
        self.connection.request(method, self.prefix + path, body=data, headers={"Authorization": f"token {token}"})
        response = self.connection.getresponse()
        payload = response.read()
        elapsed = time.perf_counter() - start
        if response.status not in ok:
            raise AssertionError(f"{method} {path}: {response.status} {payload[:300]!r}")
        return elapsed, json.loads(payload) if payload else None


def summary(seconds) -> dict:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 0.5), 2),
        "p95_ms": round(percentile(ms, 0.95), 2),
        "max_ms": round(max(ms), 2),
    }


def run(grants: int, statuses: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="gq-host-bench-") as folder:
        folder = Path(folder)
        lines, service = quota_service_config(
            folder, default={"default_cap": "1GiB", "max_cap": "0.5"}, devices=DEVICES, settings={"poll_interval": 1.0}
        )
        hub = Hub(folder, textwrap.dedent(lines) + '\nc.Authenticator.admin_users = {"admin"}\n')
        hub.start()
        try:
            users = [f"user{i:02d}" for i in range(USERS)]

            async def prepare():
                await hub.wait_until_up()
                for user in users + ["admin"]:
                    await hub.api("POST", f"/hub/api/users/{user}", ok=(201, 409))
                return {user: await hub.user_token(user) for user in users + ["admin"]}

            tokens = asyncio.run(prepare())
            client = Client(service.port, service.prefix)
            deadline = time.monotonic() + 60
            while True:  # the service may still be starting
                try:
                    client.call("GET", STATUS_PATH, tokens["admin"])
                    break
                except (OSError, http.client.HTTPException):
                    if time.monotonic() > deadline:
                        raise
                    client = Client(service.port, service.prefix)
                    time.sleep(0.2)

            post, delete = [], []
            for i in range(grants):
                body = {"server": "", "kernel_id": f"bench-{i}", "kernelspec": "python3", "allowed": None}
                post.append(client.call("POST", GRANTS_PATH, tokens["user00"], body, ok=(201,))[0])
                delete.append(client.call("DELETE", f"{GRANTS_PATH}/bench-{i}", tokens["user00"], ok=(204,))[0])

            for user in users:
                for k in range(KERNELS):
                    body = {"server": "", "kernel_id": f"{user}-k{k}", "kernelspec": "python3", "allowed": None}
                    client.call("POST", GRANTS_PATH, tokens[user], body, ok=(201,))
            times = []
            for _ in range(statuses):
                elapsed, status = client.call("GET", STATUS_PATH, tokens["admin"])
                times.append(elapsed)
            assert len(status["kernels"]) == USERS * KERNELS and len(status["users"]) == USERS, status["users"]
            size = len(json.dumps(status))
        finally:
            hub.stop()
    return {
        "grant_post": summary(post),
        "grant_delete": summary(delete),
        "status_20_users_x_10_kernels": {**summary(times), "bytes": size},
        "setup": "real JupyterHub + configurable-http-proxy; service called directly at its URL; static 2 x 80 GiB, "
            "fake NVML at 1 Hz",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grants", type=int, default=300)
    parser.add_argument("--status", type=int, default=200)
    add_save_options(parser)
    args = parser.parse_args()
    problem = missing_setup()
    if problem:
        raise SystemExit(f"host_service_bench: {problem} (bash tests/hub/setup.sh)")
    report("host_service_bench", run(args.grants, args.status), save=args.save, out=args.out)


if __name__ == "__main__":
    main()
