"""Issue 21 on a real GPU: the broker makes overcommit safe on an H200, with the real NVML and the real checkpoint
driver, in the scenarios that lost a kernel before it existed.

    python -m pytest tests/gpu/test_broker_gpu.py -m gpu -s

- Three kernels of 0.4 of the device each, caps 0.45, overcommit 2.0: A parks; B and C fill the device; A's
  next cell makes the broker park B (idle longest) and then restores A; B's next cell parks C and restores B.
  Every cell finds its tensor (checksums), no restore ever fails, and the seconds each cell waited are saved.
  Host memory is part of it: two of these kernels on the host at once is what the 128 GiB machine can hold.
- Two kernels of 0.55: B cannot park (the host cannot take it besides A), so A's cell waits until the wait
  limit and ends with the reason; A stays parked, its tensor intact, and resumes once B is gone.
- Move only what must move: a kernel that freed most of its tensors (torch keeps them cached) parks its live
  bytes only, against the raw driver calls on the same state without the cache emptied.
- Two GPUs (nvidia-h200-x2 only): a resume that needs room on the second GPU parks idle kernels there, not on
  the first.
Prints `FIGURE` lines (conftest.record).
"""

import asyncio
import time

import psutil
import pytest
from traitlets.config import Config

from gpu_quota_ext.parking.checkpoint import CudaCheckpointDriver

from ..integration.fake_gpu import status
from ..integration.kernels import execute, run_cell, shutdown_kernel, start_kernel
from .conftest import gpu_count, kernel_pid, nvml_used_by_pid, record
from .test_park_gpu import CHECK, HOLD, last_line, park

pytestmark = pytest.mark.gpu

GiB = 1 << 30
POLL = 0.5


def device_total() -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)


def host_available() -> int:
    return int(psutil.virtual_memory().available)


def resident_of(pid: int) -> int:
    """The process's resident memory: a pinned arena is host memory the kernel touched, so it counts here."""
    return int(psutil.Process(pid).memory_info().rss)


def broker_config(cap: float, limit: str) -> Config:
    return Config(
        {
            "ServerApp": {"jpserver_extensions": {"gpu_quota_ext": True}},
            "GpuQuota": {
                "default_cap": str(cap),
                "max_cap": str(cap),
                "overcommit": 2.0,
                "placement": "pack",
                "poll_interval": POLL,
                "park_min_idle": "2s",
                "park_wait_limit": limit,
                "fast_park": "off",  # the checkpoint path; the fast path's scene sets "on" below
            },
        }
    )


async def hold(serverapp, kernel_id, nbytes) -> str:
    """The kernel makes a tensor of nbytes random bytes; its checksum."""
    return last_line(await execute(serverapp, kernel_id, HOLD.format(n=nbytes), timeout=300))


async def park_state(jp_fetch, kernel_id) -> dict:
    return next(k for k in (await status(jp_fetch))["kernels"] if k["id"] == kernel_id)["park"]


async def timed_cell(serverapp, kernel_id, code, timeout=600) -> tuple:
    began = time.perf_counter()
    ran = await run_cell(serverapp, kernel_id, code, timeout=timeout)
    return time.perf_counter() - began, ran


class TestThreeKernelsOfFourTenths:
    @pytest.fixture
    def jp_server_config(self):
        return broker_config(0.45, "4min")

    async def test_each_parked_kernels_cell_gets_room_made_and_finds_its_tensor(self, jp_fetch, jp_serverapp):
        total = device_total()
        size = int(0.4 * total)
        record("broker 3x0.4: device total, bytes", total)
        record("broker 3x0.4: host available at start, GiB", round(host_available() / GiB, 1))
        kernels = {name: await start_kernel(jp_fetch) for name in "ABC"}
        pids = {name: kernel_pid(jp_serverapp, k) for name, k in kernels.items()}
        sums = {}
        try:
            sums["A"] = await hold(jp_serverapp, kernels["A"], size)
            seconds, parked = await park(jp_fetch, kernels["A"])
            record("broker 3x0.4: park A (0.4 of the device), s", round(seconds, 1))
            record("broker 3x0.4: A's bytes moved to the host, GiB", round(parked["host_bytes"] / GiB, 2))
            for name in "BC":
                sums[name] = await hold(jp_serverapp, kernels[name], size)
            record("broker 3x0.4: device used with A parked, B and C holding, GiB",
                   round(sum(nvml_used_by_pid().values()) / GiB, 1))
            record("broker 3x0.4: host available with A parked, GiB", round(host_available() / GiB, 1))
            # B has been idle since before C's tensor was made: the broker's first choice.

            seconds, ran = await timed_cell(jp_serverapp, kernels["A"], CHECK)
            record("broker 3x0.4: A's cell, seconds (B parked for it, then A restored)", round(seconds, 1))
            record("broker 3x0.4: A's cell said", ran["stdout"].strip().splitlines()[:3])
            assert ran["status"] == "ok" and last_line(ran["stdout"]) == sums["A"], ran
            b_park = await park_state(jp_fetch, kernels["B"])
            assert b_park["state"] == "parked", b_park
            record("broker 3x0.4: host available with B parked, A back, GiB", round(host_available() / GiB, 1))

            seconds, ran = await timed_cell(jp_serverapp, kernels["B"], CHECK)
            record("broker 3x0.4: B's cell, seconds (C parked for it, then B restored)", round(seconds, 1))
            assert ran["status"] == "ok" and last_line(ran["stdout"]) == sums["B"], ran
            assert (await park_state(jp_fetch, kernels["C"]))["state"] == "parked"
            seconds, ran = await timed_cell(jp_serverapp, kernels["A"], CHECK)
            assert ran["status"] == "ok" and last_line(ran["stdout"]) == sums["A"], ran  # A was never touched
            record("broker 3x0.4: A's cell while running, seconds", round(seconds, 2))
            for name in "ABC":
                assert (await park_state(jp_fetch, kernels[name]))["state"] != "lost"
        finally:
            for kernel_id in kernels.values():
                await shutdown_kernel(jp_fetch, kernel_id)
        for pid in pids.values():
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


