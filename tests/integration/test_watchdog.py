"""The watchdog on a real server with real kernels: a kernel whose processes "use" more than its cap
(as the fake NVML reports) is warned, interrupted, restarted or killed as configured, within two polls."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gpu_quota_ext.shared.sizes import GiB

from .fake_gpu import fake_gpu_config, kernel_entry, kernel_pid, manager_of, next_samples, status, wait_for
from .kernels import (
    execute,
    restart_kernel,
    shutdown_kernel,
    start_child_process,
    start_kernel,
    write_kernelspec,
)

# Two poll intervals, plus what a busy 2-core CI machine adds to one round (thread hop, loop scheduling).


@pytest.fixture
def enforce():
    return "warn"


@pytest.fixture
def jp_server_config(enforce):
    return fake_gpu_config(enforce)


async def go_over_cap(jp_serverapp, kernel_id, fake_nvml, pid=None):
    """Make the kernel's process 'use' 6 GiB on its device: over its 4 GiB cap (0.25 of 16) + 1 GiB slack."""
    pid = pid or await kernel_pid(jp_serverapp, kernel_id)
    grant = manager_of(jp_serverapp).ledger.get(kernel_id)
    device = grant.devices[0]
    assert grant.caps[device] == 4 * GiB
    await next_samples(jp_serverapp, 1)  # start from a round boundary
    began = time.time()
    fake_nvml.set_usage(pid, f"static-{device}", 6 * GiB)
    # Acted on promptly, counted in samples, not seconds (grace 0): the sample in flight may have read
    # the old usage, the next one cannot have. (How fast in seconds is benchmarks' business.)
    await next_samples(jp_serverapp, 2)
    watchdog = manager_of(jp_serverapp).watchdog
    if watchdog.settings.enforce != "off":
        assert [a for a in watchdog.history if a.kernel_id == kernel_id]
    return began, device


async def last_action(jp_fetch, kernel_id):
    async def check():
        state = await status(jp_fetch)
        entry = next((k for k in state["kernels"] if k["id"] == kernel_id), None)
        if entry is not None and entry["last_action"]:
            return entry["last_action"]
        actions = [a for a in state["actions"] if a["kernel_id"] == kernel_id]
        return actions[-1] if actions else None

    return await wait_for(check, timeout=10)


def check_record(action, kind, device, began):
    assert action["action"] == kind
    assert (action["device"], action["used"], action["cap"], action["limit"]) == (device, 6 * GiB, 4 * GiB, 5 * GiB)
    assert action["time"] >= began  # this episode's action, not an older one


async def test_warn_records_and_leaves_the_kernel_alone(jp_fetch, jp_serverapp, fake_nvml, caplog):
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "x = 41")
    began, device = await go_over_cap(jp_serverapp, kernel_id, fake_nvml)
    action = await last_action(jp_fetch, kernel_id)
    check_record(action, "warn", device, began)
    assert action["outcome"] == "done"
    assert any("over its cap" in r.getMessage() and kernel_id in r.getMessage() for r in caplog.records)
    await next_samples(jp_serverapp, 3)
    assert len([a for a in (await status(jp_fetch))["actions"] if a["kernel_id"] == kernel_id]) == 1  # once per episode
    assert (await execute(jp_serverapp, kernel_id, "print(x + 1)")).strip() == "42"  # state kept
    # The kernel learns it in the answer to its next usage report.
    reply = await jp_fetch("api", "gpu-quota", "kernels", kernel_id, "usage", method="POST",
                           body=json.dumps({"devices": [{"index": device, "allocated": 1}]}))
    assert json.loads(reply.body)["last_action"]["action"] == "warn"
    await shutdown_kernel(jp_fetch, kernel_id)


@pytest.mark.parametrize("enforce", ["interrupt"])
async def test_interrupt_stops_the_running_cell(jp_fetch, jp_serverapp, fake_nvml, enforce, tmp_path):
    kernel_id = await start_kernel(jp_fetch)
    pid = await kernel_pid(jp_serverapp, kernel_id)
    running = tmp_path / "running"
    code = f"import pathlib, time; pathlib.Path({str(running)!r}).touch(); time.sleep(30)"
    cell = asyncio.ensure_future(execute(jp_serverapp, kernel_id, code, timeout=40))
    await wait_for(running.exists)  # the cell is running
    began, device = await go_over_cap(jp_serverapp, kernel_id, fake_nvml, pid)
    action = await last_action(jp_fetch, kernel_id)
    check_record(action, "interrupt", device, began)
    with pytest.raises(AssertionError, match="KeyboardInterrupt"):
        await asyncio.wait_for(cell, 10)
    await wait_for(lambda: manager_of(jp_serverapp).status.last_action(kernel_id)["outcome"] == "done")
    fake_nvml.clear_usage(pid)
    assert (await execute(jp_serverapp, kernel_id, "print('alive')")).strip() == "alive"
    await shutdown_kernel(jp_fetch, kernel_id)


