"""Usage over the last minutes as a small SVG chart, for `%gpucap panel` (in the kernel) and the host service's
admin page (per user): the same drawing as the sidebar's (labextension/src/chart.ts), as a string.

Pure, standard library only. The points are the contract's (contract.HISTORY_POINT_FIELDS, as the JSON of
GET kernels/<id>/history has them; a missing field is unknown): the allocator's `allocated` and `reserved` as
areas, NVML's `used` as a line, the `cap` and the `hard_limit` as steps, park periods as bands. An unknown
figure or missing samples are a gap, never a drop to 0. The SVG carries its own colours (JupyterLab's theme
variables where it is shown inside JupyterLab, plain colours elsewhere) and says what it shows in words in
its <title> (the tooltip) and aria-label.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from html import escape
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .sizes import format_bytes

WIDTH, HEIGHT = 300, 40  # the viewBox the paths are drawn in; the SVG stretches to its container's width
_PAD = 1.5  # so that a line at the top or at 0 is not cut in half
MIN_SECONDS = 60.0  # a new kernel's first points are not a sliver at the chart's right edge
_HELD = {"parking", "parked", "resuming"}  # park states whose period is marked: the memory is (going) on the host

# Each mark's look: JupyterLab's variables, with a plain colour where they are not defined (the admin page).
STYLE = {
    "reserved": "fill:var(--jp-brand-color3,#90caf9);fill-opacity:.9;stroke:none",
    "allocated": "fill:var(--jp-brand-color1,#1976d2);fill-opacity:.75;stroke:none",
    "used": "fill:none;stroke:var(--jp-ui-font-color1,#222);stroke-width:1.5px;stroke-linejoin:round",
    "cap": "fill:none;stroke:var(--jp-ui-font-color2,#666);stroke-width:1px;stroke-dasharray:4 3",
    "hard_limit": "fill:none;stroke:var(--jp-error-color1,#d32f2f);stroke-width:1px;stroke-dasharray:1 2",
    "parked": "fill:var(--jp-layout-color3,#bdbdbd)",
    "waiting": "fill:var(--jp-warn-color1,#f57c00);fill-opacity:.3",
}
# What the summary calls each figure (the admin page's cap line is a user's granted bytes; it has no allocator).
WORDS = {"used": "NVML used", "allocator": "Allocator", "cap": "Cap", "hard_limit": "Hard limit"}


def _value(point: Mapping[str, Any], name: str) -> Optional[float]:
    value = point.get(name)
    return None if value is None or isinstance(value, bool) else float(value)


def _r(value: float) -> float:
    return round(value, 1)


def _number(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class ParkBand:
    state: str  # "parked" (parking, parked, resuming) or "waiting" (a resume waiting for device memory)
    start: float  # the server's times of its first and last points
    end: float
    x: float
    width: float


@dataclass
class Chart:
    """The geometry of one chart: SVG path data in the WIDTH x HEIGHT box, and what it was drawn from."""

    start: float
    end: float
    seconds: float
    paths: Dict[str, str] = field(default_factory=dict)  # reserved, allocated, used, cap, hard_limit
    parks: List[ParkBand] = field(default_factory=list)
    known: bool = False  # whether any usage figure (NVML or the allocator's) in the window is known
    points: List[Mapping[str, Any]] = field(default_factory=list)


def window(points: Sequence[Mapping[str, Any]], interval: float, points_max: int) -> Tuple[float, float]:
    """(end, seconds) as the sidebar chooses them: the newest point's time, and the history's whole window
    (points_max samples), or the kernel's life while that is shorter (a minute at least)."""
    end = float(points[-1]["t"]) if points else time.time()
    most = points_max * interval
    lived = end - float(points[0]["t"]) + interval if points else 0.0
    return end, min(most, max(MIN_SECONDS, lived))


def _runs(points: Sequence[Mapping[str, Any]], figure: str, gap: float) -> List[List[Mapping[str, Any]]]:
    """Runs of consecutive points (no sample missing between them) whose `figure` is known."""
    found: List[List[Mapping[str, Any]]] = []
    run: List[Mapping[str, Any]] = []
    previous: Optional[Mapping[str, Any]] = None
    for point in points:
        broken = previous is not None and float(point["t"]) - float(previous["t"]) > gap
        if _value(point, figure) is None or broken:
            if run:
                found.append(run)
            run = []
        if _value(point, figure) is not None:
            run.append(point)
        previous = point
    if run:
        found.append(run)
    return found