class TestThreeKernelsOfFourTenthsFastPark:
    """The same scene with fast_park on (issue 29): the cells' waits beside the checkpoint path's (A's cell 40.8
    to 43.0 s, B's 36.3 to 41.9 s on 2026-12-02). A swap runs both copies at once: the resume starts while the park
    that makes its room copies, and says how long it waited for that room (`resume_waited_seconds`). Which kernel
    parks for B's cell is the broker's choice here: A kept its pinned arena when it came back (its next park takes
    no more host memory), C would need a new arena the host cannot give beside the two there (B's and A's). Every
    cell finds its tensor, in the same process. Then C is parked by hand: the host cannot take its new arena until
    A, running, gives back the one it kept."""

    @pytest.fixture
    def jp_server_config(self, fast_park_library):
        config = broker_config(0.45, "4min")
        config.GpuQuota.fast_park = "on"
        return config

    async def test_every_cell_gets_room_in_seconds_and_finds_its_tensor(self, jp_fetch, jp_serverapp):
        size = int(0.4 * device_total())
        kernels = {name: await start_kernel(jp_fetch) for name in "ABC"}
        pids = {name: kernel_pid(jp_serverapp, k) for name, k in kernels.items()}
        sums = {}
        lowest = host_available()
        try:
            sums["A"] = await hold(jp_serverapp, kernels["A"], size)
            seconds, parked = await park(jp_fetch, kernels["A"])
            record("fast 3x0.4: park A (0.4 of the device, arena made), s", round(seconds, 2))
            record("fast 3x0.4: A's park: path / library copy s / host GiB",
                   f"{parked['path']['path']} / {parked['path']['park_seconds']} / "
                   f"{round(parked['host_bytes'] / GiB, 2)}")
            assert parked["path"]["path"] == "pages", parked
            for name in "BC":
                sums[name] = await hold(jp_serverapp, kernels[name], size)
            lowest = min(lowest, host_available())
            for name, victim_of in (("A", "B"), ("B", None), ("C", None), ("A", None)):
                seconds, ran = await timed_cell(jp_serverapp, kernels[name], CHECK)
                lowest = min(lowest, host_available())
                states = {n: (await park_state(jp_fetch, k))["state"] for n, k in kernels.items()}
                record(f"fast 3x0.4: {name}'s cell, s", round(seconds, 2))
                record(f"fast 3x0.4: states after {name}'s cell", states)
                assert ran["status"] == "ok" and last_line(ran["stdout"]) == sums[name], (name, ran)
                assert states[name] in ("idle", "busy"), states
                path = (await park_state(jp_fetch, kernels[name]))["path"]
                record(
                    f"fast 3x0.4: {name}'s resume in its cell: copy s / of which waiting for the park making room",
                    path and (path["resume_seconds"], path["resume_waited_seconds"]),
                )
                if victim_of is not None:  # the first swap: B, idle longest, parks for A (as on the checkpoint path)
                    assert states[victim_of] == "parked", states
                    victim = (await park_state(jp_fetch, kernels[victim_of]))["path"]
                    record(f"fast 3x0.4: {victim_of}'s park for it (arena made first), copy s", victim["park_seconds"])
                    # Both copies at once: A's resume began while B's park still held the room, and waited for it.
                    assert path["resume_waited_seconds"] > 0, path
                assert "lost" not in states.values(), states
            # A kept its arena at its last resume and B holds its own while parked: about 112 GiB pinned, so C's
            # first park (a new arena) finds the host short, and A, running, gives its kept arena back first.
            a_resident = resident_of(pids["A"])
            record("fast 3x0.4: A's resident memory with its kept arena, GiB", round(a_resident / GiB, 1))
            assert a_resident > 0.8 * size, "A did not keep its arena: the host's memory is not what this scene needs"
            seconds, parked = await park(jp_fetch, kernels["C"])
            lowest = min(lowest, host_available())
            record("fast 3x0.4: park C (a new arena, A's kept one given back first), s", round(seconds, 2))
            record("fast 3x0.4: A's resident memory after C's park, GiB", round(resident_of(pids["A"]) / GiB, 1))
            assert parked["path"]["path"] == "pages", parked
            assert resident_of(pids["A"]) < 0.2 * size, "A did not give back its kept arena during C's park"
            seconds, ran = await timed_cell(jp_serverapp, kernels["C"], CHECK)
            record("fast 3x0.4: C's cell after its park, s", round(seconds, 2))
            assert ran["status"] == "ok" and last_line(ran["stdout"]) == sums["C"], ran
            for name, kernel_id in kernels.items():
                park_path = (await park_state(jp_fetch, kernel_id))["path"]
                record(
                    f"fast 3x0.4: {name}'s last copies (park / resume / of which waiting, s)",
                    park_path
                    and (park_path["park_seconds"], park_path["resume_seconds"], park_path["resume_waited_seconds"]),
                )
                assert kernel_pid(jp_serverapp, kernel_id) == pids[name], f"{name}'s kernel was restarted"
            record("fast 3x0.4: host available, lowest seen, GiB", round(lowest / GiB, 1))
        finally:
            for kernel_id in kernels.values():
                await shutdown_kernel(jp_fetch, kernel_id)