@pytest.mark.slow
@pytest.mark.parametrize("enforce", ["restart"])
async def test_restart_gives_a_fresh_process_and_keeps_the_grant(jp_fetch, jp_serverapp, fake_nvml, enforce):
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "x = 1")
    pid = await kernel_pid(jp_serverapp, kernel_id)
    grant = manager_of(jp_serverapp).ledger.get(kernel_id)
    began, device = await go_over_cap(jp_serverapp, kernel_id, fake_nvml, pid)
    action = await last_action(jp_fetch, kernel_id)
    check_record(action, "restart", device, began)
    await wait_for(lambda: manager_of(jp_serverapp).status.last_action(kernel_id)["outcome"] == "done")
    fake_nvml.clear_usage(pid)
    new_pid = await kernel_pid(jp_serverapp, kernel_id)
    assert new_pid != pid
    assert (await execute(jp_serverapp, kernel_id, "print('x' in globals())")).strip() == "False"
    assert manager_of(jp_serverapp).ledger.get(kernel_id) == grant
    await shutdown_kernel(jp_fetch, kernel_id)


@pytest.mark.parametrize("enforce", ["kill"])
async def test_kill_shuts_the_kernel_down_and_frees_its_grant(jp_fetch, jp_serverapp, fake_nvml, enforce):
    kernel_id = await start_kernel(jp_fetch)
    bystander = await start_kernel(jp_fetch)
    began, device = await go_over_cap(jp_serverapp, kernel_id, fake_nvml)
    actions = await wait_for(lambda: [a for a in manager_of(jp_serverapp).watchdog.history if a.kernel_id == kernel_id])
    check_record(actions[0].to_json(), "kill", device, began)
    await wait_for(lambda: kernel_id not in jp_serverapp.kernel_manager.list_kernel_ids())
    await wait_for(lambda: manager_of(jp_serverapp).ledger.get(kernel_id) is None)
    state = await status(jp_fetch)
    assert [a["outcome"] for a in state["actions"] if a["kernel_id"] == kernel_id] == ["done"]
    assert all(k["id"] != kernel_id for k in state["kernels"])
    kernels = json.loads((await jp_fetch("api", "kernels")).body)
    assert [k["id"] for k in kernels] == [bystander]  # only the kernel over its cap
    await shutdown_kernel(jp_fetch, bystander)


@pytest.mark.parametrize("enforce", ["kill"])
async def test_a_subprocess_over_the_cap_gets_its_kernel_acted_on(jp_fetch, jp_serverapp, fake_nvml, enforce):
    kernel_id = await start_kernel(jp_fetch)
    child = await start_child_process(jp_serverapp, kernel_id)
    began, device = await go_over_cap(jp_serverapp, kernel_id, fake_nvml, child)
    actions = await wait_for(lambda: [a for a in manager_of(jp_serverapp).watchdog.history if a.kernel_id == kernel_id])
    check_record(actions[0].to_json(), "kill", device, began)
    await wait_for(lambda: kernel_id not in jp_serverapp.kernel_manager.list_kernel_ids())


@pytest.mark.parametrize("enforce", ["off"])
async def test_off_measures_but_never_acts(jp_fetch, jp_serverapp, fake_nvml, enforce):
    kernel_id = await start_kernel(jp_fetch)
    _, device = await go_over_cap(jp_serverapp, kernel_id, fake_nvml)
    await next_samples(jp_serverapp, 3)
    state = await status(jp_fetch)
    assert kernel_entry(state, kernel_id)["devices"][0]["used"] == 6 * GiB
    assert state["actions"] == [] and kernel_entry(state, kernel_id)["last_action"] is None
    await shutdown_kernel(jp_fetch, kernel_id)


