"""Issue 10, items 1 and 6: a start that does not happen costs nothing that outlives it.

A real server, real kernels, real REST calls. After hundreds of refused starts, a failed launch or a
start that loses a race for its kernel id, nothing is left behind: no connection file, no port held in
jupyter_client's port cache, no grant, no pending entry, no process; and the server still answers.
"""

import asyncio
import json
import logging
from pathlib import Path
from unittest import mock

import psutil
import pytest
from jupyter_client.connect import LocalPortCache
from tornado.httpclient import HTTPClientError
from traitlets.config import Config

from gpu_quota_ext.usage.kernels import pending_kernels

from .fake_gpu import manager_of
from .kernels import (
    execute,
    shutdown_kernel,
    start_kernel,
    static_devices_config,
    write_kernelspec,
)


async def leftovers(serverapp) -> dict:
    """What a start may take and must give back when it does not happen (once the ledger's calls,
    made in a thread, are done)."""
    km = serverapp.kernel_manager
    manager = manager_of(serverapp)
    await manager.settled()
    return {
        "connection files": sorted(p.name for p in Path(km.connection_dir).glob("kernel-*.json")),
        "reserved ports": len(LocalPortCache.instance().currently_used_ports),
        "pending": sorted(pending_kernels(km)),
        "kernels": sorted(km.list_kernel_ids()),
        "grants": sorted(g.kernel_id for g in manager.ledger.grants()),
        "secrets": sorted(manager._tokens),
    }


