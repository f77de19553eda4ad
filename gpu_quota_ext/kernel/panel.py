"""The usage panel: per device, bars of allocated and reserved memory against the cap, kept live.

    from gpu_quota_ext.kernel.panel import GpuUsagePanel
    GpuUsagePanel()              # or: %gpucap panel

A background thread re-reads the allocator every `interval` seconds (default 1) and sets the widgets'
traits, so the panel moves while a long cell runs. The thread stops as soon as the panel's widget is
closed (from the browser, by `close()` or by `panel.widget.close()`) or the kernel exits; `%gpucap panel`
closes the panel it opened before, so a kernel has at most one panel thread however often it is asked.
Readings come from torch.cuda.memory_stats() only while the kernel's own torch has CUDA running: the
panel never imports torch and never starts CUDA (that would cost the kernel a context, docs/measurements.md).
A kernel that holds a grant always shows it, with its usage marked "not available" and why when its
torch cannot read any (a CPU-only torch, as in the simulated demo). Under the rows, a chart of the kernel's
usage over the last minutes, as the sidebar draws it (shared/chart.py), from the history the server keeps
(GET kernels/<id>/history, read incrementally every `HISTORY_READ_S` seconds with the kernel's own secret),
and the kernel's park state as the server has it ("running", "parked since 14:02, ...", "not parkable:
..."), read every `PARK_READ_S` seconds, when the server sends one.

Module import is stdlib-only; ipywidgets is imported when a panel is made.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from html import escape
from typing import Any, Deque, List, Mapping, Optional, Sequence

from ..shared.chart import chart_of, chart_svg, legend_html, window
from ..shared.sizes import format_bytes
from . import state as state_module
from .park import not_parkable_words, state_words
from .reasons import no_gpu_reason, usage_unavailable_reason
from .usage import DeviceUsage, read_usage, report_to_server

PARK_READ_S = 5.0  # the park state changes over minutes; one small GET every few seconds is plenty
HISTORY_READ_S = 1.0  # the server adds a point per sample (1 s by default); a read asks for the new ones only
POINTS_MAX = 300  # until the server says how many it keeps


@dataclass(frozen=True)
class DeviceRow:
    label: str
    cap: Optional[int]
    allocated: Optional[int]  # None while there is no reading (see `unavailable`)
    reserved: Optional[int]
    peak: Optional[int]
    total: Optional[int]
    source: str
    unavailable: Optional[str] = None  # why there is no usage reading at all, when that is known

    def fill(self, amount: Optional[int]) -> float:
        """Bar length in percent of the cap (0-100)."""
        if not amount or not self.cap:
            return 0.0
        return min(100.0, 100.0 * amount / self.cap)

    def details(self) -> str:
        where = f"cap {format_bytes(self.cap)} · device {format_bytes(self.total)} · cap set by {self.source}"
        if self.allocated is None and self.unavailable:
            return f"usage not available ({self.unavailable}) · {where}"
        return (
            f"allocated {format_bytes(self.allocated)} · reserved {format_bytes(self.reserved)} "
            f"of {format_bytes(self.cap)} cap · peak {format_bytes(self.peak)} · "
            f"device {format_bytes(self.total)} · cap set by {self.source}"
        )


@dataclass(frozen=True)
class PanelView:
    """What the panel shows, decided without widgets (tested on its own)."""

    status: str
    gpu_visible: bool
    rows: List[DeviceRow] = field(default_factory=list)
    park: str = ""  # the kernel's park state in words; "" when the server sends none


def park_text(park: Optional[dict]) -> str:
    """The panel's park line: "park: idle for 12 min", "park: not parkable: <the server's reason>"."""
    if not park:
        return ""
    if park.get("parkable") is False:
        return f"park: {not_parkable_words(park.get('reason'))}"
    return f"park: {state_words(park)}"


def chart_html(points: Sequence[Mapping[str, Any]], interval: float, points_max: int) -> str:
    """The panel's chart of the kernel's usage history (the server's points, oldest first) with its key, or ""
    while there is no point to draw."""
    if not points:
        return ""
    end, seconds = window(points, interval, points_max)
    chart = chart_of(points, end, seconds, interval)
    marks = ["allocated", "reserved", "used", "cap"]
    if chart.paths.get("hard_limit"):
        marks.append("hard_limit")
    marks += sorted({band.state for band in chart.parks})
    return f"<div class='gpu-quota-history'>{chart_svg(chart)}{legend_html(marks)}</div>"


