"""`%gpucap park` and `%gpucap resume` in real kernels started by a real jupyter_server (pytest-jupyter)
through POST /api/kernels, as a notebook user sees them.

What the server does with the request is the server side of parking: where this server has no park routes,
jupyter_server's catch-all answers with its own HTML error page (a 403, since it asks a POST for an XSRF
cookie before it finds no route; a 404 otherwise), and the magic says so in one line. Every request is seen
where the server logs it (tornado's `log_function`), so the tests know the request reached the server, on the
contract's path, with the kernel's own secret, whatever it answered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import pytest
from jupyter_server.utils import url_path_join
from traitlets.config import Config

from gpu_quota_ext.kernel.park import PARK_ANNOUNCEMENT
from gpu_quota_ext.shared.contract import (
    KERNEL_TOKEN_HEADER,
    PARK_SUFFIX,
    RESUME_SUFFIX,
    kernel_path,
)

from .cell_output import CellOutput, run_cell
from .kernels import execute, start_kernel, static_devices_config

NO_ROUTE = (
    "gpu-quota: error: this server cannot park kernels: it has no {} route (HTTP {}; its gpu-quota-ext predates "
    "parking)"
)
OUR_ROUTES = (200, 202, 400, 404, 409)  # what the park handlers answer (JSON); anything else is not them


@pytest.fixture
def jp_server_config():
    return Config(static_devices_config("80GiB", default_cap="0.25", max_cap="0.5"))


@dataclass
class Seen:
    method: str
    path: str
    status: int
    kernel_token: bool  # the kernel's secret header came along (its value is never kept here)


@pytest.fixture
def requests_seen(jp_serverapp):
    """Every request the server finished, as its log sees it."""
    settings = jp_serverapp.web_app.settings
    original = settings.get("log_function")
    seen: List[Seen] = []

    def record(handler) -> None:
        request = handler.request
        seen.append(Seen(request.method, request.path, handler.get_status(), KERNEL_TOKEN_HEADER in request.headers))
        if original is not None:
            original(handler)

    settings["log_function"] = record
    yield seen
    if original is None:
        settings.pop("log_function", None)
    else:
        settings["log_function"] = original


def posts_to(seen: List[Seen], serverapp, kernel_id: str, suffix: str) -> List[Seen]:
    path = url_path_join(serverapp.base_url, kernel_path(kernel_id, suffix))
    return [s for s in seen if s.method == "POST" and s.path == path]


def only_line(out: CellOutput) -> str:
    """The cell succeeded and said exactly one line, on stdout or stderr, and no traceback."""
    assert out.status == "ok" and out.errors == [], out
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1, out
    assert "Traceback" not in out.stdout + out.stderr
    return lines[0]


@pytest.mark.parametrize("word, suffix", [("park", PARK_SUFFIX), ("resume", RESUME_SUFFIX)])
async def test_the_request_reaches_the_server_and_its_answer_is_one_line(
    jp_fetch, jp_serverapp, requests_seen, word, suffix
):
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "%gpucap")  # the full magic loaded, so only our request is counted
    out = await run_cell(jp_serverapp, kernel_id, f"%gpucap {word}")
    line = only_line(out)
    posts = posts_to(requests_seen, jp_serverapp, kernel_id, suffix)
    assert len(posts) == 1, requests_seen
    assert posts[0].kernel_token  # the kernel asked for itself, with its own secret
    status = posts[0].status
    if status not in OUR_ROUTES or "predates parking" in line:  # a server without the park routes
        assert line == NO_ROUTE.format(suffix, status)
        assert out.stdout == ""
    elif status == 202 and word == "park" and out.stderr == "":
        assert line == f"gpu-quota: {PARK_ANNOUNCEMENT}"
    elif status == 202 and word == "resume":
        assert line.startswith("gpu-quota: ") and "rarely needed: your next cell resumes" in line
    else:  # a refusal: the server's words, once
        assert line.startswith("gpu-quota: error: ")
        assert "cannot park: cannot park" not in line and "cannot park: not parkable" not in line


async def test_a_server_without_the_park_routes_gives_one_clear_line(jp_fetch, jp_serverapp, requests_seen):
    # Aimed under a prefix where the server has no route at all, the request is a 404 on any server,
    # with or without the server side of parking.
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "%gpucap")
    out = await run_cell(
        jp_serverapp,
        kernel_id,
        "from gpu_quota_ext.kernel import magic\n"
        "client = magic._loaded[0].client\n"
        "client.api_url = client.api_url + 'no-such-prefix/'\n"
        "%gpucap park",
    )
    statuses = [s.status for s in requests_seen if s.method == "POST" and s.path.endswith("/" + PARK_SUFFIX)]
    assert len(statuses) == 1 and statuses[0] in (403, 404)
    assert only_line(out) == NO_ROUTE.format(PARK_SUFFIX, statuses[0])
    token = (
        await execute(jp_serverapp, kernel_id, "from gpu_quota_ext.kernel.state import STATE; print(STATE.token)")
    ).strip()
    assert token and token not in out.stdout + out.stderr


async def test_park_with_a_device_is_a_usage_error_and_asks_nobody(jp_fetch, jp_serverapp, requests_seen):
    kernel_id = await start_kernel(jp_fetch)
    await execute(jp_serverapp, kernel_id, "%gpucap")
    out = await run_cell(jp_serverapp, kernel_id, "%gpucap --device 0 park")
    assert out.status == "error" and out.stdout == ""
    assert out.stderr.strip() == "UsageError: --device cannot be used with 'park'"
    assert posts_to(requests_seen, jp_serverapp, kernel_id, PARK_SUFFIX) == []


async def test_help_says_park_and_resume(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    out = await execute(jp_serverapp, kernel_id, "%gpucap --help")
    assert "%gpucap park" in out and "%gpucap resume" in out
