"""Issue 28 on a real GPU: overcommit that never loses a kernel, with the unlucky timings users meet.

    python -m pytest tests/gpu/test_overcommit_gpu.py -m gpu -s

- Timers that fire together: A (0.4 of the device) is parked by its idle timer; B and C make 0.4 each in the
  same second, so their idle timers fire together. Parked, A, B and C would be 3 x 56 GiB on a 128 GiB host:
  the host account lets one of B and C park and refuses the other before its driver call. Every kernel keeps its
  process (same PID) and its tensor (checksums), and `dmesg` shows no OOM kill.
- Four kernels whose timers fire together, 0.22 of the device each: three parks fit the host, the fourth is
  refused; all four tensors come back.
- A full device under a kernel's cap: A, B and C hold 0.27 each and are idle; D, capped at 0.3, makes 0.27. The
  broker parks an idle kernel before D's allocation runs: no out-of-memory error, and the seconds D waited are
  saved.
Host memory is part of each scenario (the lent machine has 128 GiB): `FIGURE` lines say its lowest point.
"""

import asyncio
import json
import subprocess
import time

import pytest
from traitlets.config import Config

from ..integration.kernels import run_cell, shutdown_kernel, start_kernel
from .conftest import kernel_pid, record
from .test_broker_gpu import device_total, hold, host_available, park_state, timed_cell
from .test_park_gpu import CHECK, last_line

pytestmark = pytest.mark.gpu

GiB = 1 << 30
POLL = 0.5
SETTLE = 300.0  # seconds: a deadline for parks of up to 56 GiB to start and end, never a threshold


