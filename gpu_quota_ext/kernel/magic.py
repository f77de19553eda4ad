"""`%gpucap`: show this kernel's caps and usage, ask the server for another cap, park or resume this
kernel, open the usage panel.

Loaded in every kernel the server starts (the bootstrap loads the extension) and by
`%load_ext gpu_quota_ext` anywhere else; there, no server grants caps and the magic sets them locally.
Also hooks the cell cycle: OOM explanations, the opt-in per-cell report, usage reports to the server.

Stdlib only at import time (IPython is the caller; torch and ipywidgets are touched only when used).
An argument the magic cannot read is IPython's UsageError, as for IPython's own magics: one line
("UsageError: ..."), no traceback, and the cell ends with status "error", so a notebook run stops there.
Nothing else here raises into the user's cell: a refusal or a failure is one line of output.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

from ..shared.env_vars import KERNEL_ID
from ..shared.sizes import format_bytes
from . import state as state_module
from .cells import CellReporter
from .client import CapAnswer, QuotaClient
from .command import Command, CommandError, help_text, parse_command
from .help import DOCSTRING
from .layers import layer_line, restart_note
from .oom import explain_after_cell
from .park import PARK_ANNOUNCEMENT, RESUME_NOTE, refusal_text, state_words, table_line
from .reasons import no_gpu_reason, usage_unavailable_reason
from .state import tell_once
from .sync import after_cell
from .torch_cap import (
    apply_local_caps,
    cap_torch,
    cuda_torch,
    install_lazy_hook,
    put_caps_in_force,
)
from .usage import read_usage, report_to_server

PREFIX = "gpu-quota:"
NO_SERVER = (
    f"{PREFIX} no server started this kernel, so there is no server to ask: "
    "%gpucap sets caps locally here, and nobody checks them against a quota"
)


def headline(answer: CapAnswer) -> str:
    """The server's answer in one phrase, its outcome said once ("clamped to max_cap ...", not
    "clamped: clamped to max_cap ..."; "granted", not "granted: cap set to ..." before "cap now ...")."""
    message = answer.message.strip()
    if not message or message.startswith("cap set to "):
        return answer.outcome
    if message.lower().startswith(answer.outcome):
        return message
    return f"{answer.outcome}: {message}"


def format_table(state, readings: dict, unavailable: Optional[str] = None, park: Optional[dict] = None) -> str:
    """`%gpucap` with no arguments: one row per device, then what the user may ask for. `unavailable`:
    why the kernel's torch can read no usage (reasons.usage_unavailable_reason), if it cannot. `park`:
    the kernel's park state as the server sent it (PARK_FIELDS), if it sent one."""
    header = ("device", "cap", "allocated", "reserved", "peak", "device total", "cap set by")
    rows = []
    if state.devices:
        for d in sorted(state.devices, key=lambda d: d.ordinal):
            r = readings.get(d.ordinal)
            rows.append(
                (
                    f"cuda:{d.ordinal} (server GPU {d.index})",
                    format_bytes(d.cap),
                    format_bytes(r.allocated if r else None),
                    format_bytes(r.reserved if r else None),
                    format_bytes(r.peak if r else None),
                    format_bytes(d.total),
                    state.cap_source,
                )
            )
    else:
        for ordinal, r in sorted(readings.items()):
            spec = state.local_caps.get(ordinal, state.local_caps.get(None))
            cap = spec.to_bytes(r.total) if spec is not None and r.total else None
            rows.append(
                (
                    f"cuda:{ordinal}",
                    format_bytes(cap) if cap else "none",
                    format_bytes(r.allocated),
                    format_bytes(r.reserved),
                    format_bytes(r.peak),
                    format_bytes(r.total),
                    "this kernel (%gpucap)" if cap else "nobody",
                )
            )
    lines = []
    held_none = no_gpu_reason(state)
    if held_none:
        lines.append(f"{PREFIX} {held_none}")
    if rows:
        widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]
        for row in [header] + rows:
            lines.append("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    elif state.local_caps:
        lines.append(
            "caps set here: "
            + ", ".join(f"{'every device' if o is None else f'cuda:{o}'} {s}" for o, s in state.local_caps.items())
        )
    elif held_none:
        pass
    elif unavailable:
        lines.append(f"no device to show: {unavailable}")
    else:
        lines.append("no device to show yet: this kernel's torch has not started CUDA (no server started this kernel)")
    hard = layer_line(state)
    if hard:
        lines.append(hard)
    if state.devices:
        if not readings:
            lines.append(
                f"allocated/reserved/peak: not available: {unavailable}"
                if unavailable
                else "allocated/reserved/peak: '-' until this kernel's torch uses CUDA (the cap applies then)"
            )
        maxima = sorted({d.max_cap for d in state.devices})
        lines.append(
            "you may ask for up to "
            + ", ".join(format_bytes(m) for m in maxima)
            + " per device: %gpucap 0.3, %gpucap 12GiB"
        )
    parking = table_line(park)
    if parking:
        lines.append(parking)
    for problem in state.problems:
        lines.append(f"{PREFIX} problem: {problem}")
    return "\n".join(lines)


class GpuCap:
    """The magic and the cell hooks of one kernel."""

    def __init__(self, shell, state=None, client: Optional[QuotaClient] = None, env=None):
        self.shell = shell
        self.env = env if env is not None else os.environ  # where child processes inherit the cap from
        self.state = state if state is not None else state_module.STATE
        self.client = client if client is not None else (QuotaClient.from_environment() if self.state.managed else None)
        self.cells = CellReporter(self.state)
        self._report_this_cell = True  # False for the cell that switched the per-cell report on or off
        self.panels: list = []

    # --- %gpucap --------------------------------------------------------------------------------

    def magic(self, line: str = "") -> None:
        ordinals = [d.ordinal for d in self.state.devices] if self.state.managed else None
        try:
            command = parse_command(line, ordinals)
        except CommandError as error:
            from IPython.core.error import UsageError

            raise UsageError(str(error)) from None
        try:
            return self.run(command)
        except Exception as error:  # a bug of ours must not become the user's traceback
            self.error(f"%gpucap failed: {error!r}")
            return None

    magic.__doc__ = DOCSTRING  # what `%gpucap?` shows

    def run(self, command: Command):
        if command.action == "help":
            print(help_text())
        elif command.action == "show":
            self.state.told = True  # the table says what the first cell's notice would
            readings = read_usage([d.ordinal for d in self.state.devices] or None)
            print(format_table(self.state, readings, usage_unavailable_reason(), self.park_state()))
        elif command.action == "cells":
            self.cells.enabled = bool(command.cells)
            # The report starts with the next cell: this one began before it was on, and its report would
            # only be a second line saying that the line that switched it on used no GPU memory.
            self._report_this_cell = False
            print(f"{PREFIX} per-cell report {'on, from the next cell' if command.cells else 'off'}")
        elif command.action == "panel":
            return self.open_panel()
        elif command.action in ("park", "resume"):
            self.park_or_resume(command.action)
        elif not self.state.managed:
            self.change_locally(command)
        else:
            self.change_through_server(command)
        return None

    def open_panel(self):
        try:
            from .panel import GpuUsagePanel
        except ImportError:
            self.error("the usage panel needs ipywidgets in this kernel's environment: pip install ipywidgets")
            return None
        # One live panel per kernel: the new one replaces the one opened before (its thread stops, its
        # widgets close), so asking again and again never piles up threads.
        self.close_panels()
        try:
            panel = GpuUsagePanel(state=self.state, client=self.client)
        except ImportError:
            self.error("the usage panel needs ipywidgets in this kernel's environment: pip install ipywidgets")
            return None
        self.panels.append(panel)
        from IPython.display import display

        display(panel)
        return None

    def close_panels(self) -> None:
        while self.panels:
            self.panels.pop().close()

    # --- parking --------------------------------------------------------------------------------

    def park_state(self) -> Optional[dict]:
        """The server's park state for this kernel, or None (no server, no answer, a server that does not park)."""
        if self.client is None:
            return None
        try:
            return self.client.park_state()
        except Exception:  # the table must show even when this extra reading fails
            return None

    def park_or_resume(self, action: str) -> None:
        """Ask the server to park this kernel when the cell ends, or to resume it; say its answer once."""
        if not self.state.managed or self.client is None:
            self.error(
                f"cannot {action}: no server started this kernel (or gave it no address), so none can {action} it"
            )
            return
        answer = self.client.park() if action == "park" else self.client.resume()
        if answer.outcome == "refused":
            self.error(refusal_text(answer.message, action))
            return
        if answer.outcome != "accepted":
            self.error(answer.message)
            return
        park = answer.park or {}
        state = park.get("state")
        if park.get("parkable") is False:
            self.error(refusal_text(park.get("reason") or "not parkable", action))
        elif action == "park":
            if state in ("pending", "parking", "parked"):
                print(f"{PREFIX} {PARK_ANNOUNCEMENT}")
            else:  # accepted, yet the server will not park it (host memory short, ...): say why
                self.error(refusal_text(park.get("reason") or f"the server left it {state_words(park)}", action))
        elif state in ("parked", "parking", "resuming", "waiting"):
            print(f"{PREFIX} {state_words(park)}; {RESUME_NOTE}")
        else:
            print(f"{PREFIX} this kernel is not parked ({state_words(park)}); {RESUME_NOTE}")

    # --- changes --------------------------------------------------------------------------------

    def change_through_server(self, command: Command) -> None:
        if not self.state.devices:
            self.error(f"{no_gpu_reason(self.state) or 'this kernel holds no GPU'}; there is no cap to change")
            return
        if self.client is None:
            self.error("the server gave this kernel no address to ask; the cap cannot be changed from here")
            return
        if command.action == "reset":
            answer = self.client.reset()
        else:
            device = self.state.device(command.ordinal) if command.ordinal is not None else None
            answer = self.client.request_cap(command.cap.text, device.index if device else None)
        if not answer.changed:
            what = "refused by the server" if answer.outcome == "refused" else "request failed"
            self.error(f"{what}: {answer.message}; caps unchanged ({self.caps_text()})")
            return
        self.record(answer, command)
        notes = self.apply()
        print(f"{PREFIX} {headline(answer)}; cap now {self.caps_text()}")
        for note in notes:
            print(f"{PREFIX} {note}")
        hard = restart_note(self.state, self.env)
        if hard:
            print(f"{PREFIX} {hard}")

    def record(self, answer: CapAnswer, command: Command) -> None:
        """The server's answer becomes this kernel's caps (state.STATE), device by device."""
        if command.action == "reset":
            # The ledger says "policy" after a plain reset: "server policy (policy)" would say it twice.
            source = "server policy" if answer.source in (None, "policy") else f"server policy ({answer.source})"
        else:
            source = f"%gpucap, {answer.outcome} by the server"
        self.state.write_caps(answer.devices, source)

    def apply(self) -> List[str]:
        return put_caps_in_force(self.state, self.env)

    def change_locally(self, command: Command) -> None:
        torch = cuda_torch()
        if command.action == "reset":
            self.state.local_caps.clear()
            if torch is not None:
                for ordinal in range(torch.cuda.device_count()):
                    torch.cuda.set_per_process_memory_fraction(1.0, ordinal)
            print(f"{PREFIX} local caps removed")
            return
        if command.ordinal is None:
            self.state.local_caps.clear()
        self.state.local_caps[command.ordinal] = command.cap
        where = "every device" if command.ordinal is None else f"cuda:{command.ordinal}"
        if torch is not None:
            apply_local_caps(torch, self.state.local_caps)
            print(f"{PREFIX} cap {command.cap} set on {where} by this kernel alone, applied now")
        else:
            install_lazy_hook(self.state)
            print(
                f"{PREFIX} cap {command.cap} recorded for {where} by this kernel alone; it applies when torch first "
                "uses CUDA"
            )

    def caps_text(self) -> str:
        return (
            ", ".join(
                f"{format_bytes(d.cap)} on cuda:{d.ordinal}"
                for d in sorted(self.state.devices, key=lambda d: d.ordinal)
            )
            or "none"
        )

    # --- the cell cycle -------------------------------------------------------------------------

    def pre_run_cell(self, info=None) -> None:
        self._report_this_cell = True
        self.cells.pre_run_cell(info)

    def post_run_cell(self, result=None) -> None:
        tell_once(self.state)
        explain_after_cell(result, self.state)
        if self._report_this_cell:
            self.cells.post_run_cell(result)
        try:
            report_to_server(self.state, self.client)
        except Exception:  # broad: after the user's cell; the report is sent again after the next one
            pass
        after_cell(self.state)

    @staticmethod
    def error(message: str) -> None:
        print(f"{PREFIX} error: {message}", file=sys.stderr, flush=True)

    # IPython's @no_var_expand (the attribute it sets; IPython is not imported here): `%gpucap` never expands
    # $names or {expressions} in its argument, which cost 80 s for a 100,000-character one.
    magic._ipython_magic_no_var_expand = True  # type: ignore[attr-defined]

    # --- wiring ---------------------------------------------------------------------------------

    def register(self) -> None:
        self.shell.register_magic_function(self.magic, "line", "gpucap")
        self.shell.events.register("pre_run_cell", self.pre_run_cell)
        self.shell.events.register("post_run_cell", self.post_run_cell)

    def unregister(self) -> None:
        for event, callback in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
            try:
                self.shell.events.unregister(event, callback)
            except ValueError:
                pass
        self.close_panels()


_loaded: List[GpuCap] = []


def load(ipython) -> GpuCap:
    """Called by `%load_ext gpu_quota_ext` (and the bootstrap). Loading again replaces the hooks."""
    state = state_module.STATE
    if not state.managed and os.environ.get(KERNEL_ID):
        # The server started this kernel but its bootstrap did not run (PYTHONSTARTUP replaced?).
        state = state_module.from_environment()
        state_module.STATE = state
        if state.devices:
            cap_torch(state)
    while _loaded:
        _loaded.pop().unregister()
    controller = GpuCap(ipython, state)
    controller.register()
    _loaded.append(controller)
    if not state.managed:
        print(NO_SERVER)
    return controller


def unload(ipython) -> None:
    while _loaded:
        _loaded.pop().unregister()
