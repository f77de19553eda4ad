"""Issue 28, with a real hub: the host service holds the host-memory account for every user of a hub host, so two
users' parks in the same second cannot both take host memory that holds one of them.

A real JupyterHub with configurable-http-proxy and the host quota service (configure_host_service); two users, each
server spawned as its own Unix user (LocalProcessSpawner, tests/hub/unix_users.py), each kernel a real ipykernel
started through the hub's proxy. One GPU that CI does not have: NVML is the file-driven fake in the service and in
every server (devices.FileFakeNvml), and the servers park through the file-backed fake driver
(parking.fake_file_checkpoint), which moves a process's usage out of that file and logs every call.

The host's memory is this machine's own, as both the service and the servers read it (psutil): a CI machine cannot be
made to run short, so the service's park_host_margin is set to half of what the machine had available when the test
began, and each kernel is made to hold (in the fake NVML file) two thirds of what is left above that margin just
before the parks: one park fits the service's account (bytes + margin <= available), two do not (the second's check
sees the first's bytes promised), whatever the machine's memory does meanwhile within a sixth of it either way. Each
server's own check (its own margin, 2 GiB) passes: only the host service, which counts every user's parks, can refuse.

Both users' servers are asked to park at once (their park routes, concurrently, when both leases have just reported,
so that no lease renewal can end the first promise before the second check). One park is promised and goes; the
other is refused before any driver call of its kernel, with words that name the host's memory and the park under
way. Neither kernel is lost: both run a cell afterwards (the parked one resumes). The promise ends after the park (the
admin's status, host_memory). A user naming the other's kernel in host_park gets 403, and nothing is promised.
What could leak (grants, the leases' long polls, the service's fds and threads) is counted before and after.

Install what it needs with `bash tests/hub/setup.sh`.
"""

from __future__ import annotations

import asyncio
import functools
import math
import secrets
import tempfile
from pathlib import Path

import psutil
import pytest

from gpu_quota_ext.parking.checkpoint import CHECKPOINTED
from gpu_quota_ext.parking.fake_file_checkpoint import read_state, set_usage, write_totals
from gpu_quota_ext.shared.env_vars import KERNEL_ID
from gpu_quota_ext.shared.service_contract import GRANTS_PATH, LEASE_RENEW, ROOM_PATH, STATUS_PATH
from gpu_quota_ext.shared.sizes import GiB, format_bytes

from .. import waiting
from . import unix_users
from .fake_gpu_hub import hub_config, write_single_user_config
from .hubtools import Hub
from .quota_service import quota_service_config

UUID = "GPU-hostpark-0"
POLL = 0.5  # the service's and the servers' samples
DEADLINE = 90.0  # seconds an event may take on a busy 2-core machine (a deadline, not a measurement)
RENEW = float(LEASE_RENEW)  # the default lease (60 s): each server reports in a long poll every 15 s




@pytest.mark.timeout(600)
def test_two_users_parks_in_the_same_second_get_the_hosts_memory_from_the_host_services_one_account(
    setup_ok, tmp_path
):
    python = unix_users.users_python_or_end_the_test()
    suffix = secrets.token_hex(3)
    users = {name: f"gqh{name[0]}{suffix}" for name in ("alice", "bob")}
    available = psutil.virtual_memory().available
    margin = available // 2  # the service's: the rest above it is what parks may take
    total = max(24, math.ceil(2 * available / GiB))  # GiB: room on the device for both kernels, under their caps
    devices = ({"name": "Test GPU", "total": f"{total}GiB", "uuid": UUID},)
    shared = Path(tempfile.mkdtemp(prefix="gq-hostpark-"))
    shared.chmod(0o777)  # every server's user replaces the fake GPU's files here (no sticky bit: any may rename)
    nvml_file = shared / "nvml.json"
    try:
        config = shared / "single_user_config.py"
        write_single_user_config(config, devices, POLL)
        write_totals({UUID: total * GiB}, str(nvml_file))
        settings = {
            "nvml_class": "gpu_quota_ext.devices.fake_nvml.FileFakeNvml",
            "poll_interval": POLL,
            "start_grace": 2.0,
            "park_min_idle": "2s",
            "park_host_margin": str(margin),
        }
        _, service = quota_service_config(tmp_path, devices=devices, settings=settings)
        text = hub_config(python, config, service, nvml_file)
        with unix_users.UnixUsers(list(users.values())) as accounts:
            hub = Hub(tmp_path, text)
            hub.start()
            try:
                asyncio.run(Scenario(hub, service, accounts, users, str(nvml_file), margin).run())
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


