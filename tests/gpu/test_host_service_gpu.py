"""Issue 14 on a real GPU: the host quota service's one budget and its host watchdog with real NVML.

No JupyterHub here (the device machine has neither JupyterHub nor node for configurable-http-proxy,
and nothing can be fetched): the service's parts are put together as GpuQuotaService.build() does (the
NVML inventory, the host book over SQLite, the host sampler on the real driver) without its web app,
and the hub's part, telling the service who a token belongs to, is played by calling the book with the
user names. Two ordinary Unix users each run a CUDA process registered as their kernel (the
lease a user server sends); a third process, of one of them, holds GPU memory outside every grant.
The service must count each kernel's usage to its user and kernel, and the stray process as that
user's unmanaged usage; with unmanaged_action = "kill" it kills the stray process and nothing else.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import time

import pytest

from .conftest import record

pytestmark = pytest.mark.gpu

GiB = 1 << 30
USERS = ("gqhost-alice", "gqhost-bob")
HOLD = (
    "import sys, torch\n"
    "x = torch.empty({n}, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


def _can_make_users() -> bool:
    return os.geteuid() == 0 and shutil.which("useradd") and shutil.which("runuser")


@pytest.fixture(scope="module")
def unix_users():
    if not _can_make_users():
        pytest.skip("needs root, useradd and runuser (ordinary users own the processes)")
    made = []
    for name in USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--no-create-home", name], check=True)
            made.append(name)
    yield USERS
    for name in made:
        subprocess.run(["userdel", name], check=False)


def hold(user: str, nbytes: int) -> subprocess.Popen:
    """A CUDA process of `user` holding `nbytes` until its stdin closes."""
    env = {
        k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")
    }
    process = subprocess.Popen(
        [
            "runuser",
            "-u",
            user,
            "--",
            "env",
            *[f"{k}={v}" for k, v in env.items()],
            sys.executable,
            "-c",
            HOLD.format(n=nbytes),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd="/tmp",
    )
    line = process.stdout.readline()
    assert line.strip() == "ready", f"{user}'s CUDA process did not start: {line!r}"
    return process


def cuda_pid(launcher: subprocess.Popen) -> int:
    """runuser forks the python process: the CUDA process is runuser's descendant."""
    import psutil

    for child in psutil.Process(launcher.pid).children(recursive=True):
        if "python" in os.path.basename(child.exe() if child.is_running() else ""):
            return child.pid
    return launcher.pid


class HostService:
    """The service's parts as GpuQuotaService.build() puts them together (its web app and HubAuth aside:
    JupyterHub is not on the device machine), over the real NVML inventory and driver."""

    def __init__(self, state_dir: str, action: str):
        from gpu_quota_ext.devices import NvmlInventory
        from gpu_quota_ext.devices.nvml import PynvmlBackend
        from gpu_quota_ext.hub import hub_caps
        from gpu_quota_ext.hub.service.book import HostBook
        from gpu_quota_ext.hub.service.sampler import HostSampler
        from gpu_quota_ext.hub.service.store import Store
        from gpu_quota_ext.hub.service.user_policy import host_limits
        from gpu_quota_ext.policy import build_policy

        self.host_policy = build_policy("0.2", "0.3", (), 1.0, "spread", "cpu-only", "clamp")
        # No per-user budget: these checks are of the device's budget, which one user's kernels fill here.
        self.limits = host_limits(user_budget="none")
        self.caps = hub_caps(default={"default_cap": "0.2", "max_cap": "0.3"})
        self.devices = NvmlInventory().list_devices()
        self.book = HostBook(self.devices, self.host_policy, Store(state_dir, self.devices), 60.0, 30.0)
        uuid_of = {d.index: d.uuid for d in self.devices}

        def granted():
            return {
                o.grant.kernel_id: (o.grant.user, tuple(uuid_of[i] for i in o.grant.devices)) for o in self.book.owned()
            }

        self.sampler = HostSampler(
            PynvmlBackend(),
            [d.uuid for d in self.devices],
            self.book.registrations,
            granted,
            0.5,
            10.0,
            action,
            0.0,
            "{username}",
        )

    def status_now(self) -> dict:
        from gpu_quota_ext.hub.service.status import build_status

        return build_status(
            self.book,
            self.sampler.last,
            self.sampler.state(),
            list(self.sampler.actions),
            {},
            "admin",
            True,
            time.time(),
        )


