"""The fast park library's pieces (pages.c): a mapping's device memory made of pieces that a park can give back
one by one as their bytes reach the arena, and that a resume can take back one by one, waiting (bounded) for
memory a park elsewhere is releasing. Together they let a swap run both copies at once. Over the fake driver
(tests/fake_cuda), with pieces of two granules so that small allocations have several."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time

import pytest

from gpu_quota_ext.parking.pages import E_PARTIAL, E_STATE, PagesError

from .fast_park_build import build_both
from .test_fast_park import (
    GRANULARITY,
    ILLEGAL_ADDRESS,
    OUT_OF_MEMORY,
    PROBE,
    Process,
    assert_intact,
    built_probe,
    fill_all,
    padded,
)

PIECE = 2 * GRANULARITY
SIZES = (5 * PIECE + 7, 3 * GRANULARITY, 64 * 1024)  # six pieces (the last one ragged), two pieces, one piece
PIECES = 6 + 2 + 1


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_both(tmp_path_factory, "fast_park_pieces_build")


@pytest.fixture
def process(built, tmp_path, monkeypatch):
    monkeypatch.setenv("GQX_PAGES_PIECE_BYTES", str(PIECE))
    return Process(built, tmp_path, monkeypatch)


@pytest.fixture
def filled(process):
    return fill_all(process, SIZES)


def all_device_bytes() -> int:
    return sum(padded(size) for size in SIZES)


def test_a_large_allocation_is_backed_in_pieces_at_one_range_and_a_free_gives_every_piece_back(process, filled):
    assert process.calls("cuMemCreate") == PIECES
    assert process.calls("cuMemAddressReserve") == len(SIZES)  # one range each: the caller sees one allocation
    assert process.device_used() == all_device_bytes()
    assert_intact(process, filled)  # bytes written across the pieces' borders read back whole
    address, size, _ = filled[0]
    assert process.lib.cudaFree(address) == 0
    assert process.device_used() == all_device_bytes() - padded(size)
    assert process.calls("cuMemRelease") == 6


@pytest.mark.parametrize("release_as_copied", [False, True])
def test_a_park_in_pieces_empties_the_device_and_the_resume_brings_every_byte_back(process, filled, release_as_copied):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.pages.park(arena, release_as_copied=release_as_copied)
    assert process.pages.state() == "parked"
    assert process.device_used() == 0 and process.pages.resident_bytes() == 0
    assert process.calls("cuMemRelease") == PIECES
    process.pages.resume()
    assert process.pages.state() == "running"
    assert process.device_used() == all_device_bytes()
    assert_intact(process, filled)
    assert process.fake.fake_context_depth() == 0


def test_a_park_releasing_as_copied_that_fails_midway_is_parked_in_part_and_the_resume_brings_it_all_back(
    process, filled
):
    """The pieces already copied were released (a resume elsewhere may hold that memory by now): they cannot be
    had back here, so the process is parked in part, and says so; nothing is lost."""
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.fail("cuMemcpyDtoHAsync", after=13, code=ILLEGAL_ADDRESS)  # in the fourth piece (four chunks each)
    with pytest.raises(PagesError) as failed:
        process.pages.park(arena, release_as_copied=True)
    assert failed.value.code == E_PARTIAL
    assert "parked in part" in failed.value.message and "CUDA_ERROR_ILLEGAL_ADDRESS" in failed.value.message
    assert process.pages.state() == "parked"
    released = process.calls("cuMemRelease")
    assert 0 < released < PIECES
    assert process.device_used() == all_device_bytes() - released * PIECE
    assert process.pages.resident_bytes() > 0

    process.pages.resume()
    assert process.pages.state() == "running"
    assert process.device_used() == all_device_bytes()
    assert_intact(process, filled)


def test_the_same_failure_without_releasing_as_copied_releases_nothing(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.fail("cuMemcpyDtoHAsync", after=13, code=ILLEGAL_ADDRESS)
    with pytest.raises(PagesError) as failed:
        process.pages.park(arena)
    assert failed.value.code == ILLEGAL_ADDRESS
    assert process.pages.state() == "running" and process.calls("cuMemRelease") == 0
    assert_intact(process, filled)


def until(condition, what: str, timeout: float = 30.0) -> None:
    """Wait for `condition()`, at most `timeout` seconds: a deadline, never a threshold."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {timeout} s"
        time.sleep(0.001)


