"""The host watchdog's pure part: each GPU process to a kernel or to its user's unmanaged usage, and
what the policy does about it; and the sampler on a fake NVML, including one that hangs."""

import os
import time

import pytest

from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.hub.service.attribution import (
    GpuProcess,
    Registration,
    attribute,
    decide,
    hub_user_of,
)
from gpu_quota_ext.hub.service.sampler import HostSampler, unix_uid_of
from gpu_quota_ext.shared.sizes import GiB

GRANTED = {"k1": ("alice", ("GPU-a",)), "k2": ("bob", ("GPU-b",))}


def test_unix_users_map_to_hub_users_by_the_spawners_naming():
    assert hub_user_of("alice", "{username}") == "alice"
    assert hub_user_of("jupyter-alice", "jupyter-{username}") == "alice"
    assert hub_user_of("alice", "jupyter-{username}") is None
    assert hub_user_of("jupyter-", "jupyter-{username}") is None
    assert hub_user_of(None, "{username}") is None


def test_kernel_processes_count_as_their_kernels_and_the_rest_as_unmanaged():
    processes = [
        GpuProcess(10, "GPU-a", 3 * GiB, 1001, "alice", "k1"),
        GpuProcess(11, "GPU-a", 1 * GiB, 1001, "alice", "k1"),  # a DataLoader worker of the same kernel
        GpuProcess(12, "GPU-b", 2 * GiB, 1001, "alice", "k1"),  # k1 on a GPU its grant does not hold
        GpuProcess(20, "GPU-b", 5 * GiB, 1002, "jupyter-bob", None),  # a terminal's python train.py
        GpuProcess(30, "GPU-a", 1 * GiB, None, None, None),  # gone before we looked
    ]
    result = attribute(processes, GRANTED, "jupyter-{username}")
    assert result.kernel_used == {"k1": {"GPU-a": 4 * GiB}}
    assert result.unmanaged_by_user() == {"alice": 2 * GiB, "bob": 5 * GiB, "pid:30": 1 * GiB}
    assert "does not hold" in result.unmanaged[0].why


def test_warn_once_then_kill_after_the_grace_and_never_root():
    unmanaged = attribute(
        [GpuProcess(20, "GPU-b", GiB, 1002, "bob", None), GpuProcess(21, "GPU-b", GiB, 0, "root", None)],
        GRANTED,
        "{username}",
    ).unmanaged
    decisions, seen = decide(unmanaged, {}, 100.0, "warn", 10, (0,))
    assert [(d.action, d.item.pid) for d in decisions] == [("warn", 20), ("warn", 21)]
    decisions, seen = decide(unmanaged, seen, 105.0, "warn", 10, (0,))
    assert decisions == []  # said once
    decisions, seen = decide(unmanaged, seen, 105.0, "kill", 10, (0,))
    assert decisions == []  # not seen long enough
    decisions, seen = decide(unmanaged, seen, 110.0, "kill", 10, (0,))
    assert [(d.action, d.item.pid) for d in decisions] == [("kill", 20)]  # root's process is never killed
    _, seen = decide([], seen, 111.0, "kill", 10, (0,))
    assert seen == {}  # gone processes are forgotten


@pytest.fixture
def fake_nvml():
    FakeNvml.reset()
    yield FakeNvml
    FakeNvml.reset()


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_the_sampler_attributes_a_registered_kernels_process_and_shows_the_rest(fake_nvml):
    me = os.getpid()
    fake_nvml.set_usage(me, "GPU-a", 3 * GiB)
    fake_nvml.set_usage(999_999_999, "GPU-a", GiB)  # no such process
    sampler = HostSampler(
        FakeNvml(),
        ["GPU-a"],
        lambda: [Registration("alice", "", "k1", me)],
        lambda: GRANTED,
        0.05,
        5,
        "warn",
        10,
        "{username}",
        uid_of_user=lambda user: os.getuid() if user == "alice" else None,  # alice's processes run as this test
    )
    sampler.start()
    try:
        wait_for(lambda: sampler.last is not None)
        assert sampler.last.attributed.kernel_used == {"k1": {"GPU-a": 3 * GiB}}
        assert [u.pid for u in sampler.last.attributed.unmanaged] == [999_999_999]
        assert sampler.state() == "ok"
        assert sampler.actions and sampler.actions[0].action == "warn"
    finally:
        sampler.stop()


def test_a_hung_nvml_call_makes_the_state_stalled_and_never_blocks_the_caller(fake_nvml):
    release = fake_nvml.hang()
    sampler = HostSampler(FakeNvml(), ["GPU-a"], dict, dict, 0.05, 0.2, "warn", 10, "{username}")
    sampler.start()
    try:
        wait_for(lambda: sampler.state() == "stalled")
    finally:
        release.set()
    wait_for(lambda: sampler.state() == "ok")
    sampler.stop()


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="creates a Unix user: needs root (CI runs as root)"
)
def test_a_real_users_process_outside_every_grant_is_their_unmanaged_usage_and_killed_by_policy(fake_nvml):
    import subprocess

    hub_user = f"b{os.getpid()}"
    unix_name = f"gqt-{hub_user}"  # as TLJH names users: a prefix, then the hub's name
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", unix_name], check=True)
    stray = kernel = None
    sampler = None
    try:
        stray = subprocess.Popen(["sleep", "300"], user=unix_name)  # a terminal's python train.py
        kernel = subprocess.Popen(["sleep", "300"])  # a registered kernel's process
        fake_nvml.set_usage(stray.pid, "GPU-a", 2 * GiB)
        fake_nvml.set_usage(kernel.pid, "GPU-a", GiB)
        sampler = HostSampler(
            FakeNvml(),
            ["GPU-a"],
            lambda: [Registration("alice", "", "k1", kernel.pid)],
            lambda: GRANTED,
            0.05,
            5,
            "kill",
            0.0,
            "gqt-{username}",
            uid_of_user=lambda user: os.getuid() if user == "alice" else unix_uid_of(user, "gqt-{username}"),
        )
        sampler.start()
        import psutil

        # Killed, and not reaped yet (a zombie is still listed until its parent waits for it).
        wait_for(lambda: psutil.Process(stray.pid).status() == psutil.STATUS_ZOMBIE)
        killed_at = sampler.samples
        wait_for(lambda: sampler.samples >= killed_at + 3)  # a few more samples while NVML (the fake) still lists it
        (action,) = [a for a in sampler.actions if a.pid == stray.pid]  # killed once, not once a sample
        assert (action.action, action.user, action.used) == ("kill", hub_user, 2 * GiB)
        assert kernel.poll() is None  # the kernel's process, inside its grant, is untouched
        wait_for(lambda: sampler.last is not None and sampler.last.attributed.kernel_used == {"k1": {"GPU-a": GiB}})
    finally:
        if sampler is not None:
            sampler.stop()
        for proc in (stray, kernel):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait()
        subprocess.run(["userdel", unix_name], check=False)
