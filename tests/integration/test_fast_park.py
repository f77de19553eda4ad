"""fast_park on, through a real jupyter_server with real kernels (issue 29): the kernel starts with the fast park
library in LD_PRELOAD (built into the cache folder at its first launch); a kernel without torch on the GPU parks
through the checkpoint calls (faked: gpu_quota_ext.parking.fake_checkpoint) and its status says why; a kernel
whose allocations the library serves (over the tests' fake CUDA driver, torch a stand-in that says CUDA is in
use) parks through the library, its status says "pages" and what stays on the device, and its next cell brings
every byte back. The GPU itself: tests/gpu/test_fast_park_gpu.py."""

import pytest

from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
from gpu_quota_ext.parking.pages import build as pages_build
from gpu_quota_ext.shared.sizes import GiB
from tests.fake_cuda import build_fake

from .fake_gpu import fake_gpu_config, manager_of
from .kernels import execute, start_kernel
from .test_park import FAKE_DRIVER, calls, holding_gpu, post, wait_state

WAIT = 30.0
MiB = 1 << 20
CONTEXT = 600 * MiB  # what the fake NVML says the kernel's CUDA context holds, beside the library's bytes


@pytest.fixture
def cache(tmp_path_factory, monkeypatch):
    """The server's cache folder (the library is built there at the first launch) and the fake CUDA driver that
    the library opens in the kernels instead of libcuda (the kernels inherit the server's environment)."""
    folder = tmp_path_factory.mktemp("fast_park_server")
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder / "cache"))
    monkeypatch.setenv("GQX_PAGES_LIBCUDA", str(build_fake(folder)))
    monkeypatch.setenv("GQX_PAGES_CHUNK_BYTES", str(MiB))
    return folder / "cache"


@pytest.fixture
def jp_server_config(cache):
    return fake_gpu_config("warn", checkpoint_class=FAKE_DRIVER, fast_park="on")


async def test_a_kernel_without_torch_on_the_gpu_takes_the_checkpoint_path_and_says_why(
    jp_fetch, jp_serverapp, fake_driver, cache
):
    kernel_id = await start_kernel(jp_fetch)
    library = pages_build.cache_dir() / pages_build.LIBRARY_NAME
    assert library.exists() and str(library).startswith(str(cache))
    preloaded = await execute(jp_serverapp, kernel_id, "import os; print(os.environ.get('LD_PRELOAD'))")
    assert preloaded.strip().split(":")[0] == str(library)
    pid = await holding_gpu(jp_serverapp, kernel_id)  # NVML sees it hold 2 GiB: CuPy's, say

    code, _ = await post(jp_fetch, kernel_id, "park")
    assert code == 202
    parked = await wait_state(jp_fetch, kernel_id, "parked")
    assert parked["path"]["path"] == "checkpoint"
    assert "no torch on the GPU" in parked["path"]["reason"]
    assert parked["host_bytes"] == 2 * GiB and parked["path"]["stays_on_device"] == 0
    assert calls("cuCheckpointProcessCheckpoint") == [pid]

    assert (await execute(jp_serverapp, kernel_id, "print(6 * 7)")).strip() == "42"
    back = await wait_state(jp_fetch, kernel_id, "idle", "busy")
    assert back["path"]["path"] == "checkpoint"  # the last park's, said until the next one


SERVED = 6 * MiB + 123
HOLD = f"""
import ctypes, os, sys, types
sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(
    is_initialized=lambda: True, get_allocator_backend=lambda: "native"))
lib = ctypes.CDLL(None)
lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
pointer = ctypes.c_void_p()
assert lib.cudaMalloc(ctypes.byref(pointer), {SERVED}) == 0
data = os.urandom({SERVED})
ctypes.memmove(pointer.value, data, {SERVED})
print(pointer.value)
"""


async def test_a_kernel_whose_memory_the_library_serves_parks_its_pages_and_its_next_cell_brings_them_back(
    jp_fetch, jp_serverapp, fake_driver, cache
):
    kernel_id = await start_kernel(jp_fetch)
    assert int((await execute(jp_serverapp, kernel_id, HOLD)).strip())
    pid = await holding_gpu(jp_serverapp, kernel_id, SERVED + CONTEXT)

    code, _ = await post(jp_fetch, kernel_id, "park")
    assert code == 202
    parked = await wait_state(jp_fetch, kernel_id, "parked")
    path = parked["path"]
    assert path["path"] == "pages", path
    assert path["stays_on_device"] == CONTEXT and isinstance(path["park_seconds"], float)
    assert parked["host_bytes"] == SERVED
    assert FakeCheckpoint.calls == []  # not the driver's checkpoint calls
    # The fake driver under the library is the kernel's own (in its process); the fake NVML is told what stays.
    FakeNvml.set_usage(pid, f"static-{manager_of(jp_serverapp).ledger.get(kernel_id).devices[0]}", CONTEXT)

    back = await execute(jp_serverapp, kernel_id, "print(ctypes.string_at(pointer.value, len(data)) == data)")
    assert back.strip() == "True"
    resumed = await wait_state(jp_fetch, kernel_id, "idle", "busy")
    assert resumed["path"]["path"] == "pages" and isinstance(resumed["path"]["resume_seconds"], float)