class TestDeadKernel:
    @pytest.fixture
    def jp_server_config(self):
        config = fake_gpu_config("warn")
        config.KernelRestarter.restart_limit = 0  # the first death is final
        config.KernelRestarter.time_to_dead = 0.5
        return config

    async def test_a_kernel_that_dies_for_good_gives_its_grant_back(
        self, jp_fetch, jp_serverapp, jp_kernel_dir, fake_nvml
    ):
        # jupyter_server drops a dead kernel without the provisioner's cleanup; the monitor must notice.
        name = write_kernelspec(
            jp_kernel_dir,
            "short-lived",
            {
                "argv": [sys.executable, "-c", "import time; time.sleep(1)", "{connection_file}"],
                "display_name": "dies after a second",
                "language": "python",
            },
        )
        kernel_id = await start_kernel(jp_fetch, name)
        manager = manager_of(jp_serverapp)
        assert manager.ledger.get(kernel_id) is not None
        await wait_for(lambda: kernel_id not in jp_serverapp.kernel_manager, timeout=20)
        # The restarter's "dead" callback gives the grant back as jupyter_server drops the kernel, in the
        # same callback run (the ledger's call in a thread): no need to wait for the lifecycle's next poll.
        await manager.settled()
        assert manager.ledger.get(kernel_id) is None
        assert all(d["granted"] == 0 for d in manager.ledger.device_grants())


# --- whose usage the watchdog may act on ----------------------------------------------------------


# Run in kernel A: a daemon (a double fork by `setsid -f`, re-parented away from the kernel) whose
# environment names kernel V; prints the daemon's PID.
DAEMON_CODE = (
    "import os, subprocess\n"
    "env = dict(os.environ, GPU_QUOTA_KERNEL_ID={victim!r})\n"
    "starter = subprocess.Popen(['setsid', '-f', 'sh', '-c', 'echo $$; exec sleep 60'], env=env, "
    "stdout=subprocess.PIPE)\n"
    "print(int(starter.stdout.readline()))\n"
    "starter.wait()\n"
)


def ancestors(pid):
    """PIDs from `pid`'s parent up to init, read from the live process table."""
    from gpu_quota_ext.usage import ProcTable

    table, chain = ProcTable(), []
    current = table.parent_of(pid)
    while current and current > 1 and current not in chain:
        chain.append(current)
        current = table.parent_of(current)
    return chain


async def victim_is_untouched(jp_fetch, jp_serverapp, victim, grant):
    manager = manager_of(jp_serverapp)
    assert victim in jp_serverapp.kernel_manager.list_kernel_ids()
    assert manager.ledger.get(victim) == grant
    assert (await execute(jp_serverapp, victim, "print('alive')")).strip() == "alive"
    strong = [a for a in manager.watchdog.history if a.kernel_id == victim and a.action != "warn"]
    assert strong == []


@pytest.mark.parametrize("enforce", ["kill"])
async def test_a_daemon_naming_another_kernel_never_gets_it_killed(jp_fetch, jp_serverapp, fake_nvml, enforce):
    """A double-forked daemon of kernel A whose environment names kernel V: its usage is shown for V
    (same Unix user: a process the server may trust to say whose it is), but only a warning may follow."""
    attacker = await start_kernel(jp_fetch)
    victim = await start_kernel(jp_fetch)
    manager = manager_of(jp_serverapp)
    grant = manager.ledger.get(victim)
    device = grant.devices[0]
    daemon = int((await execute(jp_serverapp, attacker, DAEMON_CODE.format(victim=victim))).strip())
    try:
        roots = manager.kernels.roots()
        assert not set(ancestors(daemon)) & set(roots), "the daemon must be outside every kernel's tree"
        fake_nvml.set_usage(daemon, f"static-{device}", 6 * GiB)  # over V's 4 GiB cap + 1 GiB slack
        await next_samples(jp_serverapp, 5)
        # Seen, and counted for V by its environment ...
        assert manager.monitor.latest.kernels.get(victim, {}).get(device) == 6 * GiB
        warned = [a for a in manager.watchdog.history if a.kernel_id == victim]
        assert [(a.action, a.attributed) for a in warned] == [("warn", "environment")]
        # ... yet V is alive, its grant intact, and nothing stronger than a warning was done.
        await victim_is_untouched(jp_fetch, jp_serverapp, victim, grant)
    finally:
        os.kill(daemon, signal.SIGKILL)
    await shutdown_kernel(jp_fetch, attacker)
    await shutdown_kernel(jp_fetch, victim)