def test_a_resume_waits_for_memory_a_park_elsewhere_is_releasing_and_answers_meanwhile(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.pages.park(arena, release_as_copied=True)
    process.fake.fake_set_capacity(2 * PIECE)  # another process holds the rest of the device
    outcome: list = []

    def resume() -> None:
        try:
            process.pages.resume(wait_for_room=60.0)
            outcome.append("resumed")
        except PagesError as error:
            outcome.append(error)

    worker = threading.Thread(target=resume)
    worker.start()
    try:
        until(lambda: process.fake.fake_out_of_memory_answers() >= 1, "refused device memory")
        # Waiting, it has taken what there was, copied it back, and lets the counters answer.
        assert process.pages.state() == "resuming"
        assert process.pages.mapped_bytes() == sum(SIZES)
        assert 0 < process.device_used() <= 2 * PIECE
        process.fake.fake_set_capacity(1 << 40)  # the other process's park released its pieces
    finally:
        worker.join(60)
    assert outcome == ["resumed"]
    assert process.pages.state() == "running"
    assert process.device_used() == all_device_bytes()
    assert_intact(process, filled)
    assert process.pages.resume_waited_seconds() > 0  # it says that it waited (the status shows it)
    process.pages.park(arena)
    process.pages.resume(wait_for_room=60.0)  # room there: no wait
    assert process.pages.resume_waited_seconds() == 0


def test_a_resume_whose_wait_runs_out_gives_back_every_piece_and_stays_parked_whole(process, filled):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.pages.park(arena)
    process.fake.fake_set_capacity(2 * PIECE)
    with pytest.raises(PagesError) as failed:
        process.pages.resume(wait_for_room=0.05)
    assert failed.value.code == OUT_OF_MEMORY
    assert "after waiting for room" in failed.value.message
    assert process.fake.fake_out_of_memory_answers() >= 2  # tried again while it waited
    assert process.pages.state() == "parked"
    assert process.device_used() == 0  # the pieces it had taken and copied are given back
    with pytest.raises(PagesError) as refused:
        arena.close()  # it still holds the only copy
    assert refused.value.code == E_STATE

    process.fake.fake_set_capacity(1 << 40)
    process.pages.resume()
    assert_intact(process, filled)


@pytest.mark.parametrize("wait", [True, -1.0, math.nan, math.inf, 1e9, "5", None])
def test_a_wait_that_is_not_a_bounded_number_of_seconds_is_refused_and_changes_nothing(process, filled, wait):
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.pages.park(arena)
    with pytest.raises(ValueError, match="wait_for_room"):
        process.pages.resume(wait_for_room=wait)
    assert process.pages.state() == "parked"
    process.pages.resume()
    assert_intact(process, filled)


def test_the_probes_full_device_swap_runs_both_ways_and_checks_every_byte_over_the_fake_driver(tmp_path):
    """--full-swap as the GPU machine runs it, here over the fake driver (one fake device per process, so the
    resume never has to wait: the protocol, the roles swapping each round, the checks and the figures)."""
    built_probe(tmp_path / "probe")
    out = tmp_path / "swap.json"
    done = subprocess.run(
        [sys.executable, str(PROBE), "--library-dir", str(tmp_path / "probe"), "--dry-run", "--full-swap",
         "--full-swap-gib", "6", "--full-swap-rounds", "2", "--out-json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert "errors" not in result, result["errors"]
    swap = result["full_swap"]
    assert [row["exact"] for row in swap["rounds"]] == [True, True]
    assert all(row["bytes"] > 0 for row in swap["rounds"])  # a dry run parks the library's own buffer (CPU tensors)
    assert swap["together_over_one_by_one"] > 0 and swap["together_over_longer_alone"] > 0


def test_the_probe_refuses_a_full_swap_larger_than_it_can_hold_before_starting_anything(tmp_path):
    done = subprocess.run(
        [sys.executable, str(PROBE), "--library-dir", str(tmp_path), "--full-swap", "--full-swap-gib", "500",
         "--out-json", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2 and "--full-swap-gib between 1 and 64" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "call, passes, freed",
    [
        ("cuMemRelease", 0, 1),  # unmapped, its handle not released: nothing of it on the device, the free failed
        ("cuMemUnmap", 1, 0),  # its first piece unmapped, the second would not: the free failed halfway
    ],
)
def test_a_resume_brings_back_only_what_the_park_moved_not_what_a_failed_free_gave_back(process, call, passes, freed):
    """A cudaFree whose driver calls fail partway leaves its mapping in the table with some pieces (or none) on the
    device. The park moves what is there; the resume must bring back that and no more: not take device memory
    again for pieces the free gave back, nor read their bytes from where an earlier park had put them."""
    two = process.malloc(3 * GRANULARITY)  # two pieces
    large = process.malloc(5 * PIECE + 7)
    small = process.malloc(64 * 1024)  # placed after the large one in the first park's arena
    held = [(address, size, process.fill(address, size)) for address, size in
            ((two, 3 * GRANULARITY), (large, 5 * PIECE + 7), (small, 64 * 1024))]
    first = process.pages.arena(process.pages.mapped_bytes())
    process.pages.park(first)
    process.pages.resume()
    assert process.lib.cudaFree(large) == 0  # the small one takes its place in the table, its offset kept
    address, size, _ = held[0] if freed == 0 else held[2]
    process.fail(call, after=passes, code=ILLEGAL_ADDRESS)
    assert process.lib.cudaFree(address) != 0
    on_device = process.pages.resident_bytes()

    arena = process.pages.arena(process.pages.mapped_bytes())  # smaller than the first: the large one is gone
    process.pages.park(arena)
    process.pages.resume()  # (it read the freed piece's bytes from its old offset, outside this arena, and failed)
    assert process.pages.state() == "running"
    assert process.pages.resident_bytes() == on_device
    kept = held[2] if freed == 0 else held[0]
    assert_intact(process, [kept])


def test_a_piece_a_failed_resume_could_not_give_back_is_copied_again_by_the_next_resume(process, filled):
    """A resume that fails gives back the pieces it took; one whose unmap fails stays on the device with only part
    of its bytes copied. The next resume must copy that piece again, not take it for one the park left there."""
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.pages.park(arena)
    process.fail("cuMemcpyHtoDAsync", after=1, code=ILLEGAL_ADDRESS)  # in the first piece: one chunk of four copied
    process.fail("cuMemUnmap", after=0, code=ILLEGAL_ADDRESS)  # and that piece will not be given back
    with pytest.raises(PagesError) as failed:
        process.pages.resume()
    assert failed.value.code == ILLEGAL_ADDRESS
    assert process.pages.state() == "parked"

    process.pages.resume()
    assert process.pages.state() == "running"
    assert process.device_used() == all_device_bytes()
    assert_intact(process, filled)


@pytest.mark.parametrize(
    "setting, piece",
    [
        ("not a number", None),  # ignored: the default, 2 GiB, larger than every allocation here (one piece each)
        ("-4194304", None),  # ignored
        ("0", None),  # ignored
        ("1", GRANULARITY),  # rounded up to one granule
        (str(3 * GRANULARITY - 5), 3 * GRANULARITY),  # rounded up to whole granules
        (str(1 << 62), None),  # larger than any allocation: one piece each
    ],
)
def test_a_piece_size_that_is_no_size_is_ignored_and_any_other_is_rounded_to_whole_granules(
    built, tmp_path, monkeypatch, setting, piece
):
    monkeypatch.setenv("GQX_PAGES_PIECE_BYTES", setting)
    process = Process(built, tmp_path, monkeypatch)
    filled = fill_all(process, SIZES)
    pieces = sum(1 if piece is None else -(-padded(size) // piece) for size in SIZES)
    assert process.calls("cuMemCreate") == pieces
    arena = process.pages.arena(process.pages.mapped_bytes())
    process.pages.park(arena, release_as_copied=True)
    assert process.device_used() == 0 and process.calls("cuMemRelease") == pieces
    process.pages.resume()
    assert_intact(process, filled)
