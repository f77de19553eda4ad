"""One user cannot slow the others (issue 30, items 6 and 7): carol's grant round trip while bob floods the host
service, and while four admins reload its page, each paired with a baseline in the same run.

A real JupyterHub (with configurable-http-proxy, from tests/hub/setup.sh) starts the service as a hub-managed
service (static 2 x 80 GiB, fake NVML at 1 Hz) with its default per-user limits. 200 users hold a kernel each
(the admin page's 200 users and 200 kernels). carol starts and shuts down a kernel (POST a grant, DELETE it) at
an honest pace (`--pace` round trips a second, within her own limit) over one keep-alive connection to the
service's own URL; her POST's latency is the figure.

Each round runs, for `--phase` seconds each, a baseline (nobody else calls) and then one load:
- room flood: bob's server calls api/room as fast as `--flooders` processes can (keep-alive connections);
- made-up tokens: `--flooders` processes call api/status with a new random token each time;
- long polls: bob keeps `--polls` connections each sending a lease renewal that asks to wait (a long poll), and
  sends the next one on each as soon as it is answered;
- admin page: four admins reload the page (GET the service's root with their tokens), back to back, each waiting
  as a 429's Retry-After says (the page's own limit; a flood of the page is a flood like the others).
Per load: the p95 of carol's grant in each baseline and each loaded phase, their ratio per round, the median of
the ratios, the pooled p50/p95, how many of the load's calls were answered a second and what share of them 429
(a held refusal is answered late: a flood on 500 connections gets few answers a second).

    python benchmarks/service_flood_bench.py [--rounds 3] [--phase 6] [--save]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import secrets
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_save_options, percentile, report  # noqa: E402

from gpu_quota_ext.shared.service_contract import GRANTS_PATH, LEASE_PATH, ROOM_PATH, STATUS_PATH  # noqa: E402
from tests.hub.hubtools import Hub, missing_setup  # noqa: E402
from tests.hub.quota_service import quota_service_config  # noqa: E402

USERS = 200
ADMINS = 4
DEVICES = [{"name": "Bench GPU", "total": "80GiB", "uuid": f"GPU-bench-{i}"} for i in range(2)]
LOADS = ("room flood", "made-up tokens", "long polls", "admin page")


def connect(port: int) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=30)


def call(connection, method, path, token, body=None):
    data = None if body is None else json.dumps(body)
    connection.request(method, path, body=data, headers={"Authorization": f"token {token}"})
    response = connection.getresponse()
    response.read()
    return response.status


def long_polls(port: int, prefix: str, token: str, polls: int, stop, counts, index: int) -> None:
    """`polls` connections, each with a long poll in flight, re-sent as soon as it is answered (raw sockets: a
    few hundred http.client connections would need as many threads)."""
    import selectors
    import socket

    selector = selectors.DefaultSelector()
    done = refused = 0

    def send(sock, n):
        body = json.dumps({"server": f"s{n}", "kernels": [], "park": [], "wait": 15}).encode()
        head = (
            f"POST {prefix}{LEASE_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: token {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body)

    for n in range(polls):
        try:
            sock = socket.create_connection(("127.0.0.1", port))
        except OSError:
            break
        send(sock, n)
        selector.register(sock, selectors.EVENT_READ, [n, b""])
    while not stop.is_set():
        for key, _ in selector.select(0.2):
            sock, state = key.fileobj, key.data
            chunk = sock.recv(65536)
            if not chunk:
                selector.unregister(sock)
                sock.close()
                continue
            state[1] += chunk
            head, _, rest = state[1].partition(b"\r\n\r\n")
            if not _:
                continue
            lines = head.split(b"\r\n")
            length = next((int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length")), 0)
            if len(rest) < length:
                continue
            done += 1
            refused += head.split(b" ")[1] == b"429"
            state[1] = rest[length:]
            send(sock, state[0])
        counts[2 * index], counts[2 * index + 1] = done, refused
    for key in list(selector.get_map().values()):
        key.fileobj.close()


def load_process(kind: str, port: int, prefix: str, tokens, stop, counts, index: int, polls: int = 0) -> None:
    """One process of a load, until `stop` is set: counts[2*index] calls, counts[2*index+1] of them 429."""
    if kind == "long polls":
        return long_polls(port, prefix, tokens[0], polls, stop, counts, index)
    connection = connect(port)
    done = refused = 0
    room = {"server": "", "park": [], "demands": []}
    while not stop.is_set():
        try:
            if kind == "room flood":
                status = call(connection, "POST", prefix + ROOM_PATH, tokens[0], room)
            elif kind == "made-up tokens":
                status = call(connection, "GET", prefix + STATUS_PATH, secrets.token_hex(16))
            else:
                connection.request("GET", prefix, headers={"Authorization": f"token {tokens[index % len(tokens)]}"})
                response = connection.getresponse()
                response.read()
                status = response.status
                if status == 429:
                    stop.wait(float(response.getheader("Retry-After", "1")))
        except (OSError, http.client.HTTPException):
            connection.close()
            connection = connect(port)
            continue
        done += 1
        refused += status == 429
        if done % 50 == 0:
            counts[2 * index], counts[2 * index + 1] = done, refused
    counts[2 * index], counts[2 * index + 1] = done, refused


def carol_phase(connection, prefix: str, token: str, seconds: float, pace: float, serial: list) -> list:
    """carol's grant round trips for `seconds`, `pace` a second: her POSTs' latencies (s)."""
    times = []
    end = time.monotonic() + seconds
    next_at = time.monotonic()
    while time.monotonic() < end:
        kernel = f"carol-{serial[0]}"
        serial[0] += 1
        body = {"server": "", "kernel_id": kernel, "kernelspec": "python3", "allowed": None}
        start = time.perf_counter()
        status = call(connection, "POST", prefix + GRANTS_PATH, token, body)
        times.append(time.perf_counter() - start)
        assert status == 201, f"carol's grant: {status}"
        assert call(connection, "DELETE", f"{prefix}{GRANTS_PATH}/{kernel}", token) == 204
        next_at += 1.0 / pace
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing an honest caller, not synchronization
    return times


def ms(seconds) -> dict:
    values = [s * 1000 for s in seconds]
    return {"n": len(values), "p50_ms": round(percentile(values, 0.5), 2), "p95_ms": round(percentile(values, 0.95), 2)}


def run(rounds: int, phase: float, pace: float, flooders: int, polls: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="gq-flood-bench-") as folder:
        folder = Path(folder)
        lines, service = quota_service_config(
            folder, default={"default_cap": "256MiB", "max_cap": "0.5"}, devices=DEVICES,
            settings={"poll_interval": 1.0},
        )
        admins = [f"admin{i}" for i in range(ADMINS)]
        hub = Hub(folder, textwrap.dedent(lines) + f"\nc.Authenticator.admin_users = {set(admins)!r}\n")
        hub.start()
        try:
            users = [f"user{i:03d}" for i in range(USERS)]

            async def prepare():
                await hub.wait_until_up()
                await hub.api("POST", "/hub/api/users", {"usernames": users + admins + ["carol", "bob"]}, ok=(201, 409))
                names = users + admins + ["carol", "bob"]
                return {name: await hub.user_token(name) for name in names}

            tokens = asyncio.run(prepare())
            prefix = service.prefix
            connection = connect(service.port)
            deadline = time.monotonic() + 60
            while True:  # the service may still be starting
                try:
                    call(connection, "GET", prefix + STATUS_PATH, tokens["carol"])
                    break
                except (OSError, http.client.HTTPException):
                    assert time.monotonic() < deadline, "the service did not start"
                    connection = connect(service.port)
                    time.sleep(0.2)
            for user in users:
                body = {"server": "", "kernel_id": f"{user}-k", "kernelspec": "python3", "allowed": None}
                assert call(connection, "POST", prefix + GRANTS_PATH, tokens[user], body) == 201
            page = connect(service.port)
            page.request("GET", prefix, headers={"Authorization": f"token {tokens['admin0']}"})
            answer = page.getresponse()
            page_bytes = len(answer.read())
            assert answer.status == 200, f"the admin page: {answer.status}"

            context = multiprocessing.get_context("fork")
            serial = [0]
            figures = {}
            for kind in LOADS:
                base_all, load_all, ratios, rates, refused_share = [], [], [], [], []
                load_tokens = [tokens["bob"]] if kind != "admin page" else [tokens[a] for a in admins]
                processes_n = {"admin page": ADMINS, "long polls": 1}.get(kind, flooders)
                for _ in range(rounds):
                    base = carol_phase(connection, prefix, tokens["carol"], phase, pace, serial)
                    stop = context.Event()
                    counts = context.Array("l", 2 * processes_n)
                    processes = [
                        context.Process(
                            target=load_process,
                            args=(kind, service.port, prefix, load_tokens, stop, counts, i, polls),
                        )
                        for i in range(processes_n)
                    ]
                    for process in processes:
                        process.start()
                    time.sleep(0.5)  # the load under way before carol's phase begins (pacing, not a check)
                    started = time.monotonic()
                    loaded = carol_phase(connection, prefix, tokens["carol"], phase, pace, serial)
                    stop.set()
                    for process in processes:
                        process.join(30)
                    elapsed = time.monotonic() - started + 0.5
                    calls, refused = sum(counts[0::2]), sum(counts[1::2])
                    rates.append(calls / elapsed)
                    refused_share.append(refused / calls if calls else 0.0)
                    base_all += base
                    load_all += loaded
                    ratios.append(percentile(loaded, 0.95) / percentile(base, 0.95))
                figures[kind] = {
                    "baseline": ms(base_all),
                    "loaded": ms(load_all),
                    "p95_ratio_per_round": [round(r, 2) for r in ratios],
                    "p95_ratio_median": round(statistics.median(ratios), 2),
                    "load_answers_per_second": round(statistics.median(rates), 1),
                    "load_answered_429_share": round(statistics.median(refused_share), 3),
                }
        finally:
            hub.stop()
    return {
        "device": "vm",
        "loads": figures,
        "admin_page_bytes": page_bytes,
        "setup": (
            f"real JupyterHub + configurable-http-proxy; service called directly at its URL with its default per-user "
            f"limits; {USERS} users with a kernel each; carol paced at {pace:g} grant round trips/s; {rounds} rounds "
            f"of {phase:g} s baseline + {phase:g} s loaded per load; {flooders} flood processes, {ADMINS} admins, "
            f"{polls} long-poll connections; "
            f"static 2 x 80 GiB, fake NVML at 1 Hz; {os.cpu_count()} CPUs"
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phase", type=float, default=6.0)
    parser.add_argument("--pace", type=float, default=8.0)
    parser.add_argument("--flooders", type=int, default=1)
    parser.add_argument("--polls", type=int, default=500)
    add_save_options(parser)
    args = parser.parse_args()
    problem = missing_setup()
    if problem:
        raise SystemExit(f"service_flood_bench: {problem} (bash tests/hub/setup.sh)")
    figures = run(args.rounds, args.phase, args.pace, args.flooders, args.polls)
    report("service_flood_bench", figures, save=args.save, out=args.out)


if __name__ == "__main__":
    main()