def other_unix_user() -> str:
    """A user that is not the server's: 'nobody' where it exists, else one made with useradd."""
    import pwd

    for name in ("nobody", "gpu-quota-test"):
        try:
            if pwd.getpwnam(name).pw_uid != os.getuid():
                return name
        except KeyError:
            pass
    subprocess.run(["useradd", "--system", "--no-create-home", "gpu-quota-test"], check=True)
    return "gpu-quota-test"


@pytest.mark.skipif(
    not hasattr(os, "getuid") or os.getuid() != 0, reason="starting a process as another Unix user needs root"
)
@pytest.mark.parametrize("enforce", ["kill"])
async def test_a_process_of_another_user_is_never_attributed_by_its_environment(
    jp_fetch, jp_serverapp, fake_nvml, enforce
):
    victim = await start_kernel(jp_fetch)
    manager = manager_of(jp_serverapp)
    grant = manager.ledger.get(victim)
    device = grant.devices[0]
    user = other_unix_user()
    stranger = subprocess.Popen(
        ["sleep", "60"], user=user, env={"PATH": os.environ["PATH"], "GPU_QUOTA_KERNEL_ID": victim}
    )
    try:
        await wait_for(lambda: open(f"/proc/{stranger.pid}/environ", "rb").read().find(victim.encode()) >= 0)
        fake_nvml.set_usage(stranger.pid, f"static-{device}", 6 * GiB)
        await next_samples(jp_serverapp, 5)
        assert manager.monitor.latest.kernels.get(victim, {}).get(device, 0) == 0  # not V's usage at all
        assert kernel_entry(await status(jp_fetch), victim)["devices"][0]["used"] == 0
        assert [a for a in manager.watchdog.history if a.kernel_id == victim] == []
        await victim_is_untouched(jp_fetch, jp_serverapp, victim, grant)
    finally:
        stranger.kill()
        stranger.wait()
    await shutdown_kernel(jp_fetch, victim)


# --- kernels that die with no restarter --------------------------------------------------------


class TestNoAutorestart:
    @pytest.fixture
    def jp_server_config(self):
        config = fake_gpu_config("warn")
        config.KernelManager.autorestart = False
        return config

    async def test_a_kernel_killed_without_a_restarter_gives_its_grant_back_within_a_poll(
        self, jp_fetch, jp_serverapp, fake_nvml
    ):
        kernel_id = await start_kernel(jp_fetch)
        manager = manager_of(jp_serverapp)
        pid = await kernel_pid(jp_serverapp, kernel_id)
        assert manager.ledger.get(kernel_id) is not None
        monitor = manager.monitor
        os.kill(pid, signal.SIGKILL)
        rounds = monitor.ticks
        await wait_for(lambda: manager.ledger.get(kernel_id) is None, timeout=10)
        # The next round after the death notices it (the one running at the kill may have missed it).
        assert monitor.ticks <= rounds + 2
        assert all(d["granted"] == 0 for d in manager.ledger.device_grants())
        # jupyter_server keeps listing a dead kernel when autorestart is off (the user may restart it);
        # a restart asks the ledger again, like a new kernel.
        assert kernel_id in jp_serverapp.kernel_manager.list_kernel_ids()
        await restart_kernel(jp_fetch, kernel_id)
        assert manager.ledger.get(kernel_id) is not None
        assert (await execute(jp_serverapp, kernel_id, "print('back')")).strip() == "back"
        await shutdown_kernel(jp_fetch, kernel_id)
        assert manager.ledger.get(kernel_id) is None

    async def test_a_live_kernel_keeps_its_grant(self, jp_fetch, jp_serverapp, fake_nvml):
        kernel_id = await start_kernel(jp_fetch)
        grant = manager_of(jp_serverapp).ledger.get(kernel_id)
        await next_samples(jp_serverapp, 3)
        assert manager_of(jp_serverapp).ledger.get(kernel_id) == grant
        await restart_kernel(jp_fetch, kernel_id)  # a restart in progress is not a death
        await next_samples(jp_serverapp, 3)
        assert manager_of(jp_serverapp).ledger.get(kernel_id) == grant
        await shutdown_kernel(jp_fetch, kernel_id)
