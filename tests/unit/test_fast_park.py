"""The fast park library (gpu_quota_ext/parking/pages/pages.c), compiled here and run against a fake CUDA
driver over host memory (tests/fake_cuda): allocations land at reserved addresses, a park empties the device
and a resume brings every byte back to the same addresses, one arena serves every park, and a failure in the
middle of a copy leaves the process as it was. Both libraries are compiled with the system's `cc`; without
one these tests fail and say so (CI has one)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gpu_quota_ext.parking.pages import E_ARENA, E_DRIVER, E_STATE, Pages, PagesError
from tests.fake_cuda import build_pages_over_fake_runtime

from .fast_park_build import build_both

MiB = 1 << 20
GRANULARITY = 2 * MiB
CHUNK = 1 * MiB  # small chunks, so that a copy fails with chunks done before and after it
ILLEGAL_ADDRESS, OUT_OF_MEMORY, NOT_SUPPORTED = 700, 2, 801


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Both libraries compiled once for this module, outside the repository."""
    return build_both(tmp_path_factory, "fast_park_build")


class Process:
    """One fresh copy of each library (a copy under a new path is a new instance: fresh state per test)."""

    def __init__(self, built, folder: Path, monkeypatch, driver: str = ""):
        pages_so, fake_so = built
        (folder / "fake").mkdir()
        self.fake_path = folder / "fake" / fake_so.name
        shutil.copy(fake_so, self.fake_path)
        pages_copy = folder / pages_so.name
        shutil.copy(pages_so, pages_copy)
        monkeypatch.setenv("GQX_PAGES_LIBCUDA", driver or str(self.fake_path))
        monkeypatch.setenv("GQX_PAGES_CHUNK_BYTES", str(CHUNK))
        self.pages = Pages.load(str(pages_copy))
        self.lib = self.pages.lib
        self.lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        self.lib.cudaFree.argtypes = [ctypes.c_void_p]
        self.fake = ctypes.CDLL(str(self.fake_path))  # the very instance pages.c opened (same path)
        self.fake.fake_device_used.restype = ctypes.c_size_t
        self.fake.fake_set_capacity.argtypes = [ctypes.c_size_t]
        self.fake.fake_calls.restype = ctypes.c_long
        self.fake.fake_fail.argtypes = [ctypes.c_char_p, ctypes.c_long, ctypes.c_int, ctypes.c_long]

    def malloc(self, size: int) -> int:
        pointer = ctypes.c_void_p()
        code = self.lib.cudaMalloc(ctypes.byref(pointer), size)
        assert code == 0, f"cudaMalloc({size}) returned {code}: {self.pages.last_error()}"
        return pointer.value or 0

    def fill(self, address: int, size: int) -> bytes:
        data = os.urandom(size)
        ctypes.memmove(address, data, size)
        return data

    def read(self, address: int, size: int) -> bytes:
        return ctypes.string_at(address, size)

    def calls(self, name: str) -> int:
        return self.fake.fake_calls(name.encode())

    def fail(self, name: str, after: int, code: int, times: int = 1) -> None:
        self.fake.fake_fail(name.encode(), after, code, times)

    def device_used(self) -> int:
        return self.fake.fake_device_used()


SIZES = (4 * MiB, 3 * MiB + 5, 64 * 1024, 10 * MiB)  # whole, ragged, tiny and larger than a few chunks


@pytest.fixture
def process(built, tmp_path, monkeypatch):
    return Process(built, tmp_path, monkeypatch)


def fill_all(process: Process, sizes) -> list:
    """The process holding `sizes`, filled with random bytes: [(address, size, bytes)]."""
    held = []
    for size in sizes:
        address = process.malloc(size)
        held.append((address, size, process.fill(address, size)))
    return held


@pytest.fixture
def filled(process):
    return fill_all(process, SIZES)


PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "fast_park_probe.py"