def overcommit_config(cap: float, **more) -> Config:
    settings = {
        "default_cap": str(cap),
        "max_cap": str(cap),
        "overcommit": 3.0,
        "placement": "pack",
        "poll_interval": POLL,
        "park_min_idle": "5s",
        "park_wait_limit": "4min",
        # The checkpoint path, as these scenes were measured (2026-12-04): the fast path's host memory is its
        # arenas, tested beside them (test_broker_gpu.TestThreeKernelsOfFourTenthsFastPark, benchmarks/device_day.py).
        "fast_park": "off",
    }
    settings.update(more)
    return Config({"ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}}, "GpuQuota": settings})


def oom_kills() -> int:
    """The kernel log's OOM kills so far (root on the device machine); -1 where dmesg cannot be read."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except Exception:
        return -1
    return sum(1 for line in out.splitlines() if "Out of memory: Killed process" in line or "oom-kill:" in line)


class LowestHost:
    """The host's lowest available memory while the scenario runs (sampled every 0.2 s in the loop)."""

    def __init__(self):
        self.lowest = host_available()
        self._task = None

    async def _watch(self):
        while True:
            self.lowest = min(self.lowest, host_available())
            await asyncio.sleep(0.2)

    def __enter__(self):
        self._task = asyncio.get_running_loop().create_task(self._watch())
        return self

    def __exit__(self, *exc):
        self._task.cancel()


async def states_when(jp_fetch, kernels, done, what, timeout=SETTLE) -> dict:
    """Poll the kernels' park objects until `done(states)`; a deadline, never a threshold."""
    deadline = time.monotonic() + timeout
    while True:
        states = {name: await park_state(jp_fetch, k) for name, k in kernels.items()}
        if done(states):
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout} s: {states}")
        await asyncio.sleep(0.2)


def decided(states) -> bool:
    """Every kernel parked, or refused its park (the reason says so), and none on its way."""
    return all(
        p["state"] == "parked" or (p["state"] in ("idle", "busy") and (p["reason"] or "").startswith("did not park"))
        for p in states.values()
    )


async def parked_by_timer(jp_fetch, kernel_id, timeout=SETTLE) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        park = await park_state(jp_fetch, kernel_id)
        if park["state"] == "parked":
            return park
        if time.monotonic() > deadline:
            raise AssertionError(f"not parked by its timer within {timeout} s: {park}")
        await asyncio.sleep(0.2)


async def all_back(serverapp, jp_fetch, kernels, sums, pids, label):
    """Every kernel's next cell finds its tensor, in the same process, and none is lost."""
    for name, kernel_id in kernels.items():
        seconds, ran = await timed_cell(serverapp, kernel_id, CHECK)
        record(f"{label}: {name}'s checking cell, s", round(seconds, 1))
        assert ran["status"] == "ok" and last_line(ran["stdout"]) == sums[name], (name, ran)
        assert kernel_pid(serverapp, kernel_id) == pids[name], f"{name}'s kernel was restarted"
    for name, kernel_id in kernels.items():
        assert (await park_state(jp_fetch, kernel_id))["state"] != "lost", name


class TestTimersThatFireTogether:
    @pytest.fixture
    def jp_server_config(self):
        return overcommit_config(0.45, overcommit=2.0, park_idle_after="6s")

    async def test_the_host_account_refuses_the_park_that_would_overrun_it(self, jp_fetch, jp_serverapp):
        size = int(0.4 * device_total())
        kills = oom_kills()
        kernels = {name: await start_kernel(jp_fetch) for name in "ABC"}
        pids = {name: kernel_pid(jp_serverapp, k) for name, k in kernels.items()}
        sums = {}
        record("timers 3x0.4: host available at start, GiB", round(host_available() / GiB, 1))
        try:
            with LowestHost() as host:
                sums["A"] = await hold(jp_serverapp, kernels["A"], size)
                await parked_by_timer(jp_fetch, kernels["A"])
                # B and C finish in the same second: their idle timers fire together.
                sums["B"], sums["C"] = await asyncio.gather(
                    hold(jp_serverapp, kernels["B"], size), hold(jp_serverapp, kernels["C"], size)
                )
                states = await states_when(jp_fetch, {n: kernels[n] for n in "BC"}, decided, "parked or refused")
                record("timers 3x0.4: B and C after their timers", {n: (p["state"], p["reason"]) for n, p in
                                                                   states.items()})
                parked = [n for n, p in states.items() if p["state"] == "parked"]
                assert len(parked) == 1, states  # two more parks would not fit the host
                kept = next(n for n in "BC" if n not in parked)
                assert "host" in (states[kept]["reason"] or ""), states[kept]
                await all_back(jp_serverapp, jp_fetch, kernels, sums, pids, "timers 3x0.4")
            record("timers 3x0.4: host available, lowest, GiB", round(host.lowest / GiB, 1))
        finally:
            for kernel_id in kernels.values():
                await shutdown_kernel(jp_fetch, kernel_id)
        after = oom_kills()
        record("timers 3x0.4: OOM kills in dmesg during the test", None if kills < 0 else after - kills)
        assert kills < 0 or after == kills


class TestFourTimersTogether:
    @pytest.fixture
    def jp_server_config(self):
        return overcommit_config(0.3, park_idle_after="6s")

    async def test_three_parks_fit_the_host_and_the_fourth_is_refused(self, jp_fetch, jp_serverapp):
        size = int(0.22 * device_total())
        kills = oom_kills()
        kernels = {name: await start_kernel(jp_fetch) for name in "ABCD"}
        pids = {name: kernel_pid(jp_serverapp, k) for name, k in kernels.items()}
        try:
            with LowestHost() as host:
                made = await asyncio.gather(*(hold(jp_serverapp, k, size) for k in kernels.values()))
                sums = dict(zip(kernels, made))
                states = await states_when(jp_fetch, kernels, decided, "parked or refused")
                record("timers 4x0.22: states", {n: (p["state"], p["reason"]) for n, p in states.items()})
                record("timers 4x0.22: host available with the parks done, GiB", round(host_available() / GiB, 1))
                parked = sum(p["state"] == "parked" for p in states.values())
                record("timers 4x0.22: parked", parked)
                assert parked < len(kernels), states  # the host cannot take all four
                await all_back(jp_serverapp, jp_fetch, kernels, sums, pids, "timers 4x0.22")
            record("timers 4x0.22: host available, lowest, GiB", round(host.lowest / GiB, 1))
        finally:
            for kernel_id in kernels.values():
                await shutdown_kernel(jp_fetch, kernel_id)
        after = oom_kills()
        record("timers 4x0.22: OOM kills in dmesg during the test", None if kills < 0 else after - kills)
        assert kills < 0 or after == kills


class TestFullDeviceUnderTheCap:
    @pytest.fixture
    def jp_server_config(self):
        return overcommit_config(0.3, overcommit=2.0)

    async def test_room_is_made_before_the_allocation_runs(self, jp_fetch, jp_serverapp):
        total = device_total()
        size = int(0.27 * total)
        kernels = {name: await start_kernel(jp_fetch) for name in "ABCD"}
        try:
            sums = {}
            for name in "ABC":
                sums[name] = await hold(jp_serverapp, kernels[name], size)
            await states_when(
                jp_fetch,
                {n: kernels[n] for n in "ABC"},
                lambda states: all((p["idle_seconds"] or 0) >= 5 for p in states.values()),
                "idle for park_min_idle",
            )
            code = (
                "import time, torch\nt0 = time.time()\n"
                f"y = torch.empty({size}, dtype=torch.uint8, device='cuda')\ny.fill_(7)\ntorch.cuda.synchronize()\n"
                "print('waited', round(time.time() - t0, 1))"
            )
            seconds, ran = await timed_cell(jp_serverapp, kernels["D"], code, timeout=300)
            record("full device under the cap: D's cell, s", round(seconds, 1))
            record("full device under the cap: D's cell said", (ran["stdout"] + ran["stderr"]).strip().splitlines())
            assert ran["status"] == "ok", ran
            assert "OutOfMemoryError" not in ran["error"]
            states = {n: (await park_state(jp_fetch, k))["state"] for n, k in kernels.items()}
            record("full device under the cap: states after D's cell", states)
            assert "parked" in states.values(), states
            for name in "ABC":
                ran = await run_cell(jp_serverapp, kernels[name], CHECK, timeout=300)
                assert ran["status"] == "ok" and last_line(ran["stdout"]) == sums[name], (name, ran)
        finally:
            for kernel_id in kernels.values():
                await shutdown_kernel(jp_fetch, kernel_id)


TAKER = r"""
import sys
# A fixed amount, decided by the test from one reading: a program that kept taking whatever became available would
# also take the memory that kernels coming back give up, and the episode's end would depend on the two races' timing.
amount = int(sys.argv[1])
chunk = 256 << 20
held = []
for _ in range(max(0, amount // chunk)):
    block = bytearray(chunk)
    block[::4096] = b"\x01" * len(block[::4096])  # touched: resident, as a real program's data
    held.append(block)
print("held", len(held) * chunk, flush=True)
sys.stdin.read()
"""


MOVING = ("parking", "resuming")


async def host_episode_over(jp_fetch, kernels, timeout) -> dict:
    """Poll the status until the host's short episode has begun and ended (the whole margin free again) and no
    kernel is still moving: a restore gives its host memory back as it copies, so the episode can end while the
    restores it started are under way (measured: both kernels still resuming when it ended). A deadline under the
    test's own limit, so a failure says where things stood."""
    deadline = time.monotonic() + timeout
    while True:
        answer = json.loads((await jp_fetch("api", "gpu-quota", "status", method="GET")).body)
        memory = answer["host_memory"]
        states = {n: (await park_state(jp_fetch, k))["state"] for n, k in kernels.items()}
        if memory["short_episodes"] >= 1 and not memory["short"] and not set(states.values()) & set(MOVING):
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"the host's short episode did not begin, end and settle in {timeout} s: {memory} "
                                 f"{states}")
        await asyncio.sleep(0.2)


