"""The fixtures the integration tests share, found by pytest here: a test names one as an argument and never
imports it. The helpers beside them (fake_gpu.py, fake_mps.py, kernels.py, servers.py) hold plain functions.
The short runtime directory of the hard-limit tests (their daemon's sockets) is tests/conftest.py's."""

import logging

import pytest

from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
from gpu_quota_ext.shared.sizes import GiB


@pytest.fixture
def fake_nvml():
    """The fake NVML's readings, empty for the test and after it."""
    FakeNvml.reset()
    yield FakeNvml
    FakeNvml.reset()


@pytest.fixture
def fake_driver(fake_nvml):
    """The fake checkpoint driver (tied to the fake NVML), its calls and hangs reset for the test and after it."""
    FakeCheckpoint.reset()
    yield FakeCheckpoint
    FakeCheckpoint.reset()


@pytest.fixture
def full_devices(fake_driver):
    """The fake GPUs can fill up: 16 GiB each, as the test servers' static inventory says."""
    FakeNvml.totals = {"static-0": 16 * GiB, "static-1": 16 * GiB}
    yield FakeNvml.totals


class LogLines(logging.Handler):
    """Every record of the loggers a refusal could write to (the server's own logger does not propagate)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        # The extension's logger writes through the server's log too: one record may reach us twice.
        if not any(record is seen for seen in self.records[-8:]):
            self.records.append(record)

    def tracebacks(self):
        return [r for r in self.records if r.exc_info or "Traceback" in r.getMessage()]

    def ours(self):
        return [r for r in self.records if r.name == "gpu_quota_ext"]


@pytest.fixture
def server_log(jp_serverapp):
    """What the test's server logs, every level, while the test runs."""
    handler = LogLines()
    loggers = [jp_serverapp.log, logging.getLogger("gpu_quota_ext"), logging.getLogger("tornado.application"),
               logging.getLogger("tornado.general")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    yield handler
    for logger, level in zip(loggers, levels):
        logger.removeHandler(handler)
        logger.setLevel(level)
