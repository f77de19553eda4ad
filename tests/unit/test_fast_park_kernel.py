"""The kernel's side of a fast park (gpu_quota_ext/kernel/fast_park.py, through park_wait.ParkWatch's control
requests) in a process started as a kernel is with fast_park on: the library in LD_PRELOAD, over the tests' fake
CUDA driver (tests/fake_cuda) instead of libcuda. torch is a stand-in that says its CUDA is in use (the memory
is the library's own allocation, filled with random bytes): the facts, a park into an arena of the size the
server reserved, a resume that finds no room (the kernel stays parked and whole), a resume once there is room,
byte-exact, the kept arena given back when the server asks (refused while parked), and an arena not kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_quota_ext.kernel import fast_park

from .fast_park_build import build_both

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20

KERNEL = r"""
import ctypes, json, os, sys, types

fake = ctypes.CDLL(os.environ["GQX_PAGES_LIBCUDA"])  # the instance the library opens (same path)
fake.fake_device_used.restype = ctypes.c_size_t
fake.fake_set_capacity.argtypes = [ctypes.c_size_t]

from gpu_quota_ext.kernel import fast_park
from gpu_quota_ext.kernel.park_wait import ParkWatch

watch = ParkWatch(lambda: None)
out = {"before_torch": watch.on_request({"action": "facts"})}

# torch as a kernel holds it: CUDA in use, its native allocator (the memory itself comes below)
cuda = types.SimpleNamespace(is_initialized=lambda: True, get_allocator_backend=lambda: "native")
sys.modules["torch"] = types.SimpleNamespace(cuda=cuda)

lib = fast_park.pages().lib
lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
pointer, size = ctypes.c_void_p(), 6 * (1 << 20) + 123
assert lib.cudaMalloc(ctypes.byref(pointer), size) == 0, fast_park.pages().last_error()
data = os.urandom(size)
ctypes.memmove(pointer.value, data, size)

out["facts"] = watch.on_request({"action": "facts"})
arena = int(sys.argv[1])
out["small_arena"] = watch.on_request({"action": "park", "arena": 1 << 20})
out["park"] = watch.on_request({"action": "park", "arena": arena})
out["parked_here"] = fast_park.parked_here()
out["maybe_parked"] = watch.maybe_parked.is_set()
out["used_while_parked"] = fake.fake_device_used()
out["facts_parked"] = watch.on_request({"action": "facts"})
fake.fake_set_capacity(1 << 20)  # a neighbour took the room
out["resume_without_room"] = watch.on_request({"action": "resume", "keep_arena": True})
out["state_after_refusal"] = fast_park.pages().state()
fake.fake_set_capacity(1 << 40)
out["release_while_parked"] = watch.on_request({"action": "release"})
out["resume"] = watch.on_request({"action": "resume", "keep_arena": True})
out["exact"] = ctypes.string_at(pointer.value, size) == data
out["facts_kept"] = watch.on_request({"action": "facts"})
out["release"] = watch.on_request({"action": "release"})
out["facts_released"] = watch.on_request({"action": "facts"})
out["park_again"] = watch.on_request({"action": "park", "arena": arena})
out["resume_not_kept"] = watch.on_request({"action": "resume", "keep_arena": False})
out["exact_again"] = ctypes.string_at(pointer.value, size) == data
out["facts_after"] = watch.on_request({"action": "facts"})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    return build_both(tmp_path_factory, "fast_park_kernel")