@dataclass(frozen=True)
class _Frame:
    """Where a point goes in the WIDTH x HEIGHT box: time from `start` over `seconds` across, bytes up to `y_max`;
    `gap`: seconds between points past which a line breaks; `dot`: how wide one sample alone is drawn."""

    start: float
    seconds: float
    y_max: float
    gap: float
    dot: float

    def x(self, t: Any) -> float:
        return _r((float(t) - self.start) / self.seconds * WIDTH)

    def y(self, v: Optional[float]) -> float:
        return _r(HEIGHT - _PAD - (v or 0.0) / self.y_max * (HEIGHT - 2 * _PAD))


def chart_of(points: Sequence[Mapping[str, Any]], end: float, seconds: float, interval: float) -> Chart:
    """The chart of `points` (oldest first) over the `seconds` before `end`, samples `interval` seconds apart:
    a gap of more than a few intervals is a gap in every line."""
    start = end - seconds
    shown = [p for p in points if start <= float(p["t"]) <= end]
    figures = ("used", "allocated", "reserved", "cap", "hard_limit")
    top = max((v for p in shown for v in (_value(p, f) for f in figures) if v is not None), default=0.0)
    known = any(_value(p, f) is not None for p in shown for f in ("used", "allocated", "reserved"))
    frame = _Frame(
        start,
        seconds,
        y_max=top * 1.08 if top > 0 else 1.0,
        gap=max(3 * interval, interval + 1),
        dot=max(1.0, _r(interval / seconds * WIDTH)),  # one sample alone still shows
    )
    paths = {
        "reserved": _area(shown, "reserved", frame),
        "allocated": _area(shown, "allocated", frame),
        "cap": _steps(shown, "cap", frame),
        "hard_limit": _steps(shown, "hard_limit", frame),
        "used": _line(shown, "used", frame),
    }
    return Chart(start, end, seconds, paths, _park_bands(shown, interval, frame), known, shown)


def _line(points: Sequence[Mapping[str, Any]], figure: str, frame: _Frame) -> str:
    x, y, n = frame.x, frame.y, _number
    parts = []
    for run in _runs(points, figure, frame.gap):
        head = f"M{n(x(run[0]['t']))} {n(y(_value(run[0], figure)))}"
        if len(run) == 1:
            parts.append(f"{head}h{n(frame.dot)}")
        else:
            parts.append(head + "".join(f"L{n(x(p['t']))} {n(y(_value(p, figure)))}" for p in run[1:]))
    return "".join(parts)


def _area(points: Sequence[Mapping[str, Any]], figure: str, frame: _Frame) -> str:
    x, y, n = frame.x, frame.y, _number
    base = _r(HEIGHT - _PAD)
    parts = []
    for run in _runs(points, figure, frame.gap):
        last = run[-1]
        outline = "".join(f"L{n(x(p['t']))} {n(y(_value(p, figure)))}" for p in run)
        right = _r(x(last["t"]) + frame.dot) if len(run) == 1 else x(last["t"])
        edge = f"L{n(right)} {n(y(_value(last, figure)))}" if len(run) == 1 else ""
        parts.append(f"M{n(x(run[0]['t']))} {n(base)}{outline}{edge}L{n(right)} {n(base)}Z")
    return "".join(parts)


def _steps(points: Sequence[Mapping[str, Any]], figure: str, frame: _Frame) -> str:
    """A cap changes at once (a %gpucap): drawn as steps."""
    x, y, n = frame.x, frame.y, _number
    parts = []
    for run in _runs(points, figure, frame.gap):
        path = f"M{n(x(run[0]['t']))} {n(y(_value(run[0], figure)))}"
        for p in run[1:]:
            path += f"H{n(x(p['t']))}V{n(y(_value(p, figure)))}"
        parts.append(f"{path}h{n(frame.dot)}" if len(run) == 1 else f"{path}H{n(x(run[-1]['t']))}")
    return "".join(parts)


def _park_bands(points: Sequence[Mapping[str, Any]], interval: float, frame: _Frame) -> List[ParkBand]:
    """Park periods: runs of points in one held state, each sample standing for the interval around it."""
    spans: List[List[Any]] = []  # [state, first t, last t]
    previous: Optional[Mapping[str, Any]] = None
    for p in points:
        park = p.get("park")
        state = "waiting" if park == "waiting" else "parked" if park in _HELD else None
        t = float(p["t"])
        open_span = spans[-1] if spans else None
        continues = (
            open_span is not None and previous is not None and open_span[2] == float(previous["t"])
            and t - float(previous["t"]) <= frame.gap
        )
        if state and continues and open_span is not None and open_span[0] == state:
            open_span[2] = t
        elif state:
            spans.append([state, t, t])
        previous = p
    bands = []
    for state, first, last in spans:
        left = max(0.0, frame.x(first - interval / 2))
        right = min(float(WIDTH), frame.x(last + interval / 2))
        bands.append(ParkBand(state, first, last, left, _r(max(frame.dot, right - left))))
    return bands


