"""Issue 30 item 4, with a real hub: idle GPU memory a server keeps because its kernel cannot be parked counts, for
its user, against the user's budget, and the admin's page says who keeps it.

A real JupyterHub with configurable-http-proxy and the host quota service (configure_host_service); two users, each
server spawned as its own Unix user (LocalProcessSpawner, tests/hub/unix_users.py), each kernel a real ipykernel
started through the hub's proxy. One GPU of 24 GiB that CI does not have: NVML is the file-driven fake in the
service and in every server (devices.FileFakeNvml). Alice's server parks through the file-backed fake driver
(parking.fake_file_checkpoint); on bob's server parking is unavailable (its driver does not open, as on a host
without the CUDA driver's checkpoint API), so his server reports every kernel of his not parkable, as a real one
does.

Both users' first kernels hold 4 GiB (their cap) and sit idle past park_min_idle. Bob's cannot park: the service's
status and its admin page say he keeps those 4 GiB idle, counted against his user_budget (10 GiB) on top of his
grant (unparkable_idle = "count", the default). His second kernel (4 GiB more: 4 + 4 kept + 4 > 10) is refused, with
words that say why; alice's second kernel (4 + 4 <= 10) starts. While bob's kernel runs a cell it keeps nothing
idle, and his second kernel starts too. Nothing is left behind: no grant of the refused
start, no kernel process of it, no more long polls than servers, the service's fds and threads counted before and
after, and every grant and long poll gone with the servers.

Install what it needs with `bash tests/hub/setup.sh`.
"""

from __future__ import annotations

import asyncio
import functools
import html
import secrets
import tempfile
from pathlib import Path

import psutil
import pytest

from gpu_quota_ext.parking.fake_file_checkpoint import set_usage, write_totals
from gpu_quota_ext.shared.env_vars import KERNEL_ID
from gpu_quota_ext.shared.service_contract import GRANTS_PATH, STATUS_PATH
from gpu_quota_ext.shared.sizes import GiB

from .. import waiting
from . import unix_users
from .fake_gpu_hub import hub_config, write_single_user_config
from .hubtools import Hub
from .quota_service import quota_service_config

UUID = "GPU-kept-0"
DEVICES = ({"name": "Test GPU", "total": "24GiB", "uuid": UUID},)
HELD = 4 * GiB  # what each first kernel holds: its whole cap
LEASE = 12.0  # seconds: renewals, each a long poll, every 3 s
POLL = 0.5  # the service's and the servers' samples
DEADLINE = 90.0  # seconds an event may take on a busy 2-core machine (a deadline, not a measurement)




# Bob's server (its config runs in his server's process) gets a driver that does not open: parking unavailable.
UNPARKABLE = """
import getpass
if getpass.getuser() == {unparkable!r}:
    from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint

    FakeCheckpoint.unavailable = "no checkpoint API on this server (the test's driver for {unparkable})"
    c.GpuQuota.checkpoint_class = "gpu_quota_ext.parking.fake_checkpoint.FakeCheckpoint"
"""

