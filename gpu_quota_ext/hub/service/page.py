"""The admin's page: the status (status.py) as server-rendered HTML tables, and each user's GPU memory over the
last minutes as a chart (history.py; drawn by shared/chart.py, as the sidebar draws a kernel's). Pure; every
value escaped."""

from __future__ import annotations

from html import escape
from typing import Any, Iterable, List, Mapping, Optional, Sequence

from ...policy import format_bytes
from ...shared.chart import chart_of, chart_svg, legend_html, window
from .history import POINTS_MAX, WORDS


def _size(value: Any) -> str:
    return "–" if value is None else format_bytes(int(value))


def _table(title: str, headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    rows = list(rows)
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows)
    if not rows:
        body = f'<tr><td colspan="{len(headers)}">none</td></tr>'
    return f"<h2>{escape(title)}</h2><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _park(park: Any) -> str:
    """A kernel's park state as its server last reported it."""
    if not park:
        return "not reported"
    words = park["state"]
    if park.get("idle_for") is not None:
        words += f" {park['idle_for']:.0f} s"
    if not park.get("parkable") and park["state"] == "idle":
        words += ", not parkable"
    return words


def _seconds(value: Any) -> str:
    return "–" if value is None else f"{float(value):.0f} s"


def _bytes_by_device(held: Mapping[str, int]) -> str:
    return ", ".join(f"{format_bytes(int(n))} on {uuid}" for uuid, n in sorted(held.items())) or "–"


def _charts(history: Mapping[str, List[dict]], interval: float) -> str:
    """One chart per user with points, in the status's order of users, under one key."""
    if not history:
        return ""
    rows = []
    for name, points in sorted(history.items()):
        end, seconds = window(points, interval, POINTS_MAX)
        chart = chart_svg(chart_of(points, end, seconds, interval), height_px=56, words=WORDS)
        rows.append(f"<tr><th>{escape(name)}</th><td style='width:32em'>{chart}</td></tr>")
    key = legend_html(("used", "cap"), {"used": "used (NVML, all the user's processes)", "cap": "granted"})
    return f"<h2>Usage over the last minutes, per user</h2>{key}<table>{''.join(rows)}</table>"


def render_page(status: dict, history: Optional[Mapping[str, List[dict]]] = None, interval: float = 5.0) -> str:
    """The page of `status`; `history`: the points of the users it lists (history.UserHistory.points),
    `interval` seconds apart."""
    viewer = status["viewer"]
    parts: List[str] = [
        "<!doctype html><html><head><meta charset='utf-8'><title>GPU quota</title>",
        "<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin-bottom:1em}"
        "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left}th{background:#eee}</style></head><body>",
        f"<h1>GPU quota of this host</h1><p>{escape(viewer['name'])}"
        f"{' (admin: every user)' if viewer['admin'] else ' (your kernels only)'}; watchdog: {escape(status['state'])}"
        f"{(' (' + escape(status['problem']) + ')') if status.get('problem') else ''}</p>",
        _table(
            "Devices",
            ["device", "name", "total", "budget", "granted", "kernels", "used (NVML)"],
            (
                (
                    d["uuid"],
                    d["name"],
                    _size(d["total"]),
                    _size(d["budget"]) if d["budget"] is not None else "no admission control",
                    _size(d["granted"]),
                    d["kernels"],
                    _size(d["used"]),
                )
                for d in status["devices"]
            ),
        ),
        _table(
            "Users",
            ["user", "default cap", "max cap", "max kernels", "user budget", "kernels", "granted", "used", "unmanaged"],
            (
                (
                    u["name"],
                    (u["policy"] or {}).get("default_cap", "–"),
                    (u["policy"] or {}).get("max_cap", "–"),
                    (u["policy"] or {}).get("max_kernels", "–"),
                    (u["policy"] or {}).get("user_budget", "–"),
                    u["kernels"],
                    _size(u["granted"]),
                    _size(u["used"]),
                    _size(u["unmanaged"]),
                )
                for u in status["users"]
            ),
        ),
        _charts(history or {}, interval),
        _table(
            "Kernels",
            [
                "user", "kernel", "server", "kernelspec", "device", "cap", "used", "over cap", "pids", "held", "park",
                "source",
            ],
            (
                (
                    k["user"],
                    k["kernel_id"],
                    k["server"] or "(default)",
                    k["kernelspec"],
                    d["uuid"],
                    _size(d["cap"]),
                    _size(d["used"]),
                    "yes" if d["used"] is not None and d["used"] > d["cap"] else "",
                    " ".join(str(p) for p in k["pids"]) or "–",
                    "idle-held" if k["idle_held"] else "by a live process" if k["pids"] else "",
                    _park(k.get("park")),
                    k["source"],
                )
                for k in status["kernels"]
                for d in (k["devices"] or [{"uuid": "CPU only", "cap": None, "used": None}])
            ),
        ),
        _table(
            "Waiting for device memory (the host's broker)",
            ["user", "kernel", "server", "needs", "waited", "why", "told"],
            (
                (
                    w["user"], w["kernel_id"], w["server"] or "(default)", _bytes_by_device(w["need"]),
                    _seconds(w["waited"]), w["reason"] or "–", w["told"] or "",
                )
                for w in status.get("waiting", [])
            ),
        ),
        _table(
            "Reservations (room held for a resume until the sample shows it back)",
            ["user", "kernel", "server", "held", "for", "ends in"],
            (
                (
                    r["user"], r["kernel_id"], r["server"] or "(default)", _bytes_by_device(r["held"]),
                    _seconds(r["held_for"]), _seconds(r["ends_in"]),
                )
                for r in status.get("reservations", [])
            ),
        ),
        _table(
            "Park requests (idle kernels the broker parks to make room)",
            ["user", "kernel", "server", "for kernel", "asked", "taken by its server"],
            (
                (
                    a["user"], a["kernel_id"], a["server"] or "(default)", a["for_kernel"] or "another user's",
                    f"{_seconds(a['asked'])} ago", "yes" if a["taken"] else "not yet",
                )
                for a in status.get("park_requests", [])
            ),
        ),
        (
            f"<p>Leases waiting for park requests (long polls): {int(status['long_polls'])}</p>"
            if "long_polls" in status
            else ""
        ),
        _table(
            "Unmanaged usage (GPU memory outside every grant)",
            ["user", "pid", "device", "used", "why"],
            ((u["user"], u["pid"], u["uuid"], _size(u["used"]), u["why"]) for u in status["unmanaged"]),
        ),
        _table(
            "Refused PID registrations (a lease naming another Unix user's process: counted for nobody)",
            ["user", "server", "kernel", "pid", "why"],
            (
                (r["user"], r["server"] or "(default)", r["kernel_id"], r["pid"], r["why"])
                for r in status["refused_pids"]
            ),
        ),
        _table(
            "Last actions",
            ["action", "user", "pid", "message"],
            ((a["action"], a["user"], a["pid"], a["message"]) for a in reversed(status["actions"])),
        ),
        "</body></html>",
    ]
    return "".join(parts)