class TestHostTakenOutside:
    @pytest.fixture
    def jp_server_config(self):
        return overcommit_config(0.3, overcommit=2.0, park_idle_after="6s", park_host_margin="4GiB")

    async def test_parked_kernels_come_back_when_another_program_takes_the_hosts_memory(self, jp_fetch, jp_serverapp):
        size = int(0.25 * device_total())
        kills = oom_kills()
        kernels = {name: await start_kernel(jp_fetch) for name in "AB"}
        pids = {name: kernel_pid(jp_serverapp, k) for name, k in kernels.items()}
        taker = None
        try:
            with LowestHost() as host:
                sums = {name: await hold(jp_serverapp, k, size) for name, k in kernels.items()}
                for kernel_id in kernels.values():
                    await parked_by_timer(jp_fetch, kernel_id)
                parked_gib = round(host_available() / GiB, 1)
                record("host taken outside: host available with A and B parked, GiB", parked_gib)
                # Another program takes the host's memory down to 1.5 GiB available (half the margin is 2 GiB).
                taken = host_available() - int(1.5 * GiB)
                taker = subprocess.Popen(
                    ["python3", "-c", TAKER, str(taken)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                )
                began = time.monotonic()
                answer = await host_episode_over(jp_fetch, kernels, timeout=200)
                seconds = round(time.monotonic() - began, 1)
                record("host taken outside: episode over and restores done, s after the taker started", seconds)
                states = {n: (await park_state(jp_fetch, k))["state"] for n, k in kernels.items()}
                record("host taken outside: states", states)
                record("host taken outside: host_memory", answer["host_memory"])
                # Brought back in the background, largest first, until the margin was free: the episode ends with
                # the host's memory given back by kernels on the device, not by one the OOM killer ended.
                assert any(state in ("idle", "busy") for state in states.values()), states
                assert "lost" not in states.values(), states
                await all_back(jp_serverapp, jp_fetch, kernels, sums, pids, "host taken outside")
            record("host taken outside: host available, lowest, GiB", round(host.lowest / GiB, 1))
        finally:
            if taker is not None:
                taker.kill()
                taker.wait()
            for kernel_id in kernels.values():
                await shutdown_kernel(jp_fetch, kernel_id)
        after = oom_kills()
        record("host taken outside: OOM kills in dmesg during the test", None if kills < 0 else after - kills)
        assert kills < 0 or after == kills