class TestTwoKernelsOfFiftyFiveHundredths:
    @pytest.fixture
    def jp_server_config(self):
        return broker_config(0.6, "40s")

    async def test_a_cell_that_cannot_get_room_ends_at_the_limit_with_why_and_nothing_is_lost(
        self, jp_fetch, jp_serverapp
    ):
        total = device_total()
        size = int(0.55 * total)
        a, b = await start_kernel(jp_fetch), await start_kernel(jp_fetch)
        try:
            checksum = await hold(jp_serverapp, a, size)
            seconds, _ = await park(jp_fetch, a)
            record("broker 2x0.55: park A, s", round(seconds, 1))
            await hold(jp_serverapp, b, size)
            record("broker 2x0.55: host available with A parked, B holding, GiB", round(host_available() / GiB, 1))
            seconds, ran = await timed_cell(jp_serverapp, a, CHECK)
            record("broker 2x0.55: A's cell ended after, s", round(seconds, 1))
            record("broker 2x0.55: what A's cell said", (ran["stdout"].strip().splitlines() + [ran["error"]])[-3:])
            assert ran["status"] == "error" and "waited 40 s (the park_wait_limit)" in ran["error"], ran
            assert "Nothing is lost" in ran["error"]
            parked = await park_state(jp_fetch, a)
            assert parked["state"] == "parked", parked
            await shutdown_kernel(jp_fetch, b)  # the memory is free again
            seconds, ran = await timed_cell(jp_serverapp, a, CHECK)
            record("broker 2x0.55: A's cell once B was gone, s", round(seconds, 1))
            assert ran["status"] == "ok" and last_line(ran["stdout"]) == checksum, ran
        finally:
            for kernel_id in (a, b):
                try:
                    await shutdown_kernel(jp_fetch, kernel_id)
                except Exception:
                    pass


# --- move only what must move -------------------------------------------------------------------------------

# 20 GiB made, 16 GiB of it freed again: torch keeps the 16 GiB cached (reserved), NVML counts them.
FREED_MOST = """
import torch
keep = torch.empty({keep}, dtype=torch.uint8, device='cuda')
keep.random_(0, 251)
big = torch.empty({freed}, dtype=torch.uint8, device='cuda')
big.fill_(1)
del big
torch.cuda.synchronize()
print(torch.cuda.memory_reserved(), sum(int(p.sum(dtype=torch.int64)) for p in keep.split(1 << 24)))
"""


def raw_park_and_resume(pid: int) -> tuple:
    """The driver's four calls on `pid`, from this process, timed: (park s, resume s)."""
    driver = CudaCheckpointDriver()
    driver.open()
    began = time.perf_counter()
    driver.lock(pid, 10_000)
    driver.checkpoint(pid)
    parked = time.perf_counter() - began
    began = time.perf_counter()
    driver.restore(pid)
    driver.unlock(pid)
    return parked, time.perf_counter() - began


