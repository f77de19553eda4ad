"""Issue 19, items 1-3: the host quota service believes nothing a user's server says that the system can check.

A real JupyterHub with configurable-http-proxy and the service (configure_host_service); NVML is the
file-driven fake (devices.fake_nvml.FileFakeNvml: the test writes which PID uses how much of which GPU), every
process and uid is real.

1. Real Unix users alice and bob, each server spawned as its own user (LocalProcessSpawner) from a Python
   they can run (tests/hub/unix_users.py). From a cell in bob's kernel, the attack of the issue: his server's
   token and the service's URL from the environment, alice's ipykernel PID from /proc, a grant for a made-up
   kernel on the GPU alice's kernel is not on, and a lease naming alice's PID for it; `unmanaged_action =
   "kill"`. Alice's kernel stays alive, her usage stays hers, the attempt is logged once and shown on the
   admin's page; the watchdog still kills bob's own process on a GPU his grant does not hold.
2. Real Unix users alice, bob and carol: carol's burst of 1,000 concurrent grants under a made-up server
   (past her rate answered 429 with Retry-After, issue 30 item 6, and said once in the log) leaves the others'
   next starts admitted (alice's a kernel started through her own server, spawned as her
   Unix user); grants, rows in the store, the service's fds and threads and the log are counted before and
   after; carol renewing her lease with empty PID lists, or naming alice's kernel's PID, keeps nothing past a
   lease period, and neither does bob's grant that no process holds, while alice's kernel keeps hers.
3. A token without access to the service is refused (403), whoever owns it; the admin routes still need
   the admin scope.

Install what it needs with `bash tests/hub/setup.sh`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import sqlite3
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from gpu_quota_ext.shared.env_vars import KERNEL_ID
from gpu_quota_ext.shared.service_contract import GRANTS_PATH, LEASE_PATH, METRICS_PATH, STATUS_PATH
from gpu_quota_ext.shared.sizes import GiB

from .. import waiting
from . import unix_users
from .hubtools import Hub
from .quota_service import quota_service_config

GPUS = (
    {"name": "Test GPU", "total": "80GiB", "uuid": "GPU-trust-0"},
    {"name": "Test GPU", "total": "80GiB", "uuid": "GPU-trust-1"},
)
LEASE = 12.0  # seconds: short, so that an idle grant goes within the test
POLL = 0.5
GRACE = 1.0  # unmanaged_grace: the kill came 1.4 s after the lease
BURST_LEASE = 25.0

SINGLE_USER_CONFIG = """
c.ServerApp.jpserver_extensions = {{"gpu_quota_ext": True}}
c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"
c.StaticInventory.devices = {devices!r}
"""

HUB_CONFIG = """
{spawner_lines}
c.Spawner.args = ["--config={single_user_config}"]
from gpu_quota_ext.hub.service.configure import configure_host_service

entry = configure_host_service(
    c,
    default={default!r},
    port={port},
    args=["--config={service_config}"],
    admin_roles=["hub-test-admin"],
)
entry["environment"]["GPU_QUOTA_FAKE_NVML_FILE"] = {nvml_file!r}
{after}
"""

# From a cell of bob's kernel, as the issue found it: everything it needs is readable by bob.
ATTACK = r"""
import json, os, threading, urllib.error, urllib.request
def environ_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as handle:
        return dict(e.split(b"=", 1) for e in handle.read().split(b"\0") if b"=" in e)
server_env = environ_of(os.getppid())  # the kernel's own environment may have dropped it: its server has it
token = os.environ.get("JUPYTERHUB_API_TOKEN") or server_env[b"JUPYTERHUB_API_TOKEN"].decode()
url = os.environ.get("GPU_QUOTA_SERVICE_URL") or server_env[b"GPU_QUOTA_SERVICE_URL"].decode()
victim = None
for entry in os.listdir("/proc"):
    if not entry.isdigit():
        continue
    try:
        cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        uid = int(next(l for l in open(f"/proc/{entry}/status") if l.startswith("Uid:")).split()[1])
    except (OSError, StopIteration):
        continue
    if b"ipykernel" in cmdline and uid not in (0, os.getuid()):
        victim = int(entry)
