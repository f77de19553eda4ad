"""What every real-hub test needs first: JupyterHub and configurable-http-proxy installed, and for a test
parametrized over JupyterHub majors (`hub_version`), that major's Python (tests/hub/hub_versions.py)."""

import os
from typing import NamedTuple

import pytest

from .hub_versions import python_for
from .hubtools import missing_setup


def _not_run(problem: str) -> None:
    message = f"THE JUPYTERHUB TEST DID NOT RUN: {problem}. Run `bash tests/hub/setup.sh` first."
    if os.environ.get("CI"):
        pytest.fail(message)  # in CI the setup always runs: its absence is a failure, not a skip
    pytest.skip(message)


@pytest.fixture(scope="module")
def setup_ok():
    problem = missing_setup()
    if problem:
        _not_run(problem)


class HubVersion(NamedTuple):
    major: int
    python: str  # runs the hub, and so its services: tests/hub/hubtools.Hub(python=...)


@pytest.fixture
def hub_version(request, setup_ok) -> HubVersion:
    """The JupyterHub major the test is parametrized with (indirect=True), and the Python that has it."""
    python, problem = python_for(request.param)
    if python is None:
        _not_run(problem)
    return HubVersion(request.param, python)
