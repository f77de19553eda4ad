"""Compiling pages.c with the system's C compiler, into a cache folder at first use or on request.

The library is small and has no dependency but the C library (no CUDA headers: it declares the driver calls it
uses and opens libcuda.so.1 itself), so it is built where it runs instead of shipped: a wheel stays pure Python.
The cache folder's name carries a hash of the source and the flags, so an edited source builds afresh and an
unchanged one is compiled once per machine. A machine without a compiler (the GPU machine may have none) gets
the library built elsewhere: `python -m gpu_quota_ext.parking.pages.build --out DIR`, then DIR copied over.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

SOURCE = Path(__file__).with_name("pages.c")
LIBRARY_NAME = "libgqx_pages.so"
FLAGS = ("-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC")
LIBS = ("-ldl", "-lpthread")


class BuildError(Exception):
    """The library could not be built; the message says why and what to do."""


def compiler() -> str:
    """The C compiler: $CC, else `cc` on PATH."""
    name = os.environ.get("CC") or "cc"
    found = shutil.which(name)
    if not found:
        raise BuildError(
            f"no C compiler ({name!r} is not on PATH): install one (Debian/Ubuntu: apt-get install gcc), or build "
            "on another machine with `python -m gpu_quota_ext.parking.pages.build --out DIR` and copy DIR here"
        )
    return found


def compile_shared(source: Path, out: Path, flags: Sequence[str] = FLAGS, libs: Sequence[str] = LIBS) -> Path:
    """`source` compiled into the shared library `out` (written under another name, then renamed, so that a
    reader never sees half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=out.name + ".", suffix=".partial", dir=out.parent)
    os.close(fd)
    try:
        command = [compiler(), *flags, "-o", partial, str(source), *libs]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise BuildError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr.strip()}")
        os.replace(partial, out)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return out


def build(out_dir: os.PathLike) -> Path:
    """The library compiled into `out_dir`; its path."""
    return compile_shared(SOURCE, Path(out_dir) / LIBRARY_NAME)


def source_hash() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(FLAGS + LIBS).encode())
    return digest.hexdigest()[:16]


def cache_dir(cache_home: Optional[Path] = None) -> Path:
    """Where built libraries are kept: cache_home, else $XDG_CACHE_HOME, else ~/.cache, then
    gpu-quota-ext/pages/<source hash>."""
    base = Path(cache_home or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "gpu-quota-ext" / "pages" / source_hash()


def library(rebuild: bool = False, folder: Optional[Path] = None) -> Path:
    """The built library's path, compiled first when this source has not been built here yet."""
    path = (folder or cache_dir()) / LIBRARY_NAME
    if rebuild or not path.exists():
        build(path.parent)
    return path


def preload_library(folder: Optional[Path] = None) -> Optional[str]:
    """The library for kernels' LD_PRELOAD, built into the cache folder where it is not there yet; None (said
    once, as a warning, by the caller's one call) when it cannot be built: every kernel then parks through the
    driver's checkpoint calls. Blocking (a compile takes about a second): call it off the event loop."""
    try:
        return str(library(folder=folder))
    except (BuildError, OSError, subprocess.SubprocessError) as error:
        logging.getLogger("gpu_quota_ext").warning(
            "gpu-quota-ext: fast_park is on, but the fast park library could not be built, so every kernel parks "
            "through the driver's checkpoint calls: %s", error,
        )
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Build the fast park library (pages.c).")
    parser.add_argument("--out", help="folder to build into (default: the cache folder)")
    parser.add_argument("--rebuild", action="store_true", help="build even when a library is cached")
    args = parser.parse_args(argv)
    try:
        path = build(args.out) if args.out else library(rebuild=args.rebuild)
    except BuildError as error:
        print(error)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
