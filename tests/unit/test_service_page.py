"""The admin's page is cheap and bounded (issue 30 item 7): 200 users of 200 kernels make a page of a few dozen
KiB, paged by users, each chart from at most 60 points with its peaks kept; it is built in a thread of its own
and kept a moment, so admins reloading it cost one build and never hold the event loop that answers grants."""

import asyncio
import threading

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.hub.service.book import HostBook
from gpu_quota_ext.hub.service.history import UserHistory, user_points
from gpu_quota_ext.hub.service.page import CHART_POINTS, PAGE_USERS, downsample, page_users, render_page
from gpu_quota_ext.hub.service.snapshots import Snapshots
from gpu_quota_ext.hub.service.status import build_status
from gpu_quota_ext.hub.service.user_policy import UserLimits, UserPolicy
from gpu_quota_ext.policy import PolicyDecision, build_policy
from gpu_quota_ext.shared.sizes import GiB, parse_cap

DEVICE = Device(0, "Test GPU", "GPU-a", 80 * GiB, 0)
POLICY = UserPolicy(
    PolicyDecision(parse_cap("256MiB"), parse_cap("0.5"), 1, "test"), "cpu-only", UserLimits(1000, None)
)


class Journal:
    def __getattr__(self, name):
        return lambda *args: None


def host(users=200):
    book = HostBook([DEVICE], build_policy("256MiB", "1.0", overcommit=1.0), Journal(), 60, 0)
    for i in range(users):
        book.grant(f"user{i:03d}", "", f"k{i:03d}", "python3", POLICY, None, 100.0)
    history = UserHistory()
    for t in range(300):
        status = build_status(book, None, "ok", [], {}, "history", True, 100.0 + 5 * t)
        status["sampled_at"] = 100.0 + 5 * t
        history.record(user_points(status, sampled=True))
    return book, history


def test_200_users_of_200_kernels_make_a_bounded_page_of_25_users_and_their_charts():
    book, history = host()
    status = build_status(book, None, "ok", [], {}, "carol", True, 1700.0)
    names = page_users(status, 1)
    assert names == [f"user{i:03d}" for i in range(PAGE_USERS)]
    page = render_page(status, history.points(names), 5.0, page=1)
    assert len(page.encode()) < 150 * 1024, len(page.encode())
    assert page.count('<svg class="gpu-quota-chart"') == PAGE_USERS
    assert "<td>k024</td>" in page and "<td>k025</td>" not in page
    assert "200 user(s), 200 kernel(s); users 1 to 25" in page and "href='?page=8'" in page
    last = render_page(status, history.points(page_users(status, 8)), 5.0, page=8)
    assert "<td>k199</td>" in last and "<td>k000</td>" not in last and "users 176 to 200" in last
    assert "users 176 to 200" in render_page(status, {}, 5.0, page=99)  # past the end: the last page


def test_one_users_page_lists_all_their_kernels_and_only_theirs():
    book, _ = host(users=3)
    for k in range(150):
        book.grant("user001", "", f"many{k}", "python3", POLICY, None, 100.0)
    status = build_status(book, None, "ok", [], {}, "carol", True, 200.0)
    page = render_page(status, {}, 5.0, user="user001")
    assert "user001's page: 151 kernel(s)" in page
    assert "<td>many149</td>" in page and "<td>k000</td>" not in page
    everyone = render_page(status, {}, 5.0)
    assert "The first 100 of these users' 153 kernels" in everyone
    assert "href='?user=user001'" in everyone


def test_a_chart_is_drawn_from_60_points_at_most_and_keeps_the_peaks():
    points = [{"t": float(t), "used": 1.0, "cap": 2.0} for t in range(300)]
    points[123]["used"] = 50.0
    points[200]["used"] = None  # unknown in one sample: its group still has known ones
    kept, step = downsample(points)
    assert len(kept) <= CHART_POINTS and step == 5
    assert max(p["used"] for p in kept) == 50.0 and all(p["used"] is not None for p in kept)
    assert kept[-1]["t"] == 299.0
    gap = [{"t": float(t), "used": None, "cap": 2.0} for t in range(10)]
    assert downsample(gap, most=2)[0][0]["used"] is None  # nothing known stays unknown, never 0
    assert downsample(points[:30])[1] == 1  # few points: drawn as they are


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_loads_of_one_view_share_one_build_and_it_is_kept_for_its_seconds():
    clock = Clock()
    built = []

    def build(view):
        built.append(view)
        return f"page {view} #{len(built)}"

    snapshots = Snapshots(build, seconds=2.0, clock=clock)

    async def scenario():
        pages = await asyncio.gather(*(snapshots.get("admin") for _ in range(4)))
        assert pages == ["page admin #1"] * 4
        clock.now = 1.9
        assert await snapshots.get("admin") == "page admin #1"
        assert await snapshots.get("alice") == "page alice #2"  # another view: its own
        clock.now = 2.0
        assert await snapshots.get("admin") == "page admin #3"

    asyncio.run(scenario())
    snapshots.close()
    assert built == ["admin", "alice", "admin"]


def test_a_failed_build_is_not_kept():
    attempts = []

    def build(view):
        attempts.append(view)
        if len(attempts) == 1:
            raise RuntimeError("the book changed under the build")
        return "page"

    snapshots = Snapshots(build, seconds=60.0, clock=Clock())

    async def scenario():
        with pytest.raises(RuntimeError):
            await snapshots.get("admin")
        assert await snapshots.get("admin") == "page"

    asyncio.run(scenario())
    snapshots.close()


def test_a_build_runs_off_the_event_loop():
    """While the page is being built (held here until released), the loop goes on answering others."""
    release = threading.Event()
    snapshots = Snapshots(lambda view: "page" if release.wait(10) else "timed out", seconds=2.0, clock=Clock())

    async def scenario():
        load = asyncio.ensure_future(snapshots.get("admin"))
        answered = []

        async def grant():
            answered.append("carol's grant")

        await asyncio.wait_for(grant(), 1.0)  # served while the build is held
        assert answered == ["carol's grant"] and not load.done()
        release.set()
        assert await load == "page"

    asyncio.run(scenario())
    snapshots.close()


def test_the_page_thread_is_made_with_the_service_and_is_the_only_one_its_loads_use():
    """The service's threads are a fixed set from its start: the page's worker is there before any load, and loads
    of the page add none (a thread appearing at an admin's first load would read as a leak)."""
    before = {t.ident for t in threading.enumerate()}
    snapshots = Snapshots(lambda view: f"page {view}", seconds=0.0, clock=Clock())
    made = [t for t in threading.enumerate() if t.ident not in before]
    assert [t.name.startswith("gpu-quota-page") for t in made] == [True], made

    async def loads():
        return [await snapshots.get(view) for view in ("admin", "alice", "admin")]

    assert asyncio.run(loads()) == ["page admin", "page alice", "page admin"]
    assert {t.ident for t in threading.enumerate()} - before == {made[0].ident}
    snapshots.close()
