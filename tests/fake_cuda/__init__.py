"""A fake CUDA driver (fake_cuda.c) over host memory, compiled by the tests that need it: the fast park
library's real code runs against it on machines without a GPU. `build_fake(folder)` returns its path.

fake_cudart.c stands for libcudart: `build_pages_over_fake_runtime(folder)` builds the library linked to it, so
that what the library passes through to "the runtime after it" lands there (in a kernel, LD_PRELOAD puts the
library before the real libcudart; a library opened by a test finds only its own dependencies after it)."""

from __future__ import annotations

from pathlib import Path

from gpu_quota_ext.parking.pages.build import FLAGS, LIBRARY_NAME, LIBS, compile_shared
from gpu_quota_ext.parking.pages.build import SOURCE as PAGES_SOURCE

SOURCE = Path(__file__).with_name("fake_cuda.c")
RUNTIME_SOURCE = Path(__file__).with_name("fake_cudart.c")


def build_fake(folder: Path) -> Path:
    """The fake compiled into `folder`, opened by its path. Not named (nor sonamed) libcuda.so.1: loaded into the
    test process under that soname, every later dlopen("libcuda.so.1") there (the checkpoint driver's, in other
    tests) would get the fake instead of the machine's answer."""
    name = "libgqxfakecuda.so.1"
    return compile_shared(SOURCE, Path(folder) / name, flags=(*FLAGS, f"-Wl,-soname,{name}"), libs=())


def build_pages_over_fake_runtime(folder: Path) -> Path:
    """The fast park library linked to the fake libcudart (both in `folder`, found there by rpath)."""
    folder = Path(folder)
    compile_shared(RUNTIME_SOURCE, folder / "libgqxfakecudart.so", libs=())
    flags = (*FLAGS, f"-L{folder}", f"-Wl,-rpath,{folder}")
    return compile_shared(
        PAGES_SOURCE, folder / LIBRARY_NAME, flags=flags, libs=(*LIBS, "-Wl,--no-as-needed", "-lgqxfakecudart")
    )