def built_probe(folder: Path) -> Path:
    """The probe's library compiled into `folder` as the probe itself does it (--build-only)."""
    build = subprocess.run(
        [sys.executable, str(PROBE), "--build-only", "--out", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert build.returncode == 0, build.stderr
    return folder


def padded(size: int) -> int:
    return -(-size // GRANULARITY) * GRANULARITY


def assert_intact(process, held) -> None:
    for address, size, data in held:
        assert process.read(address, size) == data, f"the {size} bytes at {address:#x} changed"


def test_allocations_are_mapped_at_reserved_addresses_in_whole_granules(process, filled):
    assert process.pages.active(), process.pages.last_error()
    assert process.pages.mapping_count() == len(SIZES)
    assert process.pages.mapped_bytes() == process.pages.resident_bytes() == sum(SIZES)
    assert process.device_used() == sum(padded(size) for size in SIZES)
    assert all(address % GRANULARITY == 0 for address, _, _ in filled)
    assert_intact(process, filled)


def test_a_park_empties_the_device_and_a_resume_brings_every_byte_back_to_the_same_addresses(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.pages.park(arena)
    assert process.calls("cuCtxSynchronize") == 1  # the device's work waited for once, not per mapping
    assert process.pages.state() == "parked"
    assert process.device_used() == 0
    assert process.pages.resident_bytes() == 0
    assert process.pages.mapped_bytes() == sum(SIZES)  # what the arena holds for it

    process.pages.resume()
    assert process.pages.state() == "running"
    assert process.device_used() == sum(padded(size) for size in SIZES)
    assert_intact(process, filled)  # the same addresses: read where the caller's pointers point
    assert process.fake.fake_context_depth() == 0


def test_one_arena_serves_every_park_and_is_pinned_once(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    for _ in range(3):
        process.pages.park(arena)
        process.pages.resume()
        assert_intact(process, filled)
        # what the process writes between parks is what the next park keeps
        filled = [(address, size, process.fill(address, size)) for address, size, _ in filled]
    assert process.calls("cuMemHostRegister") == 1
    assert process.calls("cuStreamCreate") == 4  # two pairs of streams, made once
    arena.close()
    assert process.calls("cuMemHostUnregister") == 1


def test_a_park_failing_in_the_middle_of_the_copy_releases_nothing(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.fail("cuMemcpyDtoHAsync", after=5, code=ILLEGAL_ADDRESS)
    with pytest.raises(PagesError) as failed:
        process.pages.park(arena)
    assert failed.value.code == ILLEGAL_ADDRESS
    assert "cuMemcpyDtoHAsync" in failed.value.message and "CUDA_ERROR_ILLEGAL_ADDRESS" in failed.value.message
    assert process.pages.state() == "running"
    assert process.calls("cuMemUnmap") == 0 and process.calls("cuMemRelease") == 0
    assert process.device_used() == sum(padded(size) for size in SIZES)
    assert_intact(process, filled)

    process.pages.park(arena)  # the fault was once: the next park goes through
    process.pages.resume()
    assert_intact(process, filled)


def test_a_park_whose_streams_report_a_failure_releases_nothing(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.fail("cuStreamSynchronize", after=0, code=ILLEGAL_ADDRESS)
    with pytest.raises(PagesError, match="cuStreamSynchronize"):
        process.pages.park(arena)
    assert process.pages.state() == "running"
    assert process.device_used() == sum(padded(size) for size in SIZES)
    assert_intact(process, filled)
    assert process.fake.fake_context_depth() == 0


def test_a_resume_without_device_memory_stays_parked_and_keeps_the_host_copy(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.pages.park(arena)
    process.fake.fake_set_capacity(padded(SIZES[0]) + padded(SIZES[1]))  # room for two of the four
    with pytest.raises(PagesError) as failed:
        process.pages.resume()
    assert failed.value.code == OUT_OF_MEMORY
    assert process.pages.state() == "parked"
    assert process.device_used() == 0  # what this resume had taken is given back

    process.fake.fake_set_capacity(1 << 40)
    process.pages.resume()
    assert_intact(process, filled)


def test_a_resume_failing_in_the_middle_of_the_copy_stays_parked(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.pages.park(arena)
    process.fail("cuMemcpyHtoDAsync", after=7, code=ILLEGAL_ADDRESS)
    with pytest.raises(PagesError, match="cuMemcpyHtoDAsync"):
        process.pages.resume()
    assert process.pages.state() == "parked"
    assert process.device_used() == 0
    with pytest.raises(PagesError) as refused:
        arena.close()  # it holds the only copy
    assert refused.value.code == E_STATE

    process.pages.resume()
    assert_intact(process, filled)
    assert process.fake.fake_context_depth() == 0


def test_a_park_refuses_an_arena_too_small_and_changes_nothing(process, filled):
    small = process.pages.arena(SIZES[0])
    with pytest.raises(PagesError) as refused:
        process.pages.park(small)
    assert refused.value.code == E_ARENA
    assert str(sum(SIZES)) in refused.value.message
    assert process.pages.state() == "running"
    assert process.calls("cuMemcpyDtoHAsync") == 0
    assert_intact(process, filled)


def test_park_and_resume_refuse_the_wrong_state(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    with pytest.raises(PagesError) as refused:
        process.pages.resume()
    assert refused.value.code == E_STATE
    process.pages.park(arena)
    with pytest.raises(PagesError) as refused:
        process.pages.park(arena)
    assert refused.value.code == E_STATE
    process.pages.resume()
    assert_intact(process, filled)


def test_an_allocation_made_while_parked_waits_for_the_resume(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.pages.park(arena)
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("address", process.malloc(2 * MiB)))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and not result, "an allocation ran while the process was parked"
    process.pages.resume()
    waiter.join(timeout=30)
    assert result["address"] and process.pages.mapping_count() == len(SIZES) + 1
    assert_intact(process, filled)


def test_a_free_gives_everything_back(process, filled):
    for address, _, _ in filled:
        assert process.lib.cudaFree(address) == 0
    assert process.pages.mapping_count() == 0
    assert process.device_used() == 0
    assert process.calls("cuCtxSynchronize") == len(SIZES)  # cudaFree waits for the device, as libcudart's does
    assert process.lib.cudaFree(None) == 0
    assert process.fake.fake_context_depth() == 0


def test_a_zero_byte_allocation_is_null_and_holds_nothing(process):
    assert process.malloc(0) == 0
    assert process.pages.mapping_count() == 0


def test_the_arena_is_pinned_in_the_process_context_from_any_thread(process, filled):
    """A park comes from a thread of its own, which has no current context: the library uses the one its
    allocations ran in."""
    process.fake.fake_set_no_context(1)
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.pages.park(arena)
    process.pages.resume()
    assert_intact(process, filled)
    arena.close()
    assert process.calls("cuMemHostUnregister") == 1
    assert process.fake.fake_context_depth() == 0


def test_an_arena_the_driver_will_not_unpin_is_kept(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.fail("cuMemHostUnregister", after=0, code=ILLEGAL_ADDRESS)
    with pytest.raises(PagesError, match="cuMemHostUnregister"):
        arena.close()
    assert arena.handle  # still there, still pinned: a park can use it
    process.pages.park(arena)
    process.pages.resume()
    assert_intact(process, filled)
    arena.close()


def test_without_a_driver_nothing_is_served_and_nothing_parks(built, tmp_path, monkeypatch):
    process = Process(built, tmp_path, monkeypatch, driver=str(tmp_path / "no-such-libcuda.so.1"))
    assert not process.pages.active()
    assert "no-such-libcuda.so.1" in process.pages.last_error()
    with pytest.raises(PagesError) as refused:
        process.pages.resume()
    assert refused.value.code == E_DRIVER


def test_the_probe_builds_the_library_for_the_gpu_machine(tmp_path):
    """What the lead runs here before carrying the folder to the GPU machine (which may have no compiler)."""
    done = subprocess.run(
        [sys.executable, str(PROBE), "--build-only", "--out", str(tmp_path / "probe")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    library = tmp_path / "probe" / "libgqx_pages.so"
    assert library.exists() and str(library) in done.stdout
    assert Pages.load(str(library)).state() == "running"


@pytest.fixture(scope="module")
def over_runtime(built, tmp_path_factory):
    """The library linked to a fake libcudart, which it finds after itself as a preloaded library finds the real
    one; and that fake, to count what reached it."""
    folder = tmp_path_factory.mktemp("fast_park_runtime")
    pages_so = build_pages_over_fake_runtime(folder)
    runtime = ctypes.CDLL(str(folder / "libgqxfakecudart.so"))
    return (pages_so, built[1]), runtime


class Counts:
    def __init__(self, runtime):
        self.runtime = runtime
        self.start = self.now()

    def now(self):
        r = self.runtime
        return r.fake_cudart_mallocs(), r.fake_cudart_frees(), r.fake_cudart_null_frees()

    def since(self):
        return tuple(b - a for a, b in zip(self.start, self.now()))


def test_memory_the_virtual_memory_calls_refuse_is_served_by_the_runtime_and_stays_through_a_park(
    over_runtime, tmp_path, monkeypatch
):
    built_here, runtime = over_runtime
    process = Process(built_here, tmp_path, monkeypatch)
    counts = Counts(runtime)
    kept = [(a, 4 * MiB, process.fill(a, 4 * MiB)) for a in [process.malloc(4 * MiB)]]
    process.fail("cuMemCreate", after=0, code=NOT_SUPPORTED)
    served = process.malloc(3 * MiB)  # refused by the driver's virtual memory calls: libcudart serves it
    data = process.fill(served, 3 * MiB)
    assert counts.since() == (1, 0, 0)
    assert process.pages.passthrough_bytes() == 3 * MiB
    assert process.pages.mapped_bytes() == 4 * MiB  # what a park moves; the arena need not hold the rest

    process.pages.park(process.pages.arena(process.pages.mapped_bytes()))
    assert process.read(served, 3 * MiB) == data  # never parked: still where it was, readable
    process.pages.resume()
    assert_intact(process, kept)

    assert process.lib.cudaFree(served) == 0
    assert counts.since() == (1, 1, 0)  # its free went to the runtime too
    assert process.pages.passthrough_bytes() == 0


def test_an_out_of_memory_is_the_callers_and_never_goes_around_the_library(over_runtime, tmp_path, monkeypatch):
    built_here, runtime = over_runtime
    process = Process(built_here, tmp_path, monkeypatch)
    counts = Counts(runtime)
    process.fake.fake_set_capacity(4 * MiB)
    process.malloc(4 * MiB)
    pointer = ctypes.c_void_p()
    assert process.lib.cudaMalloc(ctypes.byref(pointer), 2 * MiB) == 2  # cudaErrorMemoryAllocation
    assert counts.since() == (0, 0, 0)  # torch frees its cache and retries, or raises OutOfMemoryError
    assert process.pages.mapping_count() == 1


def test_a_thread_without_a_context_gets_the_runtimes_and_without_any_the_runtime_serves(
    over_runtime, tmp_path, monkeypatch
):
    built_here, runtime = over_runtime
    process = Process(built_here, tmp_path, monkeypatch)
    counts = Counts(runtime)
    process.fake.fake_set_no_context(1)
    address = process.malloc(2 * MiB)
    assert counts.since() == (1, 0, 1)  # cudaFree(NULL) asked for a context, none came: served by the runtime
    assert process.pages.passthrough_bytes() == 0  # not in the table: its free goes straight through
    assert process.lib.cudaFree(address) == 0
    assert counts.since() == (1, 1, 1)


def test_a_park_whose_device_work_fails_copies_nothing_and_releases_nothing(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.fail("cuCtxSynchronize", after=0, code=ILLEGAL_ADDRESS)
    with pytest.raises(PagesError, match="cuCtxSynchronize"):
        process.pages.park(arena)
    assert process.calls("cuMemcpyDtoHAsync") == 0 and process.calls("cuMemUnmap") == 0
    assert process.pages.state() == "running"
    assert_intact(process, filled)


def test_a_freed_allocation_is_never_backed_again_even_when_its_address_range_stays(process, filled):
    process.fail("cuMemAddressFree", after=0, code=ILLEGAL_ADDRESS)
    address, size, _ = filled[0]
    assert process.lib.cudaFree(address) == 0
    assert process.pages.mapping_count() == len(SIZES) - 1
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.pages.park(arena)
    process.pages.resume()
    assert process.device_used() == sum(padded(s) for s in SIZES[1:])
    assert_intact(process, filled[1:])


def test_a_mapping_that_will_not_unmap_stays_on_the_device_and_the_park_says_so(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.fail("cuMemUnmap", after=1, code=ILLEGAL_ADDRESS)  # the second mapping's
    with pytest.raises(PagesError) as failed:
        process.pages.park(arena)
    assert f"parked, but {padded(SIZES[1])} bytes stayed on the device" in failed.value.message
    assert process.pages.state() == "parked"
    assert process.device_used() == padded(SIZES[1])
    process.pages.resume()  # the others come back; that one never left
    assert_intact(process, filled)
    assert process.device_used() == sum(padded(size) for size in SIZES)


def test_the_probes_overhead_phase_runs_paired_rounds_on_one_cpu_over_the_fake_driver(tmp_path):
    """The overhead phase, as the GPU machine runs it (--overhead-only --pin-cpu), here over the tests' fake driver:
    several processes per arm and an A/A control child, every child pinned once ready, every round of each measure
    paired, an ordered interval per ratio (per process over pairs, pooled over rounds, A/A)."""
    probe = PROBE
    built_probe(tmp_path / "probe")
    cpu = max(os.sched_getaffinity(0))
    out = tmp_path / "overhead.json"
    done = subprocess.run(
        [sys.executable, str(probe), "--library-dir", str(tmp_path / "probe"), "--dry-run", "--overhead-only",
         "--overhead-pairs", "2", "--bench-rounds", "2", "--pin-cpu", str(cpu), "--out-json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    overhead = json.loads(out.read_text())["overhead"]
    assert overhead["pinned_cpu"] == cpu and overhead["pairs"] == 2
    names = ["pages-0", "plain-0", "pages-1", "plain-1", "plain-control"]
    assert [child["name"] for child in overhead["children"]] == names
    assert [child["affinity"] for child in overhead["children"]] == [[cpu]] * 5  # 2 pairs and the control
    assert [len(overhead["rounds"][key]) for key in ("pages", "plain")] == [4, 4]  # 2 pairs x 2 rounds
    assert {name: len(rows) for name, rows in overhead["control"]["rounds"].items()} == {
        "plain-0": 2, "plain-control": 2
    }

    def ordered(interval):
        low, high = interval
        return 0 < low <= high

    for measure in ("alloc_loop_s", "alloc_uncached_s", "train_step_s"):
        figures = overhead[measure]
        assert ordered(figures["ratio_95ci"]) and figures["ratio"] > 0 and figures["median_paired_ratio"] > 0, figures
        each, aa = figures["per_process"], figures["control"]
        assert len(each["pages_medians"]) == len(each["plain_medians"]) == 2, each
        assert ordered(each["ratio_95ci"]) and each["ratio"] > 0, each
        assert ordered(aa["ratio_95ci"]) and aa["ratio"] > 0 and aa["children"] == ["plain-0", "plain-control"], aa
    assert json.loads(out.read_text())["sizes"] == {}  # no park was asked for


def test_the_probe_refuses_a_cpu_it_cannot_run_on_before_starting_anything(tmp_path):
    probe = PROBE
    outside = max(os.sched_getaffinity(0)) + 1
    done = subprocess.run(
        [sys.executable, str(probe), "--library-dir", str(tmp_path), "--overhead-only", "--pin-cpu", str(outside),
         "--out-json", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2 and f"--pin-cpu {outside}: not one of this process's CPUs" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no JSON written, no child started