def kernel_process(kernel_id: str) -> psutil.Process:
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "ipykernel" in " ".join(process.info["cmdline"] or ()) and process.environ().get(KERNEL_ID) == kernel_id:
                return process
        except psutil.Error:
            continue
    raise AssertionError(f"no process of kernel {kernel_id}")


class Scenario:
    def __init__(self, hub: Hub, service, accounts, users: dict, nvml_file: str, margin: int):
        self.hub, self.service, self.accounts, self.nvml_file = hub, service, accounts, nvml_file
        self.margin = margin
        self.alice, self.bob = users["alice"], users["bob"]
        self.users = [self.alice, self.bob]
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

    async def grants(self) -> list:
        _, data = await self.hub.api("GET", self.service.path(GRANTS_PATH))
        return data["grants"]

    async def server_park(self, user) -> dict:
        """The kernel's park state as its own server shows it."""
        _, status = await self.hub.api("GET", f"/user/{user}/api/gpu-quota/status", token=self.tokens[user])
        return next(k for k in status["kernels"] if k["id"] == self.kernels[user])["park"]

    def service_process(self) -> psutil.Process:
        pid = self.service.pid()
        assert pid, "the quota service is not running"
        return psutil.Process(pid)

    async def park(self, user):
        return await self.hub.api(
            "POST", f"/user/{user}/api/gpu-quota/kernels/{self.kernels[user]}/park", {}, token=self.tokens[user],
            ok=(202, 409),
        )

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
        ka, kb = (self.kernels[u] for u in self.users)

        # What each kernel holds: two thirds of what the host has above the service's margin now. One park's bytes
        # and the margin fit what the host has; two parks' bytes and the margin do not.
        held = int((psutil.virtual_memory().available - self.margin) / 1.5)
        assert held >= GiB, f"this machine has too little memory available for the test ({held} bytes a park)"
        for user in self.users:
            set_usage(self.pids[user], UUID, held, self.nvml_file)
            ran = await hub.execute(user, self.tokens[user], self.kernels[user], "x = 41")
            assert ran["status"] == "ok", ran

        async def servers_see():
            return all([(await self.server_park(u))["parkable"] is True for u in self.users])

        await wait_for(servers_see, "each server seeing its kernel hold its bytes, idle and parkable")

        async def fresh_reports():
            # Both servers' leases reported within the last 10 s: neither reports again for 5 s, so no report of a
            # park done can end its promise before the other park's check (one exists in every renewal period).
            status = await self.status()
            rows = {k["kernel_id"]: k for k in status["kernels"]}
            park = {u: (rows.get(self.kernels[u]) or {}).get("park") or {} for u in self.users}
            ready = (
                all(rows[self.kernels[u]]["devices"][0]["used"] == held for u in self.users)
                and all(park[u].get("state") == "idle" and park[u].get("parkable") for u in self.users)
                and all((park[u].get("reported") or RENEW) < RENEW - 5 for u in self.users)
                and status["host_memory"] == {"promised": 0}
            )
            return ready and status

        status = await wait_for(fresh_reports, "both leases' reports fresh, the service seeing both kernels' bytes")

        # What could leak, counted before: grants, the leases' long polls, the service's fds and threads.
        assert sorted(g["kernel_id"] for g in await self.grants()) == sorted([ka, kb])
        assert status["long_polls"] <= 2
        process = self.service_process()
        fds, threads = process.num_fds(), process.num_threads()
        calls_before = len(read_state(self.nvml_file)["calls"])

        # Both servers asked to park at once.
        answers = dict(zip(self.users, await asyncio.gather(*(self.park(u) for u in self.users))))
        codes = sorted(code for code, _ in answers.values())
        assert codes == [202, 409], answers
        parked = next(u for u, (code, _) in answers.items() if code == 202)
        refused = next(u for u, (code, _) in answers.items() if code == 409)
        words = answers[refused][1]["message"]
        assert words.startswith("did not park: the host has") and "of memory available" in words, words
        assert f"parking needs {format_bytes(held)} plus a margin of {format_bytes(self.margin)}" in words, words
        assert f"parks under way will still bring {format_bytes(held)}" in words, words
        assert parked not in words and self.kernels[parked] not in words  # another user's park, unnamed

        async def parked_on_the_host():
            return read_state(self.nvml_file)["states"].get(str(self.pids[parked])) == CHECKPOINTED

        await wait_for(parked_on_the_host, f"{parked}'s kernel parked")
        await wait_for(lambda: self.server_state(parked, "parked"), f"{parked}'s server showing its kernel parked")
        # The refused park made no driver call: its kernel runs as it did.
        calls = read_state(self.nvml_file)["calls"][calls_before:]
        assert self.pids[refused] not in {pid for _, pid, _ in calls}, calls
        assert [pid for call, pid, _ in calls if call == "cuCheckpointProcessCheckpoint"] == [self.pids[parked]]
        refused_park = await self.server_park(refused)
        assert refused_park["state"] == "idle" and "host has" in (refused_park.get("reason") or ""), refused_park

        # The promise ends after the park: the service hears the kernel parked (its bytes are in the host's reading).
        seen = {}

        async def promise_ended():
            status = seen["status"] = await self.status()
            rows = {k["kernel_id"]: k for k in status["kernels"]}
            done = (
                status["host_memory"] == {"promised": 0}
                and (rows[self.kernels[parked]].get("park") or {}).get("state") == "parked"
            )
            return done and status

        try:
            await wait_for(promise_ended, "the host memory promised to the park ended with it")
        except AssertionError as error:
            raise AssertionError(f"{error}\nthe service's status: {str(seen.get('status'))[:6000]}") from None

        # One user naming the other's kernel in host_park: 403, nothing promised.
        other = self.kernels[parked]
        body = {"server": "", "park": [], "demands": [], "host_park": {"kernel_id": other, "bytes": GiB}}
        _, answer = await hub.api("POST", self.service.path(ROOM_PATH), body, token=self.tokens[refused], ok=(403,))
        assert parked not in str(answer), answer
        assert (await self.status())["host_memory"] == {"promised": 0}

        # Neither kernel is lost: both run a cell, the parked one after it resumes (the device has room).
        for user in (refused, parked):
            ran = await hub.execute(user, self.tokens[user], self.kernels[user], "print(x + 1)", timeout=DEADLINE)
            assert ran["status"] == "ok" and ran["stdout"].strip().splitlines()[-1] == "42", ran
        state = read_state(self.nvml_file)
        assert state["broken"] == [] and all(r["ok"] for r in state["restores"]), state["restores"]
        assert [r["pid"] for r in state["restores"]] == [self.pids[parked]], state["restores"]

        # Counted after: the same grants, no more long polls than servers, the service's fds and threads.
        assert sorted(g["kernel_id"] for g in await self.grants()) == sorted([ka, kb])
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
            return not await self.grants() and status["long_polls"] == 0 and status

        await wait_for(all_gone, "every grant and long poll gone with the servers")
        process = self.service_process()
        assert process.num_threads() <= threads + 2, (threads, process.num_threads())
        assert process.num_fds() <= fds, (fds, process.num_fds())
        print(
            f"host park: {format_bytes(held)} a park, service margin {format_bytes(self.margin)}; {parked}'s park "
            f"promised, {refused}'s refused: {words}; service fds {fds} -> {after_fds} -> {process.num_fds()}, "
            f"threads {threads} -> {after_threads} -> {process.num_threads()}"
        )

    async def server_state(self, user: str, state: str) -> bool:
        return (await self.server_park(user))["state"] == state