@pytest.mark.timeout(600)
def test_idle_memory_a_server_cannot_park_counts_against_its_users_budget_and_the_admin_page_names_him(
    setup_ok, tmp_path
):
    python = unix_users.users_python_or_end_the_test()
    suffix = secrets.token_hex(3)
    users = {name: f"gqk{name[0]}{suffix}" for name in ("alice", "bob")}
    shared = Path(tempfile.mkdtemp(prefix="gq-kept-"))
    shared.chmod(0o777)  # every server's user replaces the fake GPU's files here (no sticky bit: any may rename)
    nvml_file = shared / "nvml.json"
    try:
        config = shared / "single_user_config.py"
        write_single_user_config(config, DEVICES, POLL, UNPARKABLE.format(unparkable=users["bob"]))
        write_totals({UUID: 24 * GiB}, str(nvml_file))
        settings = {
            "nvml_class": "gpu_quota_ext.devices.fake_nvml.FileFakeNvml",
            "poll_interval": POLL,
            "lease_seconds": LEASE,
            "start_grace": 2.0,
            "user_budget": "10GiB",
            "park_min_idle": "2s",
            "page_cache_seconds": 0.0,
            "page_loads_per_second": 0.0,  # this test loads the page until it shows what it waits for
        }
        _, service = quota_service_config(tmp_path, devices=DEVICES, settings=settings)
        default = {"default_cap": "4GiB", "max_cap": "0.5", "on_full": "refuse"}
        text = hub_config(python, config, service, nvml_file, default)
        with unix_users.UnixUsers(list(users.values())) as accounts:
            hub = Hub(tmp_path, text)
            hub.start()
            try:
                asyncio.run(Scenario(hub, service, accounts, users, str(nvml_file), shared).run())
            except BaseException:
                print("---- jupyterhub log (tail) ----\n" + hub.log_tail(30000))
                raise
            finally:
                hub.stop()
    finally:
        for path in sorted(shared.glob("*"), reverse=True):
            path.unlink()
        for path in sorted(shared.glob(".*"), reverse=True):
            path.unlink()
        shared.rmdir()


wait_for = functools.partial(waiting.wait_for, timeout=DEADLINE, step=0.1)


def kernel_processes(user_uid: int) -> list:
    """The ipykernel processes of one Unix user."""
    found = []
    for process in psutil.process_iter(["cmdline", "uids"]):
        uids = process.info["uids"]
        if uids is not None and uids.real == user_uid and "ipykernel" in " ".join(process.info["cmdline"] or ()):
            found.append(process)
    return found


def kernel_process(kernel_id: str) -> psutil.Process:
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "ipykernel" in " ".join(process.info["cmdline"] or ()) and process.environ().get(KERNEL_ID) == kernel_id:
                return process
        except psutil.Error:
            continue
    raise AssertionError(f"no process of kernel {kernel_id}")


