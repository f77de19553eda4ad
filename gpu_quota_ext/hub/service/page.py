"""The admin's page: the status (status.py) as server-rendered HTML tables, and each user's GPU memory over the
last minutes as a chart (history.py; drawn by shared/chart.py, as the sidebar draws a kernel's). Pure; every
value escaped.

Bounded however many users and kernels the host has: a page lists `PAGE_USERS` users (in the status's order),
their charts and at most `PAGE_KERNELS` of their kernels, with links to the other pages and to one user's own
page (`?user=NAME`: all their kernels); each chart is drawn from at most `CHART_POINTS` points (the history
downsampled, each point the largest of the samples it stands for: a peak is never smoothed away); the broker's
tables show at most `TABLE_ROWS` rows each and say how many more there are. 200 users of 200 kernels made a page
of 991 KiB before (issue 30); one page is now a few dozen KiB whatever the host holds.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any, Iterable, List, Mapping, Optional, Sequence
from urllib.parse import quote

from ...shared.chart import chart_of, chart_svg, legend_html, window
from ...shared.sizes import format_bytes
from .history import POINTS_MAX, WORDS

PAGE_USERS = 25  # users (their rows, charts and kernels) on one page
PAGE_KERNELS = 100  # kernel rows on one page at most (one user's page: USER_KERNELS)
USER_KERNELS = 1000
CHART_POINTS = 60  # points one chart is drawn from at most
TABLE_ROWS = 100  # rows of each other table at most


class _Html(str):
    """A table cell that is HTML already (built here from escaped parts): not escaped again."""


def _cell(value: Any) -> str:
    return value if isinstance(value, _Html) else escape(str(value))


def _size(value: Any) -> str:
    return "–" if value is None else format_bytes(int(value))


def _table(title: str, headers: Sequence[str], rows: Iterable[Sequence[Any]], most: int = TABLE_ROWS) -> str:
    rows = list(rows)
    more = len(rows) - most
    rows = rows[:most]
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_cell(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    if not rows:
        body = f'<tr><td colspan="{len(headers)}">none</td></tr>'
    if more > 0:
        body += f'<tr><td colspan="{len(headers)}">and {more} more</td></tr>'
    return f"<h2>{escape(title)}</h2><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def downsample(points: Sequence[Mapping[str, Any]], most: int = CHART_POINTS) -> "tuple[List[dict], int]":
    """(at most `most` points, how many samples each stands for): consecutive samples grouped, each group one point
    at its last sample's time with the largest known figure of each kind (unknown where none is known)."""
    step = max(1, math.ceil(len(points) / most))
    if step == 1:
        return [dict(p) for p in points], 1
    kept = []
    for start in range(0, len(points), step):
        group = points[start : start + step]
        point = dict(group[-1])
        for key in ("used", "cap", "allocated", "reserved", "hard_limit"):
            known = [p[key] for p in group if p.get(key) is not None]
            point[key] = max(known) if known else None
        kept.append(point)
    return kept, step


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


def _charts(history: Mapping[str, List[dict]], interval: float, users: Sequence[str]) -> str:
    """One chart per user of `users` with points, in that order, under one key; each from CHART_POINTS at most."""
    rows = []
    for name in users:
        points = history.get(name)
        if not points:
            continue
        end, seconds = window(points, interval, POINTS_MAX)
        shown, step = downsample(points)
        chart = chart_svg(chart_of(shown, end, seconds, interval * step), height_px=56, words=WORDS)
        rows.append(f"<tr><th>{escape(name)}</th><td style='width:32em'>{chart}</td></tr>")
    if not rows:
        return ""
    key = legend_html(("used", "cap"), {"used": "used (NVML, all the user's processes)", "cap": "granted"})
    return f"<h2>Usage over the last minutes, per user</h2>{key}<table>{''.join(rows)}</table>"


def _link(text: str, **query: Any) -> _Html:
    href = "?" + "&".join(f"{key}={quote(str(value), safe='')}" for key, value in query.items())
    return _Html(f"<a href='{escape(href)}'>{escape(text)}</a>")


def _paging(status: dict, page: int, user: Optional[str]) -> "tuple[List[dict], List[dict], str]":
    """(the users shown, the kernels shown, a line that says which and links to the others)."""
    users: List[dict] = status["users"]
    kernels: List[dict] = status["kernels"]
    if user is not None:
        users = [u for u in users if u["name"] == user]
        mine = [k for k in kernels if k["user"] == user]
        line = f"<p>{escape(user)}'s page: {len(mine)} kernel(s). {_link('every user', page=1)}</p>"
        return users, mine[:USER_KERNELS], line
    pages = max(1, math.ceil(len(users) / PAGE_USERS))
    page = min(max(page, 1), pages)
    users = users[(page - 1) * PAGE_USERS : page * PAGE_USERS]
    names = {u["name"] for u in users}
    shown = [k for k in kernels if k["user"] in names]
    links = [_link(str(n), page=n) if n != page else f"<b>{n}</b>" for n in range(1, pages + 1)] if pages > 1 else []
    line = (
        f"<p>{len(status['users'])} user(s), {len(kernels)} kernel(s)"
        + (f"; users {(page - 1) * PAGE_USERS + 1} to {(page - 1) * PAGE_USERS + len(users)}" if pages > 1 else "")
        + (f"; pages: {' '.join(links)}" if links else "")
        + "</p>"
    )
    if len(shown) > PAGE_KERNELS:
        line += (
            f"<p>The first {PAGE_KERNELS} of these users' {len(shown)} kernels: a user's name leads to all of "
            "theirs.</p>"
        )
    return users, shown[:PAGE_KERNELS], line