def _newest(points: Sequence[Mapping[str, Any]], figure: str) -> Optional[float]:
    for point in reversed(points):
        value = _value(point, figure)
        if value is not None:
            return value
    return None


def _most(points: Sequence[Mapping[str, Any]], figure: str) -> Optional[float]:
    values = [v for v in (_value(p, figure) for p in points) if v is not None]
    return max(values) if values else None


def _size(value: Optional[float]) -> str:
    return format_bytes(None if value is None else int(value))


def _duration(seconds: float) -> str:
    return f"{round(seconds)} s" if seconds < 90 else f"{round(seconds / 60)} min"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def summary(chart: Chart, words: Mapping[str, str] = WORDS) -> List[str]:
    """What the chart shows, in words, one fact a line (its tooltip and accessible name)."""
    points = chart.points
    lines = [f"Usage over the last {_duration(chart.seconds)}"]
    used = _newest(points, "used")
    lines.append(
        f"{words['used']}: unknown" if used is None
        else f"{words['used']} (line): {_size(used)} now, at most {_size(_most(points, 'used'))}"
    )
    allocated, reserved = _newest(points, "allocated"), _newest(points, "reserved")
    if allocated is not None or reserved is not None:
        lines.append(f"{words['allocator']} (areas): {_size(allocated)} allocated, {_size(reserved)} reserved")
    elif words.get("allocator"):  # "" where there are no allocator figures to wait for (the admin page's)
        lines.append(f"{words['allocator']}: no report from the kernel")
    cap = _newest(points, "cap")
    if cap is not None:
        lines.append(f"{words['cap']} (dashed): {_size(cap)}")
    hard = _newest(points, "hard_limit")
    if hard is not None:
        lines.append(f"{words['hard_limit']} (dotted): {_size(hard)}")
    for band in chart.parks:
        what = "Waiting for device memory" if band.state == "waiting" else "Parked"
        lines.append(f"{what}: {_clock(band.start)}–{_clock(band.end)}")
    return lines


def chart_svg(chart: Chart, height_px: int = 48, words: Mapping[str, str] = WORDS) -> str:
    """The chart as one inline <svg>: as wide as its container, `height_px` tall, "usage unknown" written
    across it when no usage figure in the window is known."""
    said = "\n".join(summary(chart, words))
    marks = [
        f'<rect x="{_number(b.x)}" y="0" width="{_number(b.width)}" height="{HEIGHT}" style="{STYLE[b.state]}" '
        f'data-state="{b.state}"/>'
        for b in chart.parks
    ]
    for name in ("reserved", "allocated", "cap", "hard_limit", "used"):
        if chart.paths.get(name):
            marks.append(
                f'<path class="gpu-quota-chart-{name.replace("_", "-")}" d="{chart.paths[name]}" '
                f'style="{STYLE[name]}" vector-effect="non-scaling-stroke"/>'
            )
    if not chart.known:
        marks.append(
            f'<text x="{WIDTH / 2:g}" y="{HEIGHT / 2 + 3:g}" text-anchor="middle" font-size="9" font-style="italic" '
            'style="fill:var(--jp-ui-font-color2,#666)">usage unknown</text>'
        )
    return (
        f'<svg class="gpu-quota-chart" role="img" aria-label="{escape(said)}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'preserveAspectRatio="none" width="100%" height="{height_px}" '
        'style="display:block;overflow:visible;border-bottom:1px solid var(--jp-border-color2,#ccc)">'
        f"<title>{escape(said)}</title>{''.join(marks)}</svg>"
    )


def legend_html(
    marks: Sequence[str] = ("allocated", "reserved", "used", "cap"), words: Optional[Mapping[str, str]] = None
) -> str:
    """The key to the charts, one line: a small swatch per mark, in the charts' own styles."""
    names = {"allocated": "allocated", "reserved": "reserved", "used": "used (NVML)", "cap": "cap",
             "hard_limit": "hard limit", "parked": "parked", "waiting": "waiting to resume"}
    names.update(words or {})
    entries = []
    for mark in marks:
        if mark in ("used", "cap", "hard_limit"):
            swatch = f'<path d="M0 4H12" style="{STYLE[mark]}"/>'
        else:
            swatch = f'<rect x="0" y="0" width="12" height="8" style="{STYLE[mark]}"/>'
        entries.append(
            f'<span style="white-space:nowrap;margin-right:10px"><svg width="12" height="8" viewBox="0 0 12 8" '
            f'style="vertical-align:middle;margin-right:3px">{swatch}</svg>{escape(names[mark])}</span>'
        )
    return f'<div class="gpu-quota-chart-legend" style="font-size:smaller;opacity:.85">{"".join(entries)}</div>'