def service(tmp_path, action: str) -> HostService:
    return HostService(str(tmp_path / f"state-{action}"), action)


def wait_samples(app, count: int, deadline: float = 60.0) -> None:
    start = app.sampler.samples
    end = time.monotonic() + deadline
    while app.sampler.samples < start + count:
        assert time.monotonic() < end, (
            f"the host sampler took no {count} samples in {deadline} s (state {app.sampler.state()})"
        )
        app.sampler.sample_now()
        time.sleep(0.05)  # bounded poll for a thread's counter; the deadline above is the only wait


def test_two_users_under_one_budget_and_a_stray_process_shown_as_unmanaged(tmp_path, unix_users):
    from gpu_quota_ext.hub.service.user_policy import user_policy

    app = service(tmp_path, "warn")
    total = app.devices[0].total
    alice, bob = unix_users
    processes = []
    try:
        # Grants as the API gives them: each user's policy from the hub mapping, placement by the book.
        grants = {}
        for user in (alice, bob):
            policy = user_policy(app.caps, app.host_policy, user, (), app.limits)
            grant, created = app.book.grant(user, "", f"kernel-{user}", "python3", policy, None, time.time())
            assert created and grant.devices, grant
            grants[user] = grant
        granted = sum(g.caps[g.devices[0]] for g in grants.values() if g.devices[0] == 0)
        assert granted <= total, "the host's grants passed the device's budget"
        # Five more kernels of 0.2 each cannot all fit in a budget of 1.0 x the device.
        extra = []
        for number in range(5):
            policy = user_policy(app.caps, app.host_policy, alice, (), app.limits)
            grant, _ = app.book.grant(alice, "", f"more-{number}", "python3", policy, None, time.time())
            extra.append(grant)
        on_gpu = [g for g in extra if g.devices]
        assert len(on_gpu) == 3 and all(not g.devices for g in extra if g not in on_gpu), [g.devices for g in extra]
        record("host service: kernels of 0.2 granted on one H200 before the budget (1.0) was full", 5)
        for grant in extra:
            app.book.release(alice, grant.kernel_id, False)

        kernels = {user: hold(user, 4 * GiB) for user in (alice, bob)}
        stray = hold(bob, 3 * GiB)
        processes = [*kernels.values(), stray]
        for user, launcher in kernels.items():
            app.book.lease(user, "", {f"kernel-{user}": (cuda_pid(launcher),)}, time.time())
        app.sampler.start()
        wait_samples(app, 3)
        status = app.status_now()
        by_kernel = {k["kernel_id"]: k for k in status["kernels"]}
        for user in (alice, bob):
            used = sum(d["used"] or 0 for d in by_kernel[f"kernel-{user}"]["devices"])
            record(f"host service: {user}'s kernel usage (NVML), bytes", used)
            assert 4 * GiB <= used < 6 * GiB, (user, used)
        users = {u["name"]: u for u in status["users"]}
        unmanaged = users[bob]["unmanaged"]
        record("host service: bob's unmanaged usage (a process outside every grant), bytes", unmanaged)
        assert 3 * GiB <= unmanaged < 5 * GiB
        assert users.get(alice, {}).get("unmanaged", 0) == 0
        assert stray.poll() is None, "warn must not kill"
    finally:
        app.sampler.stop()
        for process in processes:
            process.stdin.close()
            process.wait(30)


def test_kill_stops_the_stray_process_and_nothing_else(tmp_path, unix_users):
    from gpu_quota_ext.hub.service.user_policy import user_policy

    app = service(tmp_path, "kill")
    alice, bob = unix_users
    kernel = hold(alice, 2 * GiB)
    stray = hold(bob, 2 * GiB)
    try:
        policy = user_policy(app.caps, app.host_policy, alice, (), app.limits)
        app.book.grant(alice, "", "kernel-a", "python3", policy, None, time.time())
        app.book.lease(alice, "", {"kernel-a": (cuda_pid(kernel),)}, time.time())
        started = time.monotonic()
        app.sampler.start()
        stray.wait(60)
        record("host service kill: seconds until the stray process ended", round(time.monotonic() - started, 2))
        assert stray.returncode is not None
        assert kernel.poll() is None, "the registered kernel's process must live"
        assert any(a.action == "kill" and a.user == bob for a in app.sampler.actions), app.sampler.actions
    finally:
        app.sampler.stop()
        for process in (kernel, stray):
            if process.poll() is None:
                process.stdin.close()
                process.wait(30)
