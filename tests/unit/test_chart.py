"""The usage chart of `%gpucap panel` and of the host service's admin page (shared/chart.py): what the sidebar's
chart (labextension/src/chart.ts, its jest tests in labextension/test/history.spec.ts) draws, as an SVG string:
the window, a gap where a figure is unknown or samples are missing (never a drop to 0), "usage unknown", the
cap as steps, park periods as bands, a hard limit only when there is one, and words that say it all."""

import re

from gpu_quota_ext.kernel.panel import chart_html
from gpu_quota_ext.shared.chart import HEIGHT, WIDTH, chart_of, chart_svg, summary, window
from gpu_quota_ext.shared.contract import HISTORY_POINT_FIELDS

GiB = 1 << 30


def point(t, used=3 * GiB, allocated=2 * GiB, reserved=2.5 * GiB, cap=10 * GiB, hard_limit=None, park="idle"):
    values = dict(t=t, used=used, allocated=allocated, reserved=reserved, cap=cap, hard_limit=hard_limit, park=park)
    assert tuple(values) == HISTORY_POINT_FIELDS  # the contract's points, as GET kernels/<id>/history has them
    return {k: (int(v) if isinstance(v, float) else v) for k, v in values.items()}


TEN = [point(100 + i) for i in range(10)]


def xs(path):
    return [float(x) for x in re.findall(r"[ML]([\d.]+) ", path)]


def test_the_window_ends_at_the_newest_point_at_the_right_edge():
    chart = chart_of(TEN, 109, 10, 1)
    assert chart.known
    assert max(xs(chart.paths["used"])) == WIDTH
    assert min(xs(chart.paths["used"])) == WIDTH / 10  # t=100 in a 10 s window from 99 to 109
    assert chart_of([point(1), *TEN], 109, 10, 1).points[0]["t"] == 100  # older points are left out


def test_a_figure_nvml_could_not_read_is_a_gap_not_a_drop_to_zero():
    points = [point(t, used=None if t == 105 else 3 * GiB) for t in range(100, 110)]
    used = chart_of(points, 109, 10, 1).paths["used"]
    assert used.count("M") == 2  # two runs
    assert f" {HEIGHT - 1.5:g}" not in used  # no point at the bottom (0 bytes)
    missing = [p for p in TEN if p["t"] not in (104, 105, 106)]  # a stalled monitor: no samples
    assert chart_of(missing, 109, 10, 1).paths["used"].count("M") == 2


def test_usage_unknown_is_said_and_the_cap_still_drawn():
    points = [point(t, used=None, allocated=None, reserved=None) for t in range(100, 110)]
    chart = chart_of(points, 109, 10, 1)
    assert not chart.known and chart.paths["used"] == chart.paths["allocated"] == ""
    assert chart.paths["cap"]
    svg = chart_svg(chart)
    assert ">usage unknown</text>" in svg
    assert "NVML used: unknown" in svg and "Allocator: no report from the kernel" in svg


def test_a_cap_change_is_a_step_and_park_periods_are_bands():
    points = [point(t, cap=(10 if t < 105 else 12) * GiB, park="parked" if 106 <= t <= 107 else "idle")
              for t in range(100, 110)]
    chart = chart_of(points, 109, 10, 1)
    assert "V" in chart.paths["cap"] and "H" in chart.paths["cap"]
    (band,) = chart.parks
    assert (band.state, band.start, band.end) == ("parked", 106, 107)
    assert any(line.startswith("Parked: ") for line in summary(chart))
    waiting = chart_of([dict(p, park="waiting") if p["t"] == 109 else p for p in TEN], 109, 10, 1)
    assert [b.state for b in waiting.parks] == ["waiting"]
    assert 'data-state="waiting"' in chart_svg(waiting)


def test_a_hard_limit_only_when_the_kernel_has_one():
    assert chart_of(TEN, 109, 10, 1).paths["hard_limit"] == ""
    hard = chart_of([dict(p, hard_limit=int(10.5 * GiB)) for p in TEN], 109, 10, 1)
    assert hard.paths["hard_limit"] and "Hard limit (dotted): 10.5 GiB" in summary(hard)


def test_the_words_say_what_the_chart_shows():
    lines = summary(chart_of(TEN, 109, 10, 1))
    assert lines == [
        "Usage over the last 10 s",
        "NVML used (line): 3.0 GiB now, at most 3.0 GiB",
        "Allocator (areas): 2.0 GiB allocated, 2.5 GiB reserved",
        "Cap (dashed): 10.0 GiB",
    ]


def test_the_window_is_the_kernels_life_a_minute_at_least_and_the_whole_history_at_most():
    assert window(TEN, 1.0, 300) == (109, 60)  # ten seconds old: a minute
    long = [point(t) for t in range(0, 1000, 2)]
    assert window(long, 2.0, 300) == (998, 600)


def test_the_panels_chart_comes_with_its_key_and_nothing_without_points():
    assert chart_html([], 1.0, 300) == ""
    html = chart_html(TEN, 1.0, 300)
    assert html.count("<svg class=\"gpu-quota-chart\"") == 1
    assert "allocated" in html and "used (NVML)" in html and "cap" in html and "hard limit" not in html
    parked = chart_html([dict(p, park="parked") for p in TEN], 1.0, 300)
    assert "parked" in parked.split("gpu-quota-chart-legend", 1)[1]


def test_words_in_the_svg_are_escaped():
    svg = chart_svg(chart_of(TEN, 109, 10, 1), words={"used": "<b>&", "allocator": "A", "cap": "C",
                                                       "hard_limit": "H"})
    assert "<b>&" not in svg and "&lt;b&gt;&amp;" in svg