def panel_view(state, readings: dict, unavailable: Optional[str], park: Optional[dict] = None) -> PanelView:
    """Rows for the kernel's grants (a kernel the server started) or for what torch uses (one no server
    started). `unavailable`: why the kernel's torch can read no usage (reasons.usage_unavailable_reason).
    `park`: the kernel's park state as the server sent it (PARK_FIELDS), if it sent one."""
    view = _device_view(state, readings, unavailable)
    return PanelView(view.status, view.gpu_visible, view.rows, park_text(park))


def _device_view(state, readings: dict, unavailable: Optional[str]) -> PanelView:
    held_none = no_gpu_reason(state)
    if held_none:
        return PanelView(held_none, False)
    rows = []
    if state.devices:
        for device in sorted(state.devices, key=lambda d: d.ordinal):
            label = f"cuda:{device.ordinal} (server GPU {device.index})"
            rows.append(
                _row(label, device.cap, device.total, state.cap_source, readings.get(device.ordinal), unavailable)
            )
        if not readings:
            status = (
                f"usage not available: {unavailable}; the caps below are this kernel's grants"
                if unavailable
                else "GPU not in use yet: the cap applies at the first CUDA use"
            )
            return PanelView(status, True, rows)
        return PanelView("live", True, rows)
    for ordinal, reading in sorted(readings.items()):
        rows.append(_row(f"cuda:{ordinal}", None, reading.total, "not capped by a server", reading, None))
    if rows:
        return PanelView("live", True, rows)
    if unavailable:
        return PanelView(f"no GPU visible: {unavailable}", False)
    return PanelView("no GPU in use: this kernel's torch has not started CUDA (no server started this kernel)", False)


def _row(label, cap, total, source, reading: Optional[DeviceUsage], unavailable: Optional[str]) -> DeviceRow:
    return DeviceRow(
        label=label,
        cap=cap,
        allocated=reading.allocated if reading else None,
        reserved=reading.reserved if reading else None,
        peak=reading.peak if reading else None,
        total=total if total is not None else (reading.total if reading else None),
        source=source,
        unavailable=None if reading else unavailable,
    )