def run_kernel(libraries, arena: int) -> dict:
    pages_so, fake_so = libraries
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=str(pages_so),  # as launch_env.preload gives a Python kernel with fast_park on
        GQX_PAGES_LIBCUDA=str(fake_so),
        GQX_PAGES_CHUNK_BYTES=str(MiB),
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
    )
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    done = subprocess.run(
        [sys.executable, "-c", KERNEL, str(arena)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_preloaded_kernel_says_its_facts_parks_waits_for_room_and_comes_back_whole(libraries):
    size = 6 * MiB + 123
    out = run_kernel(libraries, arena=8 * MiB)

    # Before torch uses CUDA: the library is there, nothing is asked of the driver, nothing is served.
    before = out["before_torch"]
    assert before["preloaded"] is True and before["torch_cuda"] is False
    assert before["served_bytes"] == 0 and before["library_problem"] is None

    facts = out["facts"]
    assert set(facts) == set(fast_park.FACTS)
    assert facts["torch_cuda"] is True and facts["allocator_backend"] == "native"
    assert facts["served_bytes"] == size and facts["arena_bytes"] == 0 and facts["state"] == "running"
    assert facts["library_problem"] is None and facts["expandable_segments"] is False

    # An arena smaller than what the kernel holds is refused before anything moves.
    assert out["small_arena"]["code"] == fast_park.E_ARENA

    park = out["park"]
    assert park["code"] == 0, park
    assert park["bytes"] == size and park["seconds"] >= 0 and park["arena_seconds"] >= 0
    assert out["parked_here"] and out["maybe_parked"]  # its next cell asks the server before it runs
    assert out["used_while_parked"] == 0
    assert out["facts_parked"]["state"] == "parked" and out["facts_parked"]["arena_bytes"] >= 8 * MiB

    refused = out["resume_without_room"]
    assert refused["code"] == 2 and "CUDA_ERROR_OUT_OF_MEMORY" in refused["message"]
    assert out["state_after_refusal"] == "parked"

    # The arena holds the kernel's memory while parked: it is not given back then.
    assert out["release_while_parked"]["code"] == fast_park.E_STATE
    assert "parked" in out["release_while_parked"]["message"]

    resumed = out["resume"]
    assert resumed["code"] == 0 and resumed["bytes"] == size and resumed["arena_kept"] is True
    assert out["exact"] is True
    assert out["facts_kept"]["state"] == "running" and out["facts_kept"]["arena_bytes"] >= 8 * MiB
    # Running, its kept arena is given back when the server asks (a park elsewhere needs the host's memory).
    released = out["release"]
    assert released["code"] == 0 and released["bytes"] == out["facts_kept"]["arena_bytes"]
    assert out["facts_released"]["arena_bytes"] == 0

    # A park makes its arena again; a resume told not to keep it gives it back at once.
    assert out["park_again"]["code"] == 0 and out["park_again"]["arena_seconds"] > 0
    assert out["resume_not_kept"]["code"] == 0 and out["resume_not_kept"]["arena_kept"] is False
    assert out["exact_again"] is True
    assert out["facts_after"]["state"] == "running" and out["facts_after"]["arena_bytes"] == 0


def test_without_the_library_a_park_is_refused_and_facts_say_so():
    if fast_park.pages() is not None:
        pytest.skip("this test process preloads the library")
    assert fast_park.facts()["preloaded"] is False
    assert fast_park.park({"arena": 1})["code"] == fast_park.E_STATE
    assert fast_park.resume({})["code"] == fast_park.E_STATE
    assert fast_park.parked_here() is False


@pytest.mark.parametrize(
    "environ, on",
    [
        ({}, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments : true"}, True),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, False),
        ({"PYTORCH_ALLOC_CONF": "backend:native,expandable_segments:True"}, True),
    ],
)
def test_expandable_segments_are_read_from_either_setting(environ, on):
    assert fast_park.expandable_segments(environ) is on


# --- a swap's options (release_as_copied, wait_for_room), with the library's wrapper played by a stand-in -----------
# The library itself is the lead's (tests/unit/test_fast_park.py); here: what the kernel's side asks of its wrapper,
# what it refuses before asking, and what it answers. PagesError is the real wrapper's.

PagesError = fast_park._pages_module().PagesError


class StandInArena:
    def __init__(self, size: int):
        self.size, self.handle = size, 1
        self.populate_seconds = self.register_seconds = 0.0

    def close(self) -> None:
        self.handle = 0


class SwapPages:
    """The wrapper's calls a park and a resume make: what each call was given, and a failure to raise."""

    def __init__(self, fails: object = None):
        self.calls: list = []
        self.fails = fails
        self._state = "running"

    def state(self) -> str:
        return self._state

    def mapped_bytes(self) -> int:
        return 6 * MiB

    def arena(self, size: int) -> StandInArena:
        return StandInArena(size)

    def park(self, arena, release_as_copied: bool = False) -> None:
        self.calls.append(("park", release_as_copied))
        self._state = "parked"
        if self.fails is not None:
            raise self.fails

    def resume(self, wait_for_room: float = 0.0) -> None:
        self.calls.append(("resume", wait_for_room))
        if self.fails is not None:
            raise self.fails
        self._state = "running"

    def resume_waited_seconds(self) -> float:
        return 0.25 if any(wait for call, wait in self.calls if call == "resume") else 0.0


@pytest.fixture
def stand_in(monkeypatch):
    def use(pages: SwapPages) -> SwapPages:
        monkeypatch.setattr(fast_park, "_pages", pages)
        monkeypatch.setattr(fast_park, "_arena", None)
        return pages

    return use


def test_a_park_asked_to_release_as_it_copies_asks_the_library_so_and_says_it_did(stand_in):
    lib = stand_in(SwapPages())
    answer = fast_park.park({"arena": 8 * MiB, "release_as_copied": True})
    assert answer["code"] == 0 and answer["released_as_copied"] is True, answer
    assert lib.calls == [("park", True)]


def test_a_park_not_asked_to_release_as_it_copies_calls_the_library_as_before(stand_in):
    lib = stand_in(SwapPages())
    assert fast_park.park({"arena": 8 * MiB})["released_as_copied"] is False
    lib._state = "running"
    assert fast_park.park({"arena": 8 * MiB, "release_as_copied": None})["released_as_copied"] is False
    assert lib.calls == [("park", False), ("park", False)]


def test_a_resume_says_how_long_it_waited_for_room_of_its_seconds(stand_in):
    stand_in(SwapPages())
    assert fast_park.resume({})["waited"] == 0.0
    assert fast_park.resume({"wait_for_room": 5.0})["waited"] == 0.25  # what the library measured


def test_a_park_that_ended_parked_in_part_answers_so_with_the_librarys_words(stand_in):
    partial = PagesError("gqx_park", fast_park.E_PARTIAL, "piece 3 of 7 not copied: CUDA_ERROR_ILLEGAL_ADDRESS")
    lib = stand_in(SwapPages(fails=partial))
    answer = fast_park.park({"arena": 8 * MiB, "release_as_copied": True})
    assert answer["code"] == fast_park.E_PARTIAL == -6
    assert answer["message"] == "piece 3 of 7 not copied: CUDA_ERROR_ILLEGAL_ADDRESS"
    assert lib.state() == "parked" and fast_park.parked_here()  # no GPU work until a resume


def test_a_resume_waits_as_long_as_asked_and_no_longer_than_half_the_requests_timeout(stand_in):
    lib = stand_in(SwapPages())
    assert fast_park.resume({"wait_for_room": 7.5, "timeout": 60})["code"] == 0
    assert fast_park.resume({"wait_for_room": 10**9, "timeout": 60})["code"] == 0
    assert fast_park.resume({"wait_for_room": 10**400})["code"] == 0  # JSON's integers have no bound
    assert fast_park.resume({"wait_for_room": 0})["code"] == 0
    assert fast_park.resume({"wait_for_room": None})["code"] == 0
    assert fast_park.resume({})["code"] == 0
    waits = [wait for _, wait in lib.calls]
    assert waits == [7.5, 30.0, fast_park.DEFAULT_TIMEOUT / 2, 0.0, 0.0, 0.0]
    assert all(type(wait) is float for wait in waits)


@pytest.mark.parametrize("timeout", [10**400, 1e300, 2 * fast_park.MAX_TIMEOUT])
def test_a_timeout_beyond_a_day_is_cut_to_a_day_and_the_call_still_answers(stand_in, timeout):
    lib = stand_in(SwapPages())
    assert fast_park._timeout({"timeout": timeout}) == fast_park.MAX_TIMEOUT
    assert fast_park.resume({"wait_for_room": 10**400, "timeout": timeout})["code"] == 0
    assert lib.calls == [("resume", fast_park.MAX_TIMEOUT / 2)]


def test_a_resume_whose_wait_ran_out_answers_the_drivers_out_of_memory(stand_in):
    lib = stand_in(SwapPages(fails=PagesError("gqx_resume", 2, "no memory came free within 30 s")))
    lib._state = "parked"
    answer = fast_park.resume({"wait_for_room": 30.0})
    assert answer["code"] == 2 and "no memory came free" in answer["message"]
    assert lib.state() == "parked"


@pytest.mark.parametrize("value", [True, False, -1, -0.5, float("nan"), float("inf"), float("-inf"), "5", [1], {}])
def test_a_bad_wait_for_room_is_refused_before_the_library_is_asked(stand_in, value):
    lib = stand_in(SwapPages())
    answer = fast_park.resume({"wait_for_room": value})
    assert answer["code"] == fast_park.E_REQUEST and "wait_for_room" in answer["message"], answer
    assert lib.calls == []


@pytest.mark.parametrize("value", [1, 0, "yes", "false", [True]])
def test_a_release_as_copied_that_is_not_a_bool_is_refused_before_anything_moves(stand_in, value):
    lib = stand_in(SwapPages())
    answer = fast_park.park({"arena": 8 * MiB, "release_as_copied": value})
    assert answer["code"] == fast_park.E_REQUEST and "release_as_copied" in answer["message"], answer
    assert lib.calls == [] and fast_park._arena is None
