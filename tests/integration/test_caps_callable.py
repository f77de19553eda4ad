"""Issue 10, item 10: a `caps` callable is the admin's code, run at every kernel start.

Its answer obeys max_cap like a list rule's; when it raises, hangs or answers nonsense the kernel starts
with the default policy and the log says so in one line; it runs off the event loop, so a slow one
never stalls the server. Real server, real kernels.
"""

import asyncio
import json
import logging
import threading

import pytest
from traitlets.config import Config

from gpu_quota_ext.shared.sizes import GiB

from .fake_gpu import manager_of, wait_for
from .kernels import kernel_env, start_kernel, static_devices_config

TOTAL = 16 * GiB


def config(caps, **settings):
    return Config(static_devices_config("16GiB", default_cap="0.25", max_cap="0.5", caps=caps, **settings))


async def grant_of(jp_fetch, kernel_id):
    return json.loads((await jp_fetch("api", "gpu-quota", "kernels", kernel_id)).body)


def callable_warnings(caplog):
    return [
        r
        for r in caplog.records
        if r.name == "gpu_quota_ext" and r.levelno >= logging.WARNING and "caps callable" in r.getMessage()
    ]


class TestAnswerAboveMaxCap:
    @pytest.fixture
    def jp_server_config(self):
        return config(lambda user, kernelspec: "1.0")

    async def test_the_answer_is_clamped_to_max_cap(self, jp_fetch, jp_serverapp):
        kernel_id = await start_kernel(jp_fetch)
        grant = await grant_of(jp_fetch, kernel_id)
        assert grant["devices"][0]["cap"] == grant["devices"][0]["max_cap"] == int(0.5 * TOTAL)
        assert grant["source"] == "caps callable (clamped to max_cap 0.5)"
        env = await kernel_env(jp_serverapp, kernel_id, ["CUPY_GPU_MEMORY_LIMIT"])
        assert env["CUPY_GPU_MEMORY_LIMIT"] == str(int(0.5 * TOTAL))


def broken_caps(user, kernelspec):
    raise KeyError("no such group in the admin's table")


class TestRaisingCallable:
    @pytest.fixture
    def jp_server_config(self):
        return config(broken_caps)

    async def test_the_kernel_gets_the_default_policy_and_one_warning(self, jp_fetch, jp_serverapp, caplog):
        caplog.set_level(logging.INFO)
        kernel_id = await start_kernel(jp_fetch)
        grant = await grant_of(jp_fetch, kernel_id)
        assert grant["devices"][0]["cap"] == int(0.25 * TOTAL)
        assert grant["source"] == "default (caps callable failed)"
        (warning,) = callable_warnings(caplog)
        assert "no such group in the admin's table" in warning.getMessage()
        assert not any(r.exc_info for r in caplog.records)
        assert not any("Traceback" in r.getMessage() for r in caplog.records)


class Gate:
    """A callable that blocks until the test lets it go, saying when it is inside."""

    def __init__(self):
        self.inside = threading.Event()
        self.go = threading.Event()
        self.finished = threading.Event()

    def __call__(self, user, kernelspec):
        self.inside.set()
        self.go.wait(60)
        self.finished.set()
        return "0.4"


class TestSlowCallable:
    gate = Gate()

    @pytest.fixture
    def jp_server_config(self):
        type(self).gate = Gate()
        return config(lambda user, kernelspec: type(self).gate(user, kernelspec))

    async def test_the_server_answers_while_the_callable_runs(self, jp_fetch, jp_serverapp):
        gate = self.gate
        starting = asyncio.ensure_future(start_kernel(jp_fetch))
        await wait_for(gate.inside.is_set)
        # The callable is blocked in its thread: the event loop still serves requests.
        status = json.loads((await jp_fetch("api", "gpu-quota", "status")).body)
        assert status["kernels"] == []
        assert gate.inside.is_set() and not gate.finished.is_set() and not starting.done()
        gate.go.set()
        kernel_id = await starting
        grant = await grant_of(jp_fetch, kernel_id)
        assert grant["devices"][0]["cap"] == int(0.4 * TOTAL) and grant["source"] == "caps callable"

    async def test_a_callable_that_does_not_answer_in_time_gives_the_default_policy(
        self, jp_fetch, jp_serverapp, caplog
    ):
        gate = self.gate
        manager_of(jp_serverapp).caps_timeout = 0.2
        try:
            kernel_id = await start_kernel(jp_fetch)
            grant = await grant_of(jp_fetch, kernel_id)
            assert grant["devices"][0]["cap"] == int(0.25 * TOTAL)
            assert grant["source"] == "default (caps callable failed)"
            (warning,) = callable_warnings(caplog)
            assert "no answer within 0.2 s" in warning.getMessage()
            assert not gate.finished.is_set()  # still blocked: the start did not wait for it
        finally:
            gate.go.set()
        # Its thread ends when the callable returns; its late answer changes nothing.
        await wait_for(lambda: not any(t.name == "gpu-quota-caps-callable" for t in threading.enumerate()))
        assert (await grant_of(jp_fetch, kernel_id))["devices"][0]["cap"] == int(0.25 * TOTAL)
