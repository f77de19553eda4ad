"""The launch with fast_park on (docs/admin/fast-park.md, "How it plugs into the parker"): a Python kernel starts
with the fast park library first in LD_PRELOAD (what its kernelspec preloads kept after it), built once per
server into the cache folder; a build that fails is one warning, and every kernel starts without it (it parks
through the checkpoint calls); other kernels, and every kernel with fast_park off, start as before."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.launch_env import preload
from gpu_quota_ext.ledger.local import LocalLedger
from gpu_quota_ext.manager import GpuQuotaManager
from gpu_quota_ext.parking import ParkSettings
from gpu_quota_ext.parking.pages import build as pages_build
from gpu_quota_ext.policy import build_policy
from gpu_quota_ext.shared.sizes import GiB

DEVICES = [Device(0, "H200", "GPU-0000aaaa-uuid", 140 * GiB, nvml_index=0)]
PYTHON = ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"]
BASH = ["python", "-m", "bash_kernel", "-f", "{connection_file}"]


def test_the_library_comes_first_and_the_kernelspecs_preloads_stay():
    assert preload({}, "/c/libgqx_pages.so") == {"LD_PRELOAD": "/c/libgqx_pages.so"}
    assert preload({"LD_PRELOAD": "/a.so /b.so"}, "/c/l.so") == {"LD_PRELOAD": "/c/l.so:/a.so:/b.so"}
    assert preload({"LD_PRELOAD": "/c/l.so:/a.so"}, "/c/l.so") == {"LD_PRELOAD": "/c/l.so:/a.so"}  # not twice


def manager(fast_park: str) -> GpuQuotaManager:
    policy = build_policy("0.25", "0.5")
    return GpuQuotaManager(
        policy, DEVICES, LocalLedger(DEVICES, policy), None, FakeNvml(), user="u",
        park_settings=ParkSettings(fast_park=fast_park),
    )


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def admit_all(service, *starts):
    async def main():
        return [
            await service.admit(f"k{n}", "spec", argv, env, language=language)
            for n, (argv, env, language) in enumerate(starts)
        ]

    return asyncio.run(main())


def test_with_fast_park_on_python_kernels_preload_the_library_built_once(cache, monkeypatch):
    builds = []
    real = pages_build.build
    monkeypatch.setattr(pages_build, "build", lambda folder: builds.append(folder) or real(folder))
    python, other, second = admit_all(
        manager("on"),
        (PYTHON, {"LD_PRELOAD": "/opt/mine.so"}, "python"),
        (BASH, {}, "bash"),
        (PYTHON, {}, "python"),
    )
    library = pages_build.cache_dir() / pages_build.LIBRARY_NAME
    assert str(library).startswith(str(cache)) and library.exists()
    assert python["LD_PRELOAD"] == f"{library}:/opt/mine.so"
    assert second["LD_PRELOAD"] == str(library)
    assert "LD_PRELOAD" not in other  # its bootstrap does not run: it could never answer a fast park
    assert len(builds) == 1


def test_a_failed_build_is_one_warning_and_kernels_start_without_the_library(cache, monkeypatch, caplog):
    def broken(folder):
        raise pages_build.BuildError("no C compiler ('cc' is not on PATH)")

    monkeypatch.setattr(pages_build, "build", broken)
    with caplog.at_level(logging.WARNING, logger="gpu_quota_ext"):
        first, second = admit_all(manager("on"), (PYTHON, {}, "python"), (PYTHON, {}, "python"))
    assert "LD_PRELOAD" not in first and "LD_PRELOAD" not in second
    warnings = [r.getMessage() for r in caplog.records if "fast park library could not be built" in r.getMessage()]
    assert len(warnings) == 1 and "no C compiler" in warnings[0] and "checkpoint calls" in warnings[0]


def test_with_fast_park_off_nothing_is_built_and_nothing_preloaded(cache, monkeypatch):
    monkeypatch.setattr(pages_build, "build", lambda folder: pytest.fail("built with fast_park off"))
    (env,) = admit_all(manager("off"), (PYTHON, {"LD_PRELOAD": "/opt/mine.so"}, "python"))
    assert "LD_PRELOAD" not in env  # the kernelspec's own stays as it was, untouched