def page_users(status: dict, page: int = 1, user: Optional[str] = None) -> List[str]:
    """The names of the users page `page` (or `user`'s page) shows: whose history it needs."""
    return [u["name"] for u in _paging(status, page, user)[0]]


def render_page(
    status: dict,
    history: Optional[Mapping[str, List[dict]]] = None,
    interval: float = 5.0,
    page: int = 1,
    user: Optional[str] = None,
) -> str:
    """Page `page` (from 1) of `status`, or `user`'s own page; `history`: the points of the users it lists
    (history.UserHistory.points), `interval` seconds apart."""
    viewer = status["viewer"]
    return page_around(viewer["name"], viewer["admin"], page_body(status, history, interval, page, user))


def page_around(viewer: str, admin: bool, body: str) -> str:
    """The page: who looks, then `body` (page_body: the same for every admin, so built once for all of them)."""
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>GPU quota</title>"
        "<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin-bottom:1em}"
        "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left}th{background:#eee}</style></head><body>"
        f"<h1>GPU quota of this host</h1><p>{escape(viewer)}"
        f"{' (admin: every user)' if admin else ' (your kernels only)'}</p>{body}</body></html>"
    )


def page_body(
    status: dict,
    history: Optional[Mapping[str, List[dict]]] = None,
    interval: float = 5.0,
    page: int = 1,
    user: Optional[str] = None,
) -> str:
    """What render_page shows under the viewer's name: the watchdog and which part of the host this page lists,
    the devices, the users, their charts and kernels, then the broker's tables, the sampler's and the watchdog's."""
    users, kernels, paging = _paging(status, page, user)
    parts: List[str] = [
        f"<p>Watchdog: {escape(status['state'])}"
        f"{(' (' + escape(status['problem']) + ')') if status.get('problem') else ''}</p>",
        paging,
        _devices_table(status["devices"]),
        _users_table(users),
        _charts(history or {}, interval, [u["name"] for u in users]),
        _kernels_table(kernels),
        *_broker_tables(status),
        *_sampler_and_watchdog_tables(status),
    ]
    return "".join(parts)


def _devices_table(devices: Sequence[dict]) -> str:
    return _table(
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
            for d in devices
        ),
    )


def _users_table(users: Sequence[dict]) -> str:
    """The users this page lists, each name a link to the user's own page."""
    return _table(
        "Users",
        [
            "user", "default cap", "max cap", "max kernels", "user budget", "kernels", "granted", "used",
            "unmanaged", "kept idle, not parkable",
        ],
        (
            (
                _link(u["name"], user=u["name"]),
                (u["policy"] or {}).get("default_cap", "–"),
                (u["policy"] or {}).get("max_cap", "–"),
                (u["policy"] or {}).get("max_kernels", "–"),
                (u["policy"] or {}).get("user_budget", "–"),
                u["kernels"],
                _size(u["granted"]),
                _size(u["used"]),
                _size(u["unmanaged"]),
                _size(u.get("kept_idle", 0)) if u.get("kept_idle") else "",
            )
            for u in users
        ),
        most=PAGE_USERS,
    )


def _kernels_table(kernels: Sequence[dict]) -> str:
    """A row per kernel and device (one "CPU only" row for a kernel without a device)."""
    return _table(
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
            for k in kernels
            for d in (k["devices"] or [{"uuid": "CPU only", "cap": None, "used": None}])
        ),
        most=len(kernels) * 4 + 1,  # a kernel on several devices has a row each; the kernels are bounded
    )


def _broker_tables(status: dict) -> List[str]:
    """The host's broker: idle memory it cannot park, who waits for device memory, the rooms reserved for resumes,
    the park requests and (an admin's page) the leases waiting for them."""
    return [
        _table(
            "Idle memory that could not be parked (kept by its server: the broker cannot make room with it)",
            ["user", "kernel", "server", "holds", "idle for", "why", "counted against the user's budget"],
            (
                (
                    k["user"], k["kernel_id"], k["server"] or "(default)", _bytes_by_device(k["held"]),
                    _seconds(k["idle_for"]),
                    f"declined a park request {k['declined_park']:.0f} s ago" if k.get("declined_park") is not None
                    else "its server says it cannot park",
                    "yes, once more" if k["counted"] else "no (unparkable_idle = show)",
                )
                for k in sorted(status.get("kept_idle", []), key=lambda k: -sum(k["held"].values()))
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
    ]


def _sampler_and_watchdog_tables(status: dict) -> List[str]:
    """What the host's sampler found outside every grant, the PID registrations it refused, and the watchdog's
    last actions."""
    return [
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
    ]