def post(path, body):
    request = urllib.request.Request(url + path, json.dumps(body).encode(), method="POST",
        headers={"Authorization": "token " + token, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
lease = {"server": "nb", "kernels": [{"kernel_id": "x", "pids": [victim]}]}
codes = [post("api/grants", {"server": "nb", "kernel_id": "x", "kernelspec": "x", "allowed": [%(other)r]}),
         post("api/lease", lease)]
stop = threading.Event()
def renew():  # the attacker keeps the lease alive, as the issue's did
    while not stop.wait(2):
        post("api/lease", lease)
threading.Thread(target=renew, daemon=True).start()
print(json.dumps({"victim": victim, "codes": codes}))
"""


def _hub(tmp_path: Path, settings: dict, spawner_lines: str, after: str = "", on_full: str = "refuse", devices=GPUS):
    shared = Path(tempfile.mkdtemp(prefix="gq-trust-"))  # readable by the servers' users
    shared.chmod(0o755)
    config = shared / "single_user_config.py"
    config.write_text(SINGLE_USER_CONFIG.format(devices=list(devices)))
    config.chmod(0o644)
    nvml_file = shared / "nvml.json"
    _, service = quota_service_config(
        tmp_path,
        devices=devices,
        settings={"nvml_class": "gpu_quota_ext.devices.fake_nvml.FileFakeNvml", **settings},
    )
    text = HUB_CONFIG.format(
        spawner_lines=spawner_lines,
        single_user_config=config,
        port=service.port,
        service_config=service.config_path,
        nvml_file=str(nvml_file),
        after=after,
        default={"default_cap": "0.25", "max_cap": "0.5", "on_full": on_full},
    )
    return Hub(tmp_path, textwrap.dedent(text)), service, shared, nvml_file


def _clean(shared: Path) -> None:
    for path in sorted(shared.glob("*"), reverse=True):
        path.unlink()
    shared.rmdir()


# This file's events: a deadline for a busy 2-core machine, checks that ask a server no faster than this.
wait_for = functools.partial(waiting.wait_for, timeout=60.0, step=0.2)


def write_usage(path: Path, usage: dict) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({str(pid): per for pid, per in usage.items()}))
    temporary.chmod(0o644)
    temporary.replace(path)  # the service never reads half a file


def kernel_process(kernel_id: str) -> psutil.Process:
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "ipykernel" in " ".join(process.info["cmdline"] or ()) and process.environ().get(KERNEL_ID) == kernel_id:
                return process
        except psutil.Error:
            continue
    raise AssertionError(f"no process of kernel {kernel_id}")


def service_process(service) -> psutil.Process:
    pid = service.pid()
    assert pid, "the quota service is not running"
    return psutil.Process(pid)


# --- 1. another user's PID ---------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_another_users_pid_in_a_lease_is_never_counted_nor_killed(setup_ok, tmp_path):
    python = unix_users.users_python_or_end_the_test()
    suffix = secrets.token_hex(3)
    alice, bob = f"gqta{suffix}", f"gqtb{suffix}"
    spawner = f"""
c.JupyterHub.spawner_class = "jupyterhub.spawner.LocalProcessSpawner"
c.LocalProcessSpawner.env_keep = ["LANG", "LC_ALL"]  # no PYTHONPATH: the users' servers run their own install
c.Spawner.cmd = [{python!r}, "-m", "jupyterhub.singleuser"]
"""
    after = f'c.Spawner.environment["PATH"] = {os.path.dirname(python) + ":/usr/local/bin:/usr/bin:/bin"!r}'
    settings = {
        "unmanaged_action": "kill",
        "unmanaged_grace": GRACE,
        "poll_interval": POLL,
        "lease_seconds": LEASE,
        "start_grace": 2.0,
    }
    with unix_users.UnixUsers([alice, bob]) as accounts:
        hub, service, shared, nvml_file = _hub(tmp_path, settings, spawner, after)
        hub.start()
        try:
            asyncio.run(Attack(hub, service, nvml_file, accounts, alice, bob).run())
        except BaseException:
            print("---- jupyterhub log (tail) ----\n" + hub.log_tail(20000))
            raise
        finally:
            hub.stop()
            _clean(shared)


class Attack:
    def __init__(self, hub, service, nvml_file, accounts, alice, bob):
        self.hub, self.service, self.nvml_file, self.accounts = hub, service, nvml_file, accounts
        self.alice, self.bob = alice, bob
        self.tokens = {}

    async def status(self):
        return (await self.hub.api("GET", self.service.path(STATUS_PATH)))[1]  # the admin's view

    async def start_kernel(self, user):
        path = f"/user/{user}/api/kernels"
        _, kernel = await self.hub.api("POST", path, {"name": "python3"}, token=self.tokens[user])
        return kernel["id"]

    async def run(self):
        hub, alice, bob = self.hub, self.alice, self.bob
        await hub.wait_until_up()
        await wait_for(self.answers, "the quota service answering through the hub's proxy")
        await hub.api("POST", "/hub/api/users", {"usernames": [alice, bob]})
        await asyncio.gather(*(hub.start_server(u) for u in (alice, bob)))
        await asyncio.gather(*(hub.wait_for_server(u) for u in (alice, bob)))
        self.tokens = {u: await hub.user_token(u) for u in (alice, bob)}

        # Alice's kernel holds GPU-trust-0 (spread: the first of two empty GPUs) and uses 10 GiB of it.
        ka = await self.start_kernel(alice)
        victim = kernel_process(ka)
        assert victim.uids().real == self.accounts.uid(alice)
        born = victim.create_time()
        seen = {}

        async def alices_row(used):
            status = await self.status()
            seen.update(status)
            row = {k["kernel_id"]: k for k in status["kernels"]}.get(ka)
            return row and row["pids"] == [victim.pid] and row["devices"][0]["used"] == used and row

        # Her server registers the kernel's PID at its next lease renewal; the memory comes once it is known
        # (a kernel using the GPU before its server's first renewal would be an unmanaged process that long).
        await wait_for(lambda: alices_row(None), "alice's server registering her kernel's PID, verified")
        write_usage(self.nvml_file, {victim.pid: {"GPU-trust-0": 10 * GiB}})

        async def alices_usage_is_hers():
            return await alices_row(10 * GiB)

        try:
            row = await wait_for(alices_usage_is_hers, "alice's kernel's PID verified and her usage counted")
        except AssertionError as error:
            raise AssertionError(f"{error}\nthe service's last status: {json.dumps(seen)[:4000]}") from None
        assert row["devices"][0]["uuid"] == "GPU-trust-0"
        alice_processes = len(self.accounts.processes(alice))
        service = service_process(self.service)
        fds, threads = service.num_fds(), service.num_threads()
        log_lines_before = hub.log_path.read_text(errors="replace").count(f"refused PID {victim.pid}")
        assert log_lines_before == 0

        # Bob's kernel (GPU-trust-1) runs the attack.
        kb = await self.start_kernel(bob)
        ran = await hub.execute(bob, self.tokens[bob], kb, ATTACK % {"other": "GPU-trust-1"})
        assert ran["status"] == "ok", ran
        told = json.loads(ran["stdout"].strip().splitlines()[-1])
        assert told["victim"] == victim.pid, told  # the attack found alice's kernel, as the did
        assert told["codes"] == [201, 200], told  # the service takes the grant and the lease: both are bob's own

        async def refused_and_past_the_grace():
            status = await self.status()
            refused = [r for r in status["refused_pids"] if r["pid"] == victim.pid and r["user"] == bob]
            if not refused:
                return None
            first = min(a["at"] for a in status["actions"] if a["action"] == "refuse" and a["pid"] == victim.pid)
            # Several samples after the kill would have come (the came 1.4 s after the lease).
            return status if status["sampled_at"] > first + GRACE + 6 * POLL else None

        status = await wait_for(refused_and_past_the_grace, "bob's registration of alice's PID refused, then samples")
        (refused,) = [r for r in status["refused_pids"] if r["pid"] == victim.pid]
        assert refused["kernel_id"] == "x" and refused["uid"] == self.accounts.uid(alice)
        assert victim.is_running() and victim.create_time() == born, "alice's kernel was killed"
        rows = {k["kernel_id"]: k for k in status["kernels"]}
        assert rows[ka]["pids"] == [victim.pid] and rows[ka]["devices"][0]["used"] == 10 * GiB
        assert rows["x"]["pids"] == [] and rows["x"]["registered_pids"] == [victim.pid]
        assert rows["x"]["devices"][0]["used"] is None
        assert not [a for a in status["actions"] if a["action"] == "kill"], status["actions"]
        assert not [u for u in status["unmanaged"] if u["pid"] == victim.pid], status["unmanaged"]
        again = await hub.execute(alice, self.tokens[alice], ka, "print(6 * 7)")
        assert again["stdout"].strip() == "42", again

        # Bob sees the refusal of his own lease, without whose the process is.
        _, bobs = await hub.api("GET", self.service.path(STATUS_PATH), token=self.tokens[bob])
        (seen,) = [r for r in bobs["refused_pids"] if r["pid"] == victim.pid]
        assert "uid" not in seen and alice not in json.dumps(bobs)
        # The admin's page shows it.
        _, page = await hub.api("GET", self.service.prefix)
        assert "Refused PID registrations" in page and f"<td>{victim.pid}</td>" in page

        # The watchdog still kills what it should: bob's own process on a GPU his grant does not hold.
        spawned = await hub.execute(
            bob, self.tokens[bob], kb, "import subprocess; stray = subprocess.Popen(['sleep', '600']); print(stray.pid)"
        )
        stray = psutil.Process(int(spawned["stdout"].strip().splitlines()[-1]))
        assert stray.uids().real == self.accounts.uid(bob)
        write_usage(self.nvml_file, {victim.pid: {"GPU-trust-0": 10 * GiB}, stray.pid: {"GPU-trust-0": GiB}})

        async def stray_killed():
            try:
                return stray.status() == psutil.STATUS_ZOMBIE or not stray.is_running()
            except psutil.NoSuchProcess:
                return True

        await wait_for(stray_killed, "bob's stray process on a GPU his grant does not hold killed", timeout=30)
        status = await self.status()
        kills = [a for a in status["actions"] if a["action"] == "kill"]
        assert [(a["user"], a["pid"]) for a in kills] == [(bob, stray.pid)], kills
        assert victim.is_running() and victim.create_time() == born

        # What could leak, counted: alice's processes, the service's fds and threads, the log lines.
        assert len(self.accounts.processes(alice)) == alice_processes
        service = service_process(self.service)
        assert service.num_threads() == threads, (threads, service.num_threads())
        assert service.num_fds() <= fds + 4, (fds, service.num_fds())  # the proxy's keep-alive connections
        log = hub.log_path.read_text(errors="replace")
        assert log.count(f"refused PID {victim.pid}") == 1, "one line per PID and lease, not one per renewal"
        print(
            f"trust attack: alice's kernel alive, 10 GiB hers; service fds {fds} -> {service.num_fds()}, "
            f"threads {threads} -> {service.num_threads()}; log lines of the refusal: 1"
        )

    async def answers(self):
        try:
            await self.hub.api("GET", self.service.path(STATUS_PATH))
            return True
        except AssertionError:
            return False


# --- 2 and 3. one user's burst, and tokens without access ------------------------------------------------


@pytest.mark.timeout(420)
def test_one_users_burst_of_grants_leaves_the_host_to_the_others_and_tokens_need_access(setup_ok, tmp_path):
    python = unix_users.users_python_or_end_the_test()
    suffix = secrets.token_hex(3)
    users = {name: f"gqt{name[0]}{suffix}" for name in ("alice", "bob", "carol")}
    spawner = f"""
c.JupyterHub.spawner_class = "jupyterhub.spawner.LocalProcessSpawner"
c.LocalProcessSpawner.env_keep = ["LANG", "LC_ALL"]  # no PYTHONPATH: the users' servers run their own install
c.Spawner.cmd = [{python!r}, "-m", "jupyterhub.singleuser"]
"""
    after = f'c.Spawner.environment["PATH"] = {os.path.dirname(python) + ":/usr/local/bin:/usr/bin:/bin"!r}'
    # Each hub user is the Unix user of the same name (the default unix_user_template): a PID verifies as a
    # user's only when the process is really theirs. The lease outlasts the burst (about 10 s here), so that no
    # grant of it goes idle before it is counted.
    settings = {"lease_seconds": BURST_LEASE, "start_grace": 1.0, "poll_interval": POLL}
    with unix_users.UnixUsers(list(users.values())) as accounts:
        hub, service, shared, _ = _hub(tmp_path, settings, spawner, after, on_full="cpu-only")
        hub.start()
        try:
            asyncio.run(burst_and_scopes(hub, service, accounts, users))
        except BaseException:
            print("---- jupyterhub log (tail) ----\n" + hub.log_tail(20000))
            raise
        finally:
            hub.stop()
            _clean(shared)


async def burst_and_scopes(hub: Hub, service, accounts, names: dict) -> None:
    await hub.wait_until_up()
    alice, bob, carol = names["alice"], names["bob"], names["carol"]
    await hub.api("POST", "/hub/api/users", {"usernames": [alice, bob, carol]})
    tokens = {u: await hub.user_token(u) for u in (alice, bob, carol)}
    grants = service.path(GRANTS_PATH)

    async def answers():
        try:
            return await hub.api("GET", service.path(STATUS_PATH), token=tokens[alice])
        except AssertionError:
            return None

    await wait_for(answers, "the quota service answering")
    # Alice runs a server of her own, as her Unix user; bob and carol have none.
    await hub.start_server(alice)
    await hub.wait_for_server(alice)

    # Carol, with no server at all, posts 1,000 grants at once under a made-up server name. What the service
    # holds is counted after the first 50 (its thread pools for DNS and the hub's answers are started by
    # then) and after all 1,000.
    client = AsyncHTTPClient(force_instance=True, max_clients=50)

    retry_after = []  # each 429's Retry-After header

    async def carols(number):
        body = json.dumps({"server": "made-up", "kernel_id": f"c{number}", "kernelspec": "x", "allowed": None})
        request = HTTPRequest(
            hub.url + grants, method="POST", body=body, headers={"Authorization": f"token {tokens[carol]}"},
            request_timeout=60,
        )
        answer = await client.fetch(request, raise_error=False)
        if answer.code == 429:
            retry_after.append(answer.headers.get("Retry-After"))
        return answer.code

    started = time.monotonic()
    codes = await asyncio.gather(*(carols(n) for n in range(50)))
    process = service_process(service)
    fds, threads = process.num_fds(), process.num_threads()
    log_before = hub.log_path.stat().st_size
    codes += await asyncio.gather(*(carols(n) for n in range(50, 1000)))
    seconds = time.monotonic() - started
    client.close()
    counts = {c: codes.count(c) for c in set(codes)}
    # 16 granted (max_kernels), the rest refused: 409 while her rate lets calls through (20 a second, bursts of
    # 100), 429 past it, each with a Retry-After of whole seconds
    assert set(codes) == {201, 409, 429} and counts[201] == 16, counts
    assert counts[201] + counts[409] <= 100 + 20 * seconds + 20, (counts, seconds)  # the burst, then the rate
    assert all(value and int(value) >= 1 for value in retry_after), retry_after[:20]
    said = hub.log_path.read_text(errors="replace")[log_before:]
    assert 1 <= said.count(f"{carol}: too many grants calls") <= 1 + int(seconds // 60), said[-3000:]

    async def carols_grants():  # her own next call waits as her last 429 said
        code, data = await hub.api("GET", grants, token=tokens[carol], ok=(200, 429))
        return data if code == 200 else None

    mine = await wait_for(carols_grants, "carol's list of grants once her rate lets her call again")
    assert len(mine["grants"]) == 16
    on_gpu = [g for g in mine["grants"] if g["devices"]]
    assert sorted(g["devices"][0]["uuid"] for g in on_gpu) == ["GPU-trust-0"] * 2 + ["GPU-trust-1"] * 2
    with sqlite3.connect(service.state_dir / "host-ledger.sqlite") as db:
        rows = {t: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("grants", "leases")}  # noqa: S608
    assert rows == {"grants": 16, "leases": 1}, rows

    # Alice's next kernel start, through her server, is admitted on a GPU at her cap; so is bob's grant.
    _, kernel = await hub.api("POST", f"/user/{alice}/api/kernels", {"name": "python3"}, token=tokens[alice])
    alices_kernel = kernel["id"]
    _, held = await hub.api("GET", f"{grants}/{alices_kernel}", token=tokens[alice])
    assert held["grant"]["devices"][0]["cap"] == 20 * GiB, held
    code, granted = await hub.api(
        "POST", grants, {"server": "", "kernel_id": f"{bob}-1", "kernelspec": "python3"}, token=tokens[bob]
    )
    assert code == 201 and granted["grant"]["devices"][0]["cap"] == 20 * GiB, granted

    process = service_process(service)
    after_fds, after_threads = process.num_fds(), process.num_threads()
    assert after_threads == threads, (threads, after_threads)
    assert after_fds <= fds + 4, (fds, after_fds)
    log_bytes = hub.log_path.stat().st_size - log_before
    assert log_bytes < 950 * 400, log_bytes  # an access-log line per request at most, no tracebacks

    # Carol keeps renewing her lease, naming no process or alice's kernel's (a live process, not hers); alice's
    # server renews its own, naming her kernel. Within a lease period and a bit carol holds nothing, and bob
    # (no process at all) neither; alice keeps her grant, her kernel's PID verified as hers.
    victim = kernel_process(alices_kernel)
    assert victim.uids().real == accounts.uid(alice)
    named = {g["kernel_id"]: ([victim.pid] if n % 2 else []) for n, g in enumerate(mine["grants"])}

    async def renew(user, server, kernels):
        await hub.api(
            "POST",
            service.path(LEASE_PATH),
            {"server": server, "kernels": [{"kernel_id": k, "pids": p} for k, p in kernels.items()]},
            token=tokens[user],
            ok=(200, 429),  # polled faster than a server renews: past her rate, that renewal waits
        )

    async def idle_released():
        await renew(carol, "made-up", named)
        _, left = await hub.api("GET", grants)  # the admin's view: every user's
        return {g["user"] for g in left["grants"]} == {alice} and left["grants"]

    left = await wait_for(idle_released, "carol's and bob's idle grants released", timeout=BURST_LEASE * 3)
    assert [g["kernel_id"] for g in left] == [alices_kernel]
    status = (await hub.api("GET", service.path(STATUS_PATH)))[1]
    assert {k["kernel_id"]: k["pids"] for k in status["kernels"]} == {alices_kernel: [victim.pid]}
    assert victim.is_running()
    with sqlite3.connect(service.state_dir / "host-ledger.sqlite") as db:
        carol_rows = db.execute("SELECT COUNT(*) FROM grants WHERE user = ?", (carol,)).fetchone()[0]
        carol_leases = db.execute("SELECT COUNT(*) FROM leases WHERE user = ?", (carol,)).fetchone()[0]
    assert (carol_rows, carol_leases) == (0, 0)
    print(
        f"burst: 1000 grants in {seconds:.1f} s, 16 granted, {counts.get(409, 0)} refused (409), {counts[429]} "
        f"answered 429; service fds {fds} -> {after_fds}, "
        f"threads {threads} -> {after_threads}; log +{log_bytes} bytes"
    )

    # 3. A token bob made without access to the service: 403 for every route, nothing granted.
    no_access = {"note": "no access", "scopes": ["read:users:name!user"], "expires_in": 600}
    _, limited = await hub.api("POST", f"/hub/api/users/{bob}/tokens", no_access)
    body = {"server": "", "kernel_id": f"{bob}-2", "kernelspec": "python3"}
    for method, path, data in (("POST", grants, body), ("GET", service.path(STATUS_PATH), None)):
        _, refused = await hub.api(method, path, data, token=limited["token"], ok=(403,))
        assert "access:services!service=gpu-quota" in refused["message"], refused
    await hub.api("POST", service.path(LEASE_PATH), {"server": "", "kernels": []}, token=limited["token"], ok=(403,))
    _, bobs = await hub.api("GET", grants, token=tokens[bob])
    assert f"{bob}-2" not in [g["kernel_id"] for g in bobs["grants"]]
    # With access (and nothing more), bob may hold a grant; the admin's routes still need the admin scope.
    _, scoped = await hub.api(
        "POST",
        f"/hub/api/users/{bob}/tokens",
        {"note": "access only", "scopes": ["access:services!service=gpu-quota"], "expires_in": 600},
    )
    code, _ = await hub.api("POST", grants, body, token=scoped["token"], ok=(201,))
    await hub.api("GET", service.path(METRICS_PATH), token=scoped["token"], ok=(403,))
    await hub.api("GET", service.path(METRICS_PATH))  # the hub-test-admin service: the admin scope and access
