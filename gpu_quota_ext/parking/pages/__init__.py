"""The fast park path: a torch kernel's device allocations served from CUDA virtual memory by a small C
library loaded with LD_PRELOAD (pages.c), so that a park copies its pages to one pinned host arena at the
link's speed and a resume maps them back at the same addresses. build.py compiles the library (stdlib only,
imported on its own); this module calls it, from inside the process that preloaded it (`Pages.in_process()`),
or from a test that loaded it directly (`Pages.load(path)`).

docs/admin/fast-park.md says why cudaMalloc/cudaFree is the seam and what stays on the device.
"""

from __future__ import annotations

import ctypes
from typing import Optional

__all__ = ["Arena", "Pages", "PagesError", "E_PARTIAL"]

# gqx_state() values (pages.c)
RUNNING, PARKING, PARKED, RESUMING = 0, 1, 2, 3
STATE_NAMES = {RUNNING: "running", PARKING: "parking", PARKED: "parked", RESUMING: "resuming"}

# The library's own codes; a positive code is the driver's CUresult.
E_STATE, E_ARENA, E_DRIVER, E_HOST, E_CONTEXT = -1, -2, -3, -4, -5
E_PARTIAL = -6  # a park that released as it copied failed midway: parked in part, a resume brings it all back
WAIT_CEILING = 3600.0  # seconds: a resume's wait for room is bounded; more than an hour is a caller's mistake
CODE_NAMES = {
    E_STATE: "state",
    E_ARENA: "arena",
    E_DRIVER: "driver",
    E_HOST: "host memory",
    E_CONTEXT: "no context",
    E_PARTIAL: "parked in part",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
}


class PagesError(Exception):
    """A park, resume or arena call failed; `code` is the library's or the driver's, and the process is as
    it was before the call (a park that could not release every mapping says so, and is parked; a park that
    released as it copied and failed midway is parked in part: E_PARTIAL)."""

    def __init__(self, call: str, code: int, message: str):
        self.call, self.code, self.message = call, code, message
        super().__init__(f"{call} failed ({CODE_NAMES.get(code, code)}): {message}")


class Arena:
    """Pinned host memory that holds a parked process's bytes; made once, reused by every park."""

    def __init__(self, pages: "Pages", handle: int):
        self._pages, self.handle = pages, handle
        lib = pages.lib
        self.size = int(lib.gqx_arena_size(handle))
        self.populate_seconds = float(lib.gqx_arena_populate_seconds(handle))
        self.register_seconds = float(lib.gqx_arena_register_seconds(handle))

    def close(self) -> None:
        """Unpin and free it; refused while it holds a parked process's bytes."""
        if self.handle:
            self._pages._check("gqx_arena_destroy", self._pages.lib.gqx_arena_destroy(self.handle))
            self.handle = 0


class Pages:
    """The library's calls. Blocking (a park or resume takes as long as its copy): call from a thread that
    the process can spare, never while the process runs GPU work of its own."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        for name, restype in (
            ("gqx_park", ctypes.c_int),
            ("gqx_resume", ctypes.c_int),
            ("gqx_active", ctypes.c_int),
            ("gqx_state", ctypes.c_int),
            ("gqx_arena_create", ctypes.c_int),
            ("gqx_arena_destroy", ctypes.c_int),
            ("gqx_arena_size", ctypes.c_ulonglong),
            ("gqx_arena_populate_seconds", ctypes.c_double),
            ("gqx_arena_register_seconds", ctypes.c_double),
            ("gqx_resident_bytes", ctypes.c_ulonglong),
            ("gqx_mapped_bytes", ctypes.c_ulonglong),
            ("gqx_passthrough_bytes", ctypes.c_ulonglong),
            ("gqx_mapping_count", ctypes.c_ulonglong),
            ("gqx_last_error", ctypes.c_char_p),
            ("gqx_resume_waited_seconds", ctypes.c_double),
        ):
            getattr(lib, name).restype = restype
        lib.gqx_park.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.gqx_resume.argtypes = [ctypes.c_ulonglong]
        lib.gqx_arena_create.argtypes = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
        for name in ("gqx_arena_destroy", "gqx_arena_size", "gqx_arena_populate_seconds", "gqx_arena_register_seconds"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]

    @classmethod
    def load(cls, path: str) -> "Pages":
        return cls(ctypes.CDLL(path))

    @classmethod
    def in_process(cls) -> Optional["Pages"]:
        """The library this process preloaded, or None when it runs without it."""
        lib = ctypes.CDLL(None)
        return cls(lib) if hasattr(lib, "gqx_park") else None

    def _check(self, call: str, code: int) -> None:
        if code != 0:
            raise PagesError(call, code, self.last_error())

    def last_error(self) -> str:
        return (self.lib.gqx_last_error() or b"").decode(errors="replace")

    def active(self) -> bool:
        """Allocations are served here (the driver opened); False: they pass through and nothing parks."""
        return bool(self.lib.gqx_active())

    def state(self) -> str:
        return STATE_NAMES.get(self.lib.gqx_state(), "unknown")

    def mapped_bytes(self) -> int:
        """What a park moves: the arena must hold at least this."""
        return int(self.lib.gqx_mapped_bytes())

    def resident_bytes(self) -> int:
        return int(self.lib.gqx_resident_bytes())

    def passthrough_bytes(self) -> int:
        """Served by libcudart instead: they stay on the device through a park."""
        return int(self.lib.gqx_passthrough_bytes())

    def resume_waited_seconds(self) -> float:
        """Seconds the last resume waited for device memory that a park elsewhere was freeing (0: none)."""
        return float(self.lib.gqx_resume_waited_seconds())

    def mapping_count(self) -> int:
        return int(self.lib.gqx_mapping_count())

    def arena(self, size: int) -> Arena:
        """Pinned host memory of at least `size` bytes (seconds: populating and pinning, kept on the Arena)."""
        handle = ctypes.c_void_p()
        self._check("gqx_arena_create", self.lib.gqx_arena_create(int(size), ctypes.byref(handle)))
        return Arena(self, handle.value)

    def park(self, arena: Arena, release_as_copied: bool = False) -> None:
        """Every mapped byte into the arena, then the device memory released; `release_as_copied`: each 2 GiB
        piece released as soon as its bytes are in the arena (a resume elsewhere can take it at once)."""
        self._check("gqx_park", self.lib.gqx_park(arena.handle, 1 if release_as_copied else 0))

    def resume(self, wait_for_room: float = 0.0) -> None:
        """Every parked byte back at its address; `wait_for_room`: seconds, in all, that it waits for device
        memory a park under way is releasing (0: none). Run out, it gives back what it took and stays parked."""
        if isinstance(wait_for_room, bool) or not isinstance(wait_for_room, (int, float)):
            raise ValueError(f"wait_for_room must be seconds, not {wait_for_room!r}")
        if not 0.0 <= wait_for_room <= WAIT_CEILING:  # NaN fails both comparisons
            raise ValueError(f"wait_for_room must be between 0 and {WAIT_CEILING:g} seconds, not {wait_for_room!r}")
        self._check("gqx_resume", self.lib.gqx_resume(int(wait_for_room * 1000)))