class GpuUsagePanel:
    """A live ipywidgets panel of this kernel's GPU memory. Display it (last expression of a cell)."""

    def __init__(self, interval: float = 1.0, state=None, client=None, start: bool = True):
        import ipywidgets as widgets  # only now: kernel code imports nothing but the stdlib up front

        self._widgets = widgets
        self.interval = float(interval)
        self.state = state if state is not None else state_module.STATE
        if client is None and self.state.managed:
            from .client import QuotaClient

            client = QuotaClient.from_environment()  # the panel's readings feed the server's sidebar too
        self.client = client
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._unavailable: Optional[str] = None
        self._torch_checked = False
        self.title = widgets.HTML(value="<b>GPU memory</b>")
        self.status = widgets.HTML(value="")
        self.rows = widgets.VBox([])
        self.park = widgets.HTML(value="")
        self.chart = widgets.HTML(value="", layout=widgets.Layout(width="100%", max_width="640px"))
        self._park: Optional[dict] = None
        self._park_read_at: Optional[float] = None
        self._points: Deque[dict] = deque(maxlen=POINTS_MAX)
        self._interval = 1.0
        self._history_read_at: Optional[float] = None
        self._row_widgets: list = []
        self.widget = widgets.VBox([self.title, self.status, self.rows, self.chart, self.park])
        # However the widget is closed (the browser, close(), widget.close()), its comm goes: stop then.
        self.widget.observe(self._on_comm, names="comm")
        self.refresh()
        if start:
            self.start()

    # --- what to show ---------------------------------------------------------------------------

    def view(self) -> PanelView:
        if not self._torch_checked and "torch" in sys.modules:
            self._unavailable = usage_unavailable_reason()  # fixed for the kernel's life: ask once
            self._torch_checked = True
        ordinals = [d.ordinal for d in self.state.devices] or None
        return panel_view(self.state, read_usage(ordinals), self._unavailable, self.park_state())

    def park_state(self) -> Optional[dict]:
        """The server's park state for this kernel, read at most every PARK_READ_S seconds."""
        if self.client is None:
            return None
        now = time.monotonic()
        if self._park_read_at is None or now - self._park_read_at >= PARK_READ_S:
            self._park_read_at = now
            try:
                self._park = self.client.park_state()
            except Exception:  # broad: the table must show even when this extra reading fails
                self._park = None
        return self._park

    def read_history(self) -> bool:
        """The points the server added since the last read, at most every HISTORY_READ_S seconds; whether
        any came. Nothing for a kernel without a GPU grant or a server that keeps no history."""
        reader = getattr(self.client, "history", None)
        if reader is None or not self.state.devices:
            return False
        now = time.monotonic()
        if self._history_read_at is not None and now - self._history_read_at < HISTORY_READ_S:
            return False
        self._history_read_at = now
        newest = self._points[-1]["t"] if self._points else None
        try:
            answer = reader(newest)
        except Exception:  # broad: the chart keeps what it has; the next tick tries again
            return False
        if not answer:
            return False
        points_max = answer.get("points_max")
        if isinstance(points_max, int) and points_max >= 1 and points_max != self._points.maxlen:
            self._points = deque(self._points, maxlen=points_max)
        interval = answer.get("interval")
        if isinstance(interval, (int, float)) and interval > 0:
            self._interval = float(interval)
        new = [
            p for p in answer["points"]
            if isinstance(p, dict) and isinstance(p.get("t"), (int, float)) and (newest is None or p["t"] > newest)
        ]
        self._points.extend(new)
        return bool(new)

    def refresh(self) -> PanelView:
        """Read once and set the widgets' traits (only changed values travel to the browser)."""
        view = self.view()
        self.status.value = f"<span class='gpu-quota-status'>{escape(view.status)}</span>"
        while len(self._row_widgets) < len(view.rows):
            self._row_widgets.append(self._make_row())
        shown = self._row_widgets[: len(view.rows)]
        if list(self.rows.children) != [r["box"] for r in shown]:
            self.rows.children = tuple(r["box"] for r in shown)
        for row, widgets in zip(view.rows, shown):
            widgets["label"].value = f"<b>{escape(row.label)}</b>"
            widgets["reserved"].value = row.fill(row.reserved)
            widgets["allocated"].value = row.fill(row.allocated)
            widgets["reserved"].bar_style = "danger" if row.fill(row.reserved) >= 90 else "info"
            widgets["details"].value = escape(row.details())
            bars = "none" if row.unavailable else ""  # no reading will ever come: no empty bars
            widgets["reserved"].layout.display = widgets["allocated"].layout.display = bars
        park = f"<span class='gpu-quota-park'>{escape(view.park)}</span>" if view.park else ""
        if self.park.value != park:
            self.park.value = park
        if self.read_history():
            self.chart.value = chart_html(list(self._points), self._interval, self._points.maxlen or POINTS_MAX)
        return view

    def _make_row(self) -> dict:
        w = self._widgets
        row = {
            "label": w.HTML(),
            "reserved": w.FloatProgress(min=0.0, max=100.0, description="reserved"),
            "allocated": w.FloatProgress(min=0.0, max=100.0, description="allocated", bar_style="success"),
            "details": w.HTML(),
        }
        row["box"] = w.VBox([row["label"], row["reserved"], row["allocated"], row["details"]])
        return row

    # --- the live part --------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        atexit.register(self._stop.set)  # kernel shutdown: stop before the interpreter tears down
        self._thread = threading.Thread(target=self._run, name="gpu-quota-panel", daemon=True)
        self._thread.start()

    def _on_comm(self, change) -> None:
        if change["new"] is None:
            self._stop.set()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                if getattr(self.widget, "comm", None) is None:  # closed before the observer was in place
                    break
                try:
                    self.refresh()
                    report_to_server(self.state, self.client)
                except Exception:
                    pass  # a failed reading must not kill the panel; the next tick tries again
        finally:
            atexit.unregister(self._stop.set)  # nothing of a stopped panel stays behind

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread and close every widget of the panel (the browser drops its view)."""
        self._stop.set()
        for row in self._row_widgets:
            for widget in row.values():
                widget.close()
        for widget in (self.title, self.status, self.rows, self.chart, self.park, self.widget):
            widget.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(2.0, 2 * self.interval))

    # --- display --------------------------------------------------------------------------------

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
