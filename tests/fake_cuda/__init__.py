"""A fake CUDA driver (fake_cuda.c) over host memory, compiled by the tests that need it: the fast park
library's real code runs against it on machines without a GPU. `build_fake(folder)` returns its path."""

from __future__ import annotations

from pathlib import Path

from gpu_quota_ext.parking.pages.build import FLAGS, compile_shared

SOURCE = Path(__file__).with_name("fake_cuda.c")


def build_fake(folder: Path) -> Path:
    """The fake compiled into `folder` as libcuda.so.1 (its soname too, as the real one's)."""
    return compile_shared(SOURCE, Path(folder) / "libcuda.so.1", flags=(*FLAGS, "-Wl,-soname,libcuda.so.1"), libs=())
