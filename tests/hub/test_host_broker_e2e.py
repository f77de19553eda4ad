"""Issue 21, host-wide under the host service: one budget, so one broker's view, shown with three real Unix users.

A real JupyterHub with configurable-http-proxy and the host quota service (configure_host_service); three users,
each server spawned as its own Unix user (LocalProcessSpawner, tests/hub/unix_users.py), each kernel a real
ipykernel started through the hub's proxy. One GPU of 12 GiB, overcommitted (overcommit 2.0, caps of 0.45), that
CI does not have: NVML is the file-driven fake in the service and in every server (devices.FileFakeNvml), and the
servers park through the file-backed fake driver (parking.fake_file_checkpoint), which moves a process's usage in
that same file, so the service sees every park and resume as NVML would, and which breaks a process whose restore
finds the device full, as NVIDIA's driver does.

Alice's kernel holds 5 GiB and is parked (her server's park route); bob's and carol's hold 5 GiB each and are idle,
bob's the longer. Alice's next cell asks for her memory back: her server asks the host's broker, which finds the
device short (12 - 10 used - their headroom - the margin < 5) and parks the other user's least recently active
idle kernel, bob's: his server takes the request in its lease's answer (a long poll) and parks it; the service's
next sample shows the room, alice's server is told "go", restores, and her cell runs. Carol's kernel is never
touched, and no restore ever ran into a full device. What could leak (grants, the leases' long polls, the service's
fds and threads) is counted before and after, and once the servers stop.

Install what it needs with `bash tests/hub/setup.sh`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from gpu_quota_ext.parking.checkpoint import CHECKPOINTED
from gpu_quota_ext.parking.fake_file_checkpoint import read_state, set_usage, write_totals
from gpu_quota_ext.shared.env_vars import KERNEL_ID
from gpu_quota_ext.shared.service_contract import GRANTS_PATH, LEASE_PATH, ROOM_PATH, STATUS_PATH
from gpu_quota_ext.shared.sizes import GiB

from .. import waiting
from . import unix_users
from .fake_gpu_hub import hub_config, write_single_user_config
from .hubtools import Hub
from .quota_service import quota_service_config

UUID = "GPU-broker-0"
DEVICES = ({"name": "Test GPU", "total": "12GiB", "uuid": UUID},)
HELD = 5 * GiB  # what each kernel holds
LEASE = 12.0  # seconds: renewals, each a long poll, every 3 s
POLL = 0.5  # the service's and the servers' samples
DEADLINE = 90.0  # seconds an event may take on a busy 2-core machine (a deadline, not a measurement)




@pytest.mark.timeout(600)
def test_a_resume_parks_another_users_least_recently_active_idle_kernel_through_the_host_service(setup_ok, tmp_path):
    python = unix_users.users_python_or_end_the_test()
    suffix = secrets.token_hex(3)
    users = {name: f"gqb{name[0]}{suffix}" for name in ("alice", "bob", "carol")}
    shared = Path(tempfile.mkdtemp(prefix="gq-broker-"))
    shared.chmod(0o777)  # every server's user replaces the fake GPU's files here (no sticky bit: any may rename)
    nvml_file = shared / "nvml.json"
    try:
        config = shared / "single_user_config.py"
        write_single_user_config(config, DEVICES, POLL)
        write_totals({UUID: 12 * GiB}, str(nvml_file))
        settings = {
            "nvml_class": "gpu_quota_ext.devices.fake_nvml.FileFakeNvml",
            "poll_interval": POLL,
            "lease_seconds": LEASE,
            "start_grace": 2.0,
            "overcommit": 2.0,
            "park_min_idle": "2s",
            "park_wait_limit": "5min",
        }
        _, service = quota_service_config(tmp_path, devices=DEVICES, settings=settings)
        text = hub_config(python, config, service, nvml_file)
        with unix_users.UnixUsers(list(users.values())) as accounts:
            hub = Hub(tmp_path, text)
            hub.start()
            try:
                asyncio.run(Scenario(hub, service, accounts, users, str(nvml_file)).run())
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


# This file's events: a deadline for a busy 2-core machine, checks that ask a server no faster than this.
wait_for = functools.partial(waiting.wait_for, timeout=DEADLINE, step=0.1)


def kernel_process(kernel_id: str) -> psutil.Process:
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "ipykernel" in " ".join(process.info["cmdline"] or ()) and process.environ().get(KERNEL_ID) == kernel_id:
                return process
        except psutil.Error:
            continue
    raise AssertionError(f"no process of kernel {kernel_id}")


class Scenario:
    def __init__(self, hub: Hub, service, accounts, users: dict, nvml_file: str):
        self.hub, self.service, self.accounts, self.nvml_file = hub, service, accounts, nvml_file
        self.alice, self.bob, self.carol = users["alice"], users["bob"], users["carol"]
        self.users = [self.alice, self.bob, self.carol]
        self.tokens: dict = {}
        self.kernels: dict = {}  # user -> kernel id
        self.pids: dict = {}  # user -> the kernel's process id

    async def status(self) -> dict:
        return (await self.hub.api("GET", self.service.path(STATUS_PATH)))[1]  # the admin's view

    async def answers(self):
        try:
            return await self.status()
        except AssertionError:
            return None

    async def server_park(self, user) -> dict:
        """The kernel's park state as its own server shows it."""
        _, status = await self.hub.api("GET", f"/user/{user}/api/gpu-quota/status", token=self.tokens[user])
        return next(k for k in status["kernels"] if k["id"] == self.kernels[user])["park"]

    async def service_rows(self) -> dict:
        return {k["kernel_id"]: k for k in (await self.status())["kernels"]}

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
            _, kernel = await hub.api("POST", f"/user/{user}/api/kernels", {"name": "python3"}, token=self.tokens[user])
            self.kernels[user] = kernel["id"]
            process = kernel_process(kernel["id"])
            assert process.uids().real == self.accounts.uid(user)  # each kernel its own user's
            self.pids[user] = process.pid

        async def registered():
            rows = await self.service_rows()
            return all(rows.get(self.kernels[u], {}).get("pids") == [self.pids[u]] for u in self.users) and rows

        await wait_for(registered, "each server's lease registering its kernel's PID, verified by its uid")

        # Alice's kernel holds 5 GiB and runs a cell; then it is parked by her own server (her park route).
        ka, kb, kc = (self.kernels[u] for u in self.users)
        ran = await hub.execute(self.alice, self.tokens[self.alice], ka, "x = 41")
        assert ran["status"] == "ok", ran
        set_usage(self.pids[self.alice], UUID, HELD, self.nvml_file)
        await wait_for(lambda: self.server_sees(self.alice), "alice's server seeing her kernel's 5 GiB")
        _, answer = await hub.api(
            "POST", f"/user/{self.alice}/api/gpu-quota/kernels/{ka}/park", {}, token=self.tokens[self.alice]
        )
        assert answer["park"]["state"] in ("parking", "parked"), answer

        async def alice_parked():
            return (await self.server_park(self.alice))["state"] == "parked"

        await wait_for(alice_parked, "alice's kernel parked")
        assert str(self.pids[self.alice]) not in read_state(self.nvml_file)["usage"]

        # Bob's and carol's kernels hold 5 GiB each and run a cell each, bob's first: his is the less recently active.
        for user in (self.bob, self.carol):
            set_usage(self.pids[user], UUID, HELD, self.nvml_file)
            await wait_for(lambda user=user: self.server_sees(user), f"{user}'s server seeing the kernel's 5 GiB")
            ran = await hub.execute(user, self.tokens[user], self.kernels[user], "y = 1")
            assert ran["status"] == "ok", ran

        async def the_services_view():
            rows = await self.service_rows()
            park = {u: (rows[self.kernels[u]].get("park") or {}) for u in self.users}
            ready = (
                park[self.alice].get("state") == "parked"
                and all(park[u].get("state") == "idle" and park[u].get("parkable") for u in (self.bob, self.carol))
                and all((park[u].get("idle_for") or 0) >= 3 for u in (self.bob, self.carol))
                and rows[kb]["devices"][0]["used"] == HELD
                and rows[kc]["devices"][0]["used"] == HELD
            )
            return ready and park

        park = await wait_for(the_services_view, "the service hearing alice's kernel parked, bob's and carol's idle")
        assert park[self.bob]["idle_for"] > park[self.carol]["idle_for"]

        # What could leak, counted before: grants, the leases' long polls, the service's fds and threads.
        status = await self.status()
        assert len(status["kernels"]) == 3 and status["waiting"] == [] and status["reservations"] == []
        assert status["long_polls"] <= 3
        process = self.service_process()
        fds, threads = process.num_fds(), process.num_threads()
        calls_before = len(read_state(self.nvml_file)["calls"])

        # Alice's next cell.
        started, started_wall = time.monotonic(), time.time()
        cell = asyncio.ensure_future(
            hub.execute(self.alice, self.tokens[self.alice], ka, "print(x + 1)", timeout=DEADLINE)
        )

        async def bob_parked():
            return read_state(self.nvml_file)["states"].get(str(self.pids[self.bob])) == CHECKPOINTED

        async def long_polls():
            count = (await self.status())["long_polls"]
            most[0] = max(most[0], count)
            return None

        most = [0]
        await wait_for(lambda: self.either(bob_parked, long_polls, cell), "bob's kernel parked for alice's cell")
        parked_after = time.monotonic() - started
        ran = await cell
        resumed_after = time.monotonic() - started
        assert ran["status"] == "ok" and ran["stdout"].strip().splitlines()[-1] == "42", ran
        waited = [line for line in ran["stdout"].splitlines() if line.startswith("gpu-quota:")]
        assert self.bob not in ran["stdout"] and kb not in ran["stdout"], ran  # another user's kernel, unnamed

        # What the fake driver saw: bob's kernel parked, carol's untouched, alice's restored once, after bob's park,
        # into room that was there.
        state = read_state(self.nvml_file)
        calls = state["calls"][calls_before:]
        touched = {pid for _, pid, _ in calls}
        assert self.pids[self.carol] not in touched, calls
        park_at = next(at for call, pid, at in calls if call == "cuCheckpointProcessCheckpoint")
        assert [pid for call, pid, _ in calls if call == "cuCheckpointProcessCheckpoint"] == [self.pids[self.bob]]
        (restore,) = [r for r in state["restores"] if r["at"] >= started_wall]
        assert restore["pid"] == self.pids[self.alice] and restore["ok"] and restore["at"] > park_at, restore
        assert restore["free"][UUID] >= restore["need"][UUID] + GiB, restore  # the need and the margin
        assert state["broken"] == [] and all(r["ok"] for r in state["restores"]), state["restores"]
        assert (await self.server_park(self.bob))["state"] == "parked"
        assert (await self.server_park(self.carol))["state"] == "idle"
        # Why, in the hub's log (the service's and the servers' output): the host's broker asked bob's server, which
        # parked his kernel for another kernel of the host; nothing asked carol's.
        log = hub.log_tail(2_000_000)
        asked = f"asks {self.bob}'s server '' to park idle kernel {kb}, to make room for {self.alice}'s kernel {ka}"
        assert log.count(asked) == 1, log[-5000:]
        assert f"kernel {kb} park state idle -> parking: to make room for another kernel of this host" in log
        assert f"park idle kernel {kc}" not in log and f"kernel {kc} park state" not in log

        # The service's view settles: nothing waits, the reservation ended with the sample showing alice's memory.
        seen = {}

        async def settled():
            status = seen["status"] = await self.status()
            rows = {k["kernel_id"]: k for k in status["kernels"]}
            done = (
                status["waiting"] == []
                and status["reservations"] == []
                and rows[ka]["devices"][0]["used"] == HELD
                and not rows[kb]["devices"][0]["used"]  # no process of bob's kernel on the device
            )
            return done and status

        try:
            status = await wait_for(settled, "the service's view settled: alice's memory back, nothing reserved")
        except AssertionError as error:
            raise AssertionError(f"{error}\nthe service's status: {json.dumps(seen.get('status'))[:6000]}") from None
        # Each user sees their own: bob sees his kernel's park state, not whose resume it made room for.
        _, bobs = await hub.api("GET", self.service.path(STATUS_PATH), token=self.tokens[self.bob])
        assert [k["kernel_id"] for k in bobs["kernels"]] == [kb] and "long_polls" not in bobs
        assert ka not in json.dumps(bobs) and self.alice not in json.dumps(bobs)
        _, page = await hub.api("GET", self.service.prefix)
        assert "Waiting for device memory" in page and "Leases waiting for park requests" in page

        # Carol, with her own token, names alice's kernel: as a demand of hers (room for it), and in her lease's park
        # report as idle and parkable. The service refuses the one (403) and ignores the other: nothing of alice's
        # changes, nothing is asked of anyone.
        carol = self.tokens[self.carol]
        demand = {"server": "", "park": [], "demands": [{"kernel_id": ka, "need": {UUID: 5 * GiB}}]}
        _, refused = await hub.api("POST", self.service.path(ROOM_PATH), demand, token=carol, ok=(403,))
        assert self.alice not in json.dumps(refused), refused  # the id it names is carol's own words, said back
        report = {"kernel_id": ka, "state": "idle", "idle_for": 9999.0, "parkable": True}
        lease = {"server": "", "kernels": [{"kernel_id": kc, "pids": [self.pids[self.carol]]}], "park": [report]}
        await hub.api("POST", self.service.path(LEASE_PATH), lease, token=carol)
        after_attack = await self.status()  # answered after the lease: the service has taken the report in
        assert after_attack["waiting"] == [] and after_attack["reservations"] == [], after_attack
        alices = next(k for k in after_attack["kernels"] if k["kernel_id"] == ka).get("park") or {}
        assert (alices.get("idle_for") or 0) < 9999.0, alices  # what alice's own server reported, not carol's
        assert f"park idle kernel {ka}" not in hub.log_tail(4_000_000)
        assert read_state(self.nvml_file)["states"].get(str(self.pids[self.alice])) != CHECKPOINTED

        # Counted after: the same grants, no more long polls than servers, the service's fds and threads.
        assert len(status["kernels"]) == 3
        assert most[0] <= 3 and status["long_polls"] <= 3, (most, status["long_polls"])
        process = self.service_process()
        after_fds, after_threads = process.num_fds(), process.num_threads()
        assert after_threads == threads, (threads, after_threads)
        assert after_fds <= fds + 4, (fds, after_fds)  # the proxy's keep-alive connections

        # The servers stop: their grants go, and so do their long polls.
        polls = await wait_for(lambda: self.long_polls_now(), "the servers' leases waiting in their long polls")
        renewals = hub.log_tail(4_000_000).count("/services/gpu-quota/api/lease")
        for user in self.users:
            await hub.api("DELETE", f"/hub/api/users/{user}/server")

        async def all_gone():
            status = await self.status()
            _, grants = await hub.api("GET", self.service.path(GRANTS_PATH))
            return not grants["grants"] and status["long_polls"] == 0 and status

        status = await wait_for(all_gone, "every grant and long poll gone with the servers")
        process = self.service_process()
        # Three servers stopping at once check three new tokens with the hub at once: asyncio's default executor
        # (the hub's address looked up) may start a worker or two, which it keeps, a bounded few. A thread or an fd
        # per long poll (some forty of them here) would show as many more.
        assert process.num_threads() <= threads + 2, (threads, process.num_threads())
        assert process.num_fds() <= fds, (fds, process.num_fds())
        print(
            f"host broker: alice's cell -> bob's kernel's checkpoint call {park_at - started_wall:.2f} s (seen "
            f"parked {parked_after:.2f} s), alice's restore {restore['at'] - started_wall:.2f} s, her cell answered "
            f"{resumed_after:.2f} s (free at the restore "
            f"{restore['free'][UUID] / GiB:.1f} GiB for {restore['need'][UUID] / GiB:.1f} GiB); long polls at most "
            f"{most[0]}; service fds {fds} -> {after_fds} -> {process.num_fds()}, threads {threads} -> "
            f"{after_threads} -> {process.num_threads()}; grants 3 -> 3 -> 0; long polls {polls} -> 0 after "
            f"{renewals} lease renewals; alice's cell said: {waited}"
        )

    async def long_polls_now(self) -> int:
        return (await self.status())["long_polls"]

    async def server_sees(self, user) -> bool:
        _, status = await self.hub.api("GET", f"/user/{user}/api/gpu-quota/status", token=self.tokens[user])
        row = next(k for k in status["kernels"] if k["id"] == self.kernels[user])
        return row["park"]["parkable"] is True

    @staticmethod
    async def either(done, also, cell):
        """`done()`, after `also()`; a cell that ended first is an answer too (its assertion says what went wrong)."""
        await also()
        if cell.done():
            return True
        return await done()