class TestMoveOnlyWhatMustMove:
    @pytest.fixture
    def jp_server_config(self):
        return broker_config(0.45, "4min")

    async def test_a_park_moves_the_live_bytes_not_the_allocators_cache(self, jp_fetch, jp_serverapp):
        keep, freed = 4 * GiB, 16 * GiB
        trimmed, raw = await start_kernel(jp_fetch), await start_kernel(jp_fetch)
        try:
            outputs = {}
            for kernel_id in (trimmed, raw):
                outputs[kernel_id] = last_line(
                    await execute(jp_serverapp, kernel_id, FREED_MOST.format(keep=keep, freed=freed), timeout=300)
                )
            before = nvml_used_by_pid()
            pid_trimmed, pid_raw = kernel_pid(jp_serverapp, trimmed), kernel_pid(jp_serverapp, raw)
            record("trim: NVML bytes of the kernel before the park (cache included)", before.get(pid_trimmed))
            seconds, parked = await park(jp_fetch, trimmed)
            record("trim: bytes moved by the server's park (cache emptied first)", parked["host_bytes"])
            record("trim: server's park, s", round(seconds, 2))
            began = time.perf_counter()
            again = last_line(await execute(jp_serverapp, trimmed, "print(torch.cuda.memory_reserved())"))
            record("trim: resume by the next cell, s", round(time.perf_counter() - began, 2))
            raw_park, raw_resume = await asyncio.get_running_loop().run_in_executor(None, raw_park_and_resume, pid_raw)
            record("trim: raw driver on the same state, bytes moved", before.get(pid_raw))
            record("trim: raw driver park / resume of the uncut cache, s", f"{raw_park:.2f} / {raw_resume:.2f}")
            assert parked["host_bytes"] < before[pid_trimmed] - 12 * GiB, (parked, before[pid_trimmed])
            assert int(again) <= keep + GiB  # what the kernel's allocator holds afterwards: its live bytes
            for kernel_id in (trimmed, raw):  # the live tensor is intact either way
                check = "print(sum(int(p.sum(dtype=torch.int64)) for p in keep.split(1 << 24)))"
                assert last_line(await execute(jp_serverapp, kernel_id, check)) == outputs[kernel_id].split()[1]
        finally:
            for kernel_id in (trimmed, raw):
                await shutdown_kernel(jp_fetch, kernel_id)



# --- two GPUs: room is made where it is needed -----------------------------------------------------------------

needs_two = pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")


@needs_two
class TestRoomOnTheSecondGpu:
    """Issue 23: a resume that needs room on the second GPU parks idle kernels there, not on the first, even when
    the first GPU's idle kernels have been idle longer (least recently active first applies per device)."""

    @pytest.fixture
    def jp_server_config(self):
        config = broker_config(0.45, "4min")
        config.GpuQuota.placement = "spread"  # starts alternate: GPU 0, GPU 1, GPU 0, ...
        return config

    async def test_a_resume_on_gpu_1_parks_gpu_1s_idle_kernel_and_leaves_gpu_0_alone(self, jp_fetch, jp_serverapp):
        from ..integration.fake_gpu import manager_of

        size = int(0.4 * device_total())
        names = ("D", "A", "E", "B")  # spread: D and E on GPU 0, A and B on GPU 1 (C below, on GPU 1 too)
        kernels = {name: await start_kernel(jp_fetch) for name in names}
        kernels["F"] = await start_kernel(jp_fetch)  # GPU 0, holds nothing: keeps the alternation
        kernels["C"] = await start_kernel(jp_fetch)
        ledger = manager_of(jp_serverapp).ledger
        where = {name: ledger.get(k).devices for name, k in kernels.items()}
        assert where["D"] == where["E"] == (0,) and where["A"] == where["B"] == where["C"] == (1,), where
        try:
            for name in ("D", "E"):  # idle longest: a broker that ignored devices would park these
                await hold(jp_serverapp, kernels[name], size)
            sums = {"A": await hold(jp_serverapp, kernels["A"], size)}
            await park(jp_fetch, kernels["A"])
            for name in ("B", "C"):
                await hold(jp_serverapp, kernels[name], size)
            seconds, ran = await timed_cell(jp_serverapp, kernels["A"], CHECK)
            record("two GPUs: A's cell on GPU 1, s (B parked for it on GPU 1)", round(seconds, 1))
            assert ran["status"] == "ok" and last_line(ran["stdout"]) == sums["A"], ran
            states = {name: (await park_state(jp_fetch, kernels[name]))["state"] for name in ("B", "C", "D", "E")}
            record("two GPUs: park states after A's cell", states)
            assert states["B"] == "parked" and states["C"] != "parked", states
            assert states["D"] != "parked" and states["E"] != "parked", states  # GPU 0 left alone
        finally:
            for kernel_id in kernels.values():
                await shutdown_kernel(jp_fetch, kernel_id)
