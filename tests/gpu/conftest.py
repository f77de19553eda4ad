"""GPU checks: run on a real NVIDIA GPU (the device machine), skipped everywhere else.

    python -m pytest tests/gpu -m gpu -s       # what tests/gpu/run_on_device.sh runs
Each test prints `FIGURE name = value` lines; the runner collects them into benchmarks/results/.
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from gpu_quota_ext.parking.pages import build as pages_build

REPO = Path(__file__).resolve().parents[2]


def _cuda_available() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(
        reason="needs an NVIDIA GPU with a driver (run tests/gpu/run_on_device.sh on the device machine)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


FIGURES_FILE = os.environ.get("GPU_QUOTA_FIGURES", "")


def gpu_count() -> int:
    """How many GPUs NVML sees here (0 without a driver): the two-GPU checks skip below two."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except Exception:
        return 0


def record(name: str, value) -> None:
    """Print a measured figure and append it to $GPU_QUOTA_FIGURES (JSON lines) when set."""
    print(f"FIGURE {name} = {value}", flush=True)
    if FIGURES_FILE:
        with open(FIGURES_FILE, "a") as out:
            out.write(json.dumps({"name": name, "value": value}) + "\n")


def nvml_used_by_pid() -> dict:
    """pid -> bytes of device memory NVML sees, over every GPU."""
    import pynvml

    pynvml.nvmlInit()
    used = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            used[process.pid] = used.get(process.pid, 0) + (process.usedGpuMemory or 0)
    return used


def kernel_pid(serverapp, kernel_id: str) -> int:
    km = serverapp.kernel_manager.get_kernel(kernel_id)
    return km.provisioner.pid


@pytest.fixture(autouse=True)
def fast_park_library(tmp_path_factory, monkeypatch):
    """The server's cache folder, a temporary one, holding the library where this machine cannot compile it. For
    every GPU check: fast_park is "auto" by default, so every Python kernel a check starts preloads it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("fast_park_cache")))
    target = pages_build.cache_dir() / pages_build.LIBRARY_NAME
    given = os.environ.get("GQX_PAGES_LIBRARY") or str(REPO / ".probe" / pages_build.LIBRARY_NAME)
    if Path(given).exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(given, target)
    else:
        try:
            pages_build.build(target.parent)
        except pages_build.BuildError as error:
            pytest.fail(f"no fast park library: set GQX_PAGES_LIBRARY to one built elsewhere ({error})")
    return target