def kernel_processes(kernel_id=None):
    """This test process runs the server: its kernels are its children."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "kernel-" in cmdline and (kernel_id is None or f"kernel-{kernel_id}.json" in cmdline):
            found.append(child)
    return found


async def post_start(jp_fetch, **body):
    """POST /api/kernels; (status, answer)."""
    try:
        response = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3", **body}))
    except HTTPClientError as error:
        return error.code, json.loads(error.response.body)
    return response.code, json.loads(response.body)


# TCP_ON_PURPOSE: what these check includes the ports a start reserves in jupyter_client's port cache, which
# only TCP kernels use; every other test's kernels are on IPC (tests/kernel_transport.py).


class TestRefusalsLeaveNothing:
    @pytest.fixture
    def jp_server_config(self):
        # One 16 GiB device, budget 8 GiB, 8 GiB caps: the first kernel fills it, every later start is refused.
        config = Config(
            static_devices_config("16GiB", default_cap="0.5", max_cap="0.5", overcommit=0.5, on_full="refuse")
        )
        config.KernelManager.transport = "tcp"  # TCP_ON_PURPOSE
        return config

    @pytest.mark.slow
    async def test_hundreds_of_refusals_leave_no_files_no_ports_and_no_tracebacks(
        self, jp_fetch, jp_serverapp, server_log
    ):
        holder = await start_kernel(jp_fetch)
        before = await leftovers(jp_serverapp)
        assert before["grants"] == [holder] and before["reserved ports"] >= 5
        server_log.records.clear()

        answers = []
        for _ in range(6):  # 300 refused starts, 50 at a time
            answers += await asyncio.gather(*(post_start(jp_fetch) for _ in range(50)))

        assert {code for code, _ in answers} == {503}
        assert all("no GPU has 0.5 of budget left" in answer["message"] for _, answer in answers)
        assert (await leftovers(jp_serverapp)) == before
        assert server_log.tracebacks() == []
        refusals = [r for r in server_log.ours() if "refused" in r.getMessage()]
        assert len(refusals) == 300 and all(r.levelno in (logging.INFO, logging.WARNING) for r in refusals)
        # The server still answers, and the kernel that holds the budget still runs.
        assert json.loads((await jp_fetch("api", "gpu-quota", "status")).body)["kernels"][0]["id"] == holder
        assert (await execute(jp_serverapp, holder, "print(6 * 7)")).strip() == "42"
        await shutdown_kernel(jp_fetch, holder)
        assert (await leftovers(jp_serverapp))["reserved ports"] == before["reserved ports"] - 5


@pytest.fixture
def broken_kernelspec(jp_kernel_dir, tmp_path):
    """A kernelspec whose program does not exist: the launch itself fails."""
    spec = {
        "argv": [str(tmp_path / "no-such-kernel"), "-f", "{connection_file}"],
        "display_name": "Broken",
        "language": "python",
    }
    return write_kernelspec(jp_kernel_dir, "broken", spec)


class TestFailedLaunch:
    @pytest.fixture
    def jp_server_config(self):
        config = Config(static_devices_config("16GiB", default_cap="0.25", overcommit=1.0, on_full="refuse"))
        config.KernelManager.transport = "tcp"  # TCP_ON_PURPOSE
        return config

    async def test_a_launch_that_fails_gives_back_its_grant_ports_and_file(
        self, jp_fetch, jp_serverapp, broken_kernelspec
    ):
        before = await leftovers(jp_serverapp)
        for _ in range(3):
            code, _answer = await post_start(jp_fetch, name=broken_kernelspec)
            assert code == 500
        assert (await leftovers(jp_serverapp)) == before
        # The budget it briefly held is free: four 0.25 kernels still fit.
        ids = [await start_kernel(jp_fetch) for _ in range(4)]
        assert len(manager_of(jp_serverapp).ledger.grants()) == 4
        for kernel_id in ids:
            await shutdown_kernel(jp_fetch, kernel_id)


class TestPolicyErrorAtStart:
    @pytest.fixture
    def jp_server_config(self):
        # 1e-7 of 16 GiB is 1.7 KiB: below the 1 MiB floor on this device, known only at the start.
        return Config(static_devices_config("16GiB", caps=[{"kernelspec": "python3", "cap": "0.0000001"}]))

    async def test_a_cap_below_the_floor_fails_the_start_cleanly(self, jp_fetch, jp_serverapp, server_log):
        before = await leftovers(jp_serverapp)
        code, answer = await post_start(jp_fetch)
        assert code == 500
        assert "1 MiB" in answer["message"] and "device 0" in answer["message"]
        assert (await leftovers(jp_serverapp)) == before
        assert server_log.tracebacks() == []


class TestSameKernelIdAtOnce:
    @pytest.fixture
    def jp_server_config(self):
        return Config(static_devices_config("16GiB", "16GiB", default_cap="0.25"))

    async def test_three_starts_with_one_id_give_one_process_and_one_grant(self, jp_fetch, jp_serverapp):
        kernel_id = "0b5e7c1a-5d1f-4c0e-9a57-3f1f0d6a2b11"
        before = await leftovers(jp_serverapp)
        answers = await asyncio.gather(*(post_start(jp_fetch, kernel_id=kernel_id) for _ in range(3)))
        codes = sorted(code for code, _ in answers)
        assert codes[0] == 201 and all(code in (201, 409) for code in codes), answers
        refused = [answer for code, answer in answers if code == 409]
        assert all(kernel_id in answer["message"] and "already" in answer["message"] for answer in refused)
        assert len(kernel_processes(kernel_id)) == 1
        grants = manager_of(jp_serverapp).ledger.grants()
        assert [g.kernel_id for g in grants] == [kernel_id]
        assert sum(len(g.devices) for g in grants) == 1
        assert (await execute(jp_serverapp, kernel_id, "print('alive')")).strip() == "alive"

        await shutdown_kernel(jp_fetch, kernel_id)
        assert kernel_processes(kernel_id) == []
        assert (await leftovers(jp_serverapp)) == before


class TestClientChosenKernelIds:
    """Issue 19, item 5: a client may choose a kernel's id at POST /api/kernels. Four starts at once with one
    id, five rounds: one kernel that GET and DELETE reach, or none at all; never a process or a grant that
    nothing can shut down (jupyter_server's /api/kernels/<id> routes match UUID-like ids only)."""

    @pytest.fixture
    def jp_server_config(self):
        return Config(static_devices_config("16GiB", default_cap="0.25"))

    async def test_four_starts_of_one_uuid_give_one_kernel_that_delete_reaches(self, jp_fetch, jp_serverapp):
        kernel_id = "0b5e7c1a-5d1f-4c0e-9a57-3f1f0d6a2b12"
        before = await leftovers(jp_serverapp)
        for _ in range(5):
            answers = await asyncio.gather(*(post_start(jp_fetch, kernel_id=kernel_id) for _ in range(4)))
            codes = sorted(code for code, _ in answers)
            # 201 for the start that won, and for any that came once it was running ("Using existing kernel").
            assert codes[0] == 201 and set(codes) <= {201, 409}, answers
            assert json.loads((await jp_fetch("api", "kernels", kernel_id)).body)["id"] == kernel_id
            grants = manager_of(jp_serverapp).ledger.grants()
            assert [(g.kernel_id, sum(g.caps.values())) for g in grants] == [(kernel_id, 4 << 30)]
            assert len(kernel_processes(kernel_id)) == 1
            assert (await jp_fetch("api", "kernels", kernel_id, method="DELETE")).code == 204
            assert kernel_processes(kernel_id) == []
            assert (await leftovers(jp_serverapp)) == before

    @pytest.mark.parametrize("kernel_id", ["dup", "a/b", "../../etc", "x" * 300, "a-b-c-d-" + "e" * 200])
    async def test_an_id_the_kernel_routes_cannot_reach_is_refused_and_takes_nothing(
        self, jp_fetch, jp_serverapp, server_log, kernel_id
    ):
        before = await leftovers(jp_serverapp)
        for _ in range(5):
            answers = await asyncio.gather(*(post_start(jp_fetch, kernel_id=kernel_id) for _ in range(4)))
            assert [code for code, _ in answers] == [400] * 4, answers
            assert all("routes can reach" in answer["message"] for _, answer in answers)
        assert (await leftovers(jp_serverapp)) == before
        assert kernel_processes() == []
        assert server_log.tracebacks() == []
        # The server still starts kernels with ids it chose, and one a client chose that its routes reach.
        chosen = "a-b-c-d-e"
        assert (await post_start(jp_fetch, kernel_id=chosen))[0] == 201
        await shutdown_kernel(jp_fetch, chosen)
        assert (await leftovers(jp_serverapp)) == before


class TestRefusedSessionStart:
    """Issue 19, item 5: JupyterLab opens a notebook with POST /api/sessions; jupyter_server answered a refused
    kernel start there with a 500 whose message began "HTTP 503: GPU budget full (". It gets what POST
    /api/kernels gets: the 503 and the quota's own words."""

    @pytest.fixture
    def jp_server_config(self):
        return Config(
            static_devices_config("16GiB", default_cap="0.5", max_cap="0.5", overcommit=0.5, on_full="refuse")
        )

    async def post_session(self, jp_fetch, path):
        body = {"path": path, "type": "notebook", "name": path, "kernel": {"name": "python3"}}
        try:
            response = await jp_fetch("api", "sessions", method="POST", body=json.dumps(body))
        except HTTPClientError as error:
            return error.code, json.loads(error.response.body)
        return response.code, json.loads(response.body)

    async def test_a_full_gpu_answers_a_session_as_it_answers_a_kernel_start(self, jp_fetch, jp_serverapp, server_log):
        code, first = await self.post_session(jp_fetch, "holds.ipynb")
        assert code == 201
        before = await leftovers(jp_serverapp)
        server_log.records.clear()
        session = await self.post_session(jp_fetch, "refused.ipynb")
        kernel = await post_start(jp_fetch)
        assert session == kernel and session[0] == 503, (session, kernel)
        message = session[1]["message"]
        assert message.startswith("GPU quota: kernel not started: no GPU has 0.5 of budget left"), message
        assert "HTTP 503" not in message and session[1]["reason"] == "GPU budget full"
        assert server_log.tracebacks() == []
        assert (await leftovers(jp_serverapp)) == before
        # jupyter_server's sessions route is otherwise its own: listed, and shut down with its kernel.
        listed = json.loads((await jp_fetch("api", "sessions")).body)
        assert [s["path"] for s in listed] == ["holds.ipynb"]
        await jp_fetch("api", "sessions", first["id"], method="DELETE")
        assert await self.post_session(jp_fetch, "now-it-fits.ipynb") == (201, mock.ANY)
