"""The stand-in `%gpucap` and its one cell hook, registered at kernel start in place of the full magic.

The full magic (policy parsing, the HTTP client, allocator readings, the panel) costs 30 to 60 ms of
imports, on every kernel start. Here a stand-in magic and one cheap post_run_cell hook load it at its
first use: when the user types `%gpucap`, when a cell fails (it may be an out-of-memory error to
explain), or once torch has started CUDA (there is allocator usage to report). Until then, after each
cell it only starts the background check for caps changed outside the kernel (sync.py). Standard
library only.
"""

from __future__ import annotations

import sys

from .help import DOCSTRING


def _cuda_started() -> bool:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:  # broad: a half-imported or unusual torch: taken as not started
        return False


class GpuCapStub:
    """Stands in for magic.GpuCap until the first `%gpucap`, failed cell or CUDA start, then loads it."""

    def __init__(self, shell):
        self.shell = shell

    def register(self) -> None:
        self.shell.register_magic_function(self.magic, "line", "gpucap")
        self.shell.events.register("post_run_cell", self.post_run_cell)

    def unregister(self) -> None:
        try:
            self.shell.events.unregister("post_run_cell", self.post_run_cell)
        except ValueError:
            pass

    def controller(self):
        """The full magic, loaded now (it registers the real `%gpucap` and hooks in place of ours)."""
        self.unregister()
        magic = sys.modules.get("gpu_quota_ext.kernel.magic")
        if magic is not None and magic._loaded:  # `%load_ext gpu_quota_ext` already loaded it
            return None
        from .magic import load

        return load(self.shell)

    def magic(self, line: str = "") -> None:
        controller = self.controller()
        if controller is not None:
            controller.magic(line)
        else:
            self.shell.run_line_magic("gpucap", line)

    magic.__doc__ = DOCSTRING  # what `%gpucap?` shows before the full magic is loaded
    # IPython's @no_var_expand (the attribute it sets; IPython is not imported here): `%gpucap` never expands
    # $names or {expressions} in its argument, which cost 80 s for a 100,000-character one.
    magic._ipython_magic_no_var_expand = True  # type: ignore[attr-defined]

    def post_run_cell(self, result=None) -> None:
        from . import state

        state.tell_once(state.STATE)  # what the kernel's start has to say, after the first cell
        failed = getattr(result, "error_in_exec", None) is not None
        if not (failed or _cuda_started()):
            from . import sync

            sync.after_cell(state.STATE)  # a cap changed from the sidebar arrives here
            return
        controller = self.controller()
        # IPython runs the hooks of this event from a copy of its list: the new controller's own hook
        # starts with the next cell, so this cell is handed to it here.
        if controller is not None:
            controller.post_run_cell(result)


def register(shell) -> GpuCapStub:
    stand_in = GpuCapStub(shell)
    stand_in.register()
    return stand_in
