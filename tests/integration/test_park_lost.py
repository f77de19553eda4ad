"""A kernel lost while parked is told (issue 28), on a real server with real kernels, the driver faked: a parked
kernel's process is killed (SIGKILL, as the host's out-of-memory killer does), jupyter_server's restarter starts it
again under the same id, and its next cell says once, on stderr, that its variables and GPU memory are gone and
why; the status says so until that cell has said it; the cell's stdout is the user's own output only. A restart
the user asked for says nothing of the kind."""

import os
import signal

import pytest

from gpu_quota_ext.shared.sizes import GiB

from .fake_gpu import fake_gpu_config, manager_of, wait_for
from .kernels import execute, restart_kernel, run_cell, start_kernel
from .test_park import FAKE_DRIVER, WAIT, holding_gpu, park_state, post, wait_state

SAID = "gpu-quota: this kernel was restarted at "


@pytest.fixture
def jp_server_config():
    config = fake_gpu_config("warn", checkpoint_class=FAKE_DRIVER)
    config.KernelRestarter.time_to_dead = 0.5  # the restarter's poll: it finds the dead process within a second
    return config


async def parked(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "x = 41")
    pid = await holding_gpu(jp_serverapp, kernel_id, 2 * GiB)
    await post(jp_fetch, kernel_id, "park")
    await wait_state(jp_fetch, kernel_id, "parked")
    return kernel_id, pid


def new_process(serverapp, kernel_id, old_pid) -> bool:
    """The kernel runs a process other than `old_pid`, started (none while the restart is under way)."""
    manager = serverapp.kernel_manager.get_kernel(kernel_id)
    process = getattr(manager.provisioner, "process", None)
    return process is not None and process.pid != old_pid and manager.ready.done()


async def test_a_parked_kernel_killed_is_restarted_and_its_next_cell_says_so_once(jp_fetch, jp_serverapp, fake_driver):
    kernel_id, pid = await parked(jp_fetch, jp_serverapp)
    os.kill(pid, signal.SIGKILL)  # what the host's out-of-memory killer does to the largest process

    async def lost():
        park = await park_state(jp_fetch, kernel_id)
        return park["lost"]

    notice = await wait_for(lost, "the status says the kernel was lost", timeout=WAIT)
    assert notice["why"] == (
        "its process ended while parked (killed by SIGKILL: the host's out-of-memory killer, or a kill -9?)"
    ), notice
    assert notice["words"].startswith(SAID) and notice["words"].endswith(
        "its variables and GPU memory are gone. Run the notebook's cells again."
    ), notice
    restarted = lambda: new_process(jp_serverapp, kernel_id, pid)  # noqa: E731
    await wait_for(restarted, "the restarter started a new process", timeout=WAIT)
    park = await park_state(jp_fetch, kernel_id)
    assert park["state"] in ("idle", "busy", "starting") and park["host_bytes"] is None, park

    parker = manager_of(jp_serverapp).parker
    # The new process holds the words (from its launch environment) and says it has not said them: the server
    # asks again only once the kernel has been active.
    await wait_for(lambda: kernel_id in parker._lost_held, "the restarted kernel holds the notice", timeout=WAIT)
    ran = await run_cell(jp_serverapp, kernel_id, "print('mine'); print(globals().get('x'))")
    assert ran["status"] == "ok", ran
    assert ran["stdout"] == "mine\nNone\n", ran  # the user's output only: the notice is not in it
    assert ran["stderr"] == notice["words"] + "\n", ran  # once, on stderr, before the cell's code

    async def said():
        return (await park_state(jp_fetch, kernel_id))["lost"] is None

    await wait_for(said, "the status drops the notice once the cell has said it", timeout=WAIT)
    again = await run_cell(jp_serverapp, kernel_id, "print('again')")
    assert again["stdout"] == "again\n" and again["stderr"] == "", again  # said once, never again
    assert kernel_id not in parker.lost


async def test_a_restart_the_user_asked_for_says_nothing_of_a_loss(jp_fetch, jp_serverapp, fake_driver):
    kernel_id, pid = await parked(jp_fetch, jp_serverapp)
    await restart_kernel(jp_fetch, kernel_id)
    ran = await run_cell(jp_serverapp, kernel_id, "print('fresh')")
    assert ran["stdout"] == "fresh\n" and ran["stderr"] == "", ran
    assert (await park_state(jp_fetch, kernel_id))["lost"] is None


async def test_the_first_cell_says_it_even_before_the_server_could_ask_the_restarted_kernel(
    jp_fetch, jp_serverapp, fake_driver
):
    # The words travel in the new process's environment: its very first cell says them, however soon it runs
    # after the restart (here the server never reaches it on its control channel at all).
    kernel_id, pid = await parked(jp_fetch, jp_serverapp)
    parker = manager_of(jp_serverapp).parker
    parker.channel = None
    os.kill(pid, signal.SIGKILL)
    await wait_for(lambda: new_process(jp_serverapp, kernel_id, pid), "a new process", timeout=WAIT)
    ran = await run_cell(jp_serverapp, kernel_id, "print('first')")
    assert ran["stdout"] == "first\n" and ran["stderr"].startswith(SAID), ran
    assert ran["stderr"].count(SAID) == 1, ran