class Scenario:
    def __init__(self, hub: Hub, service, accounts, users: dict, nvml_file: str, shared: Path):
        self.hub, self.service, self.accounts, self.nvml_file = hub, service, accounts, nvml_file
        self.shared = shared
        self.alice, self.bob = users["alice"], users["bob"]
        self.users = [self.alice, self.bob]
        self.tokens: dict = {}
        self.kernels: dict = {}  # user -> first kernel id
        self.pids: dict = {}  # user -> that kernel's process id

    async def status(self) -> dict:
        return (await self.hub.api("GET", self.service.path(STATUS_PATH)))[1]  # the admin's view

    async def answers(self):
        try:
            return await self.status()
        except AssertionError:
            return None

    async def grants(self) -> list:
        _, data = await self.hub.api("GET", self.service.path(GRANTS_PATH))
        return data["grants"]

    async def start_kernel(self, user: str, ok=(201,)):
        body = {"name": "python3"}
        return await self.hub.api("POST", f"/user/{user}/api/kernels", body, token=self.tokens[user], ok=ok)

    async def granted(self, kernel_id: str):
        grants = {g["kernel_id"]: g for g in await self.grants()}
        return kernel_id in grants and grants

    def service_process(self) -> psutil.Process:
        pid = self.service.pid()
        assert pid, "the quota service is not running"
        return psutil.Process(pid)

    async def run(self):
        hub = self.hub
        await hub.wait_until_up()
        await wait_for(self.answers, "the quota service answering through the hub's proxy")
        await hub.api("POST", "/hub/api/users", {"usernames": self.users})
        await asyncio.gather(*(hub.start_server(u) for u in self.users))
        await asyncio.gather(*(hub.wait_for_server(u, timeout=120) for u in self.users))
        self.tokens = {u: await hub.user_token(u) for u in self.users}
        for user in self.users:
            _, kernel = await self.start_kernel(user)
            self.kernels[user] = kernel["id"]
            process = kernel_process(kernel["id"])
            assert process.uids().real == self.accounts.uid(user)  # each kernel its own user's
            self.pids[user] = process.pid
            set_usage(process.pid, UUID, HELD, self.nvml_file)
        ka, kb = self.kernels[self.alice], self.kernels[self.bob]

        # Bob's own server says why his kernel cannot park: its driver is not there.
        _, bobs_server = await hub.api("GET", f"/user/{self.bob}/api/gpu-quota/status", token=self.tokens[self.bob])
        assert "no checkpoint API on this server" in str(bobs_server), bobs_server

        seen = {}

        async def kept():
            status = seen["status"] = await self.status()
            rows = {k["kernel_id"]: k for k in status["kernels"]}
            park = {u: (rows.get(self.kernels[u]) or {}).get("park") or {} for u in self.users}
            users = {u["name"]: u for u in status["users"]}
            done = (
                all(rows.get(self.kernels[u], {}).get("pids") == [self.pids[u]] for u in self.users)
                and all(rows[self.kernels[u]]["devices"][0]["used"] == HELD for u in self.users)
                and park[self.alice].get("state") == "idle" and park[self.alice].get("parkable") is True
                and park[self.bob].get("state") == "idle" and park[self.bob].get("parkable") is False
                and (park[self.bob].get("idle_for") or 0) >= 2
                and users.get(self.bob, {}).get("kept_idle") == HELD
            )
            return done and status

        try:
            status = await wait_for(kept, "the service counting bob's idle, unparkable 4 GiB as kept by him")
        except AssertionError as error:
            raise AssertionError(f"{error}\nthe service's status: {str(seen.get('status'))[:6000]}") from None
        (row,) = status["kept_idle"]  # bob's alone: alice's kernel can park, so the broker can make room with it
        assert (row["user"], row["kernel_id"], row["held"], row["counted"]) == (self.bob, kb, {UUID: HELD}, True), row
        assert {u["name"]: u["kept_idle"] for u in status["users"]} == {self.alice: 0, self.bob: HELD}

        # The admin's page says who keeps it, and that it counts.
        async def page_says():
            _, page = await hub.api("GET", self.service.prefix)
            named = f"<td>{html.escape(self.bob)}</td><td>{kb}</td>" in page
            return "Idle memory that could not be parked" in page and named and page

        page = await wait_for(page_says, "the admin's page naming bob's kept idle memory")
        section = page.split("Idle memory that could not be parked", 1)[1].split("</table>", 1)[0]
        (kept_row,) = section.split("<tbody>", 1)[1].split("</tr>")[:-1]  # one row: bob's kernel, not alice's
        assert kept_row.startswith(f"<tr><td>{html.escape(self.bob)}</td><td>{kb}</td><td>(default)</td>"), kept_row
        assert f"<td>4.0 GiB on {UUID}</td>" in kept_row and "its server says it cannot park" in kept_row, kept_row
        assert kept_row.endswith("<td>yes, once more</td>"), kept_row
        # Bob sees his own; alice sees none of his.
        _, bobs = await hub.api("GET", self.service.path(STATUS_PATH), token=self.tokens[self.bob])
        assert [k["kernel_id"] for k in bobs["kept_idle"]] == [kb], bobs["kept_idle"]
        _, alices = await hub.api("GET", self.service.path(STATUS_PATH), token=self.tokens[self.alice])
        assert alices["kept_idle"] == [] and kb not in str(alices) and self.bob not in str(alices)

        # What could leak, counted before: grants, the leases' long polls, the service's fds and threads.
        grants_before = sorted(g["kernel_id"] for g in await self.grants())
        assert grants_before == sorted([ka, kb])
        assert status["long_polls"] <= 2
        process = self.service_process()
        fds, threads = process.num_fds(), process.num_threads()
        bobs_kernels = {p.pid for p in kernel_processes(self.accounts.uid(self.bob))}

        # Bob's second kernel: 4 GiB granted + 4 GiB kept + 4 GiB more passes his 10 GiB. Refused, saying why.
        code, refused = await self.start_kernel(self.bob, ok=(503,))
        words = str(refused)
        assert "could not be parked" in words and "user_budget 10GiB" in words, refused
        assert ka not in words and self.alice not in words  # another user's kernel, unnamed
        # Alice's second kernel (4 + 4 <= 10: nothing of hers is kept idle) starts, on the GPU.
        _, alices_second = await self.start_kernel(self.alice)
        ka2 = alices_second["id"]

        grants = await wait_for(lambda: self.granted(ka2), "alice's second kernel's grant")
        assert {d["cap"] for d in grants[ka2]["devices"]} == {4 * GiB}, grants[ka2]
        assert sorted(grants) == sorted([ka, kb, ka2])  # nothing of bob's refused start
        assert {p.pid for p in kernel_processes(self.accounts.uid(self.bob))} == bobs_kernels
        _, bobs_list = await hub.api("GET", f"/user/{self.bob}/api/kernels", token=self.tokens[self.bob])
        assert [k["id"] for k in bobs_list] == [kb]

        # What refused him was the idle memory he keeps: while his kernel runs a cell (until the test lets it end),
        # it keeps nothing idle, and his second kernel (4 + 4 <= 10) starts.
        go_on = self.shared / "bobs-cell-may-end"
        code = f"import os, time\nwhile not os.path.exists({str(go_on)!r}):\n    time.sleep(0.05)\nprint('done')"
        cell = asyncio.ensure_future(hub.execute(self.bob, self.tokens[self.bob], kb, code, timeout=2 * DEADLINE))
        try:
            async def busy_keeps_nothing():
                status = await self.status()
                rows = {k["kernel_id"]: k for k in status["kernels"]}
                users = {u["name"]: u for u in status["users"]}
                busy = (rows[kb].get("park") or {}).get("state") == "busy"
                return busy and status["kept_idle"] == [] and users[self.bob]["kept_idle"] == 0 and status

            await wait_for(busy_keeps_nothing, "bob's kernel busy, keeping no idle memory")
            _, bobs_second = await self.start_kernel(self.bob)
            kb2 = bobs_second["id"]
        finally:
            go_on.touch()
        ran = await cell
        assert ran["status"] == "ok" and ran["stdout"].strip() == "done", ran
        grants = await wait_for(lambda: self.granted(kb2), "bob's second kernel's grant")
        assert sorted(grants) == sorted([ka, kb, ka2, kb2]) and {d["cap"] for d in grants[kb2]["devices"]} == {HELD}

        # Counted after: no more long polls than servers, the service's fds and threads.
        status = await self.status()
        assert status["long_polls"] <= 2, status["long_polls"]
        process = self.service_process()
        after_fds, after_threads = process.num_fds(), process.num_threads()
        assert after_threads <= threads + 1, (threads, after_threads)  # the default executor may add a worker
        assert after_fds <= fds + 4, (fds, after_fds)  # the proxy's keep-alive connections

        # The servers stop: their grants go, and so do their long polls.
        for user in self.users:
            await hub.api("DELETE", f"/hub/api/users/{user}/server")

        async def all_gone():
            status = await self.status()
            return not await self.grants() and status["long_polls"] == 0 and status["kept_idle"] == [] and status

        await wait_for(all_gone, "every grant, long poll and kept idle memory gone with the servers")
        process = self.service_process()
        assert process.num_threads() <= threads + 2, (threads, process.num_threads())
        assert process.num_fds() <= fds, (fds, process.num_fds())
        print(
            f"kept idle: bob's refused start said: {words[:400]}; service fds {fds} -> {after_fds} -> "
            f"{process.num_fds()}, threads {threads} -> {after_threads} -> {process.num_threads()}"
        )
