"""What every real-hub test needs first: JupyterHub and configurable-http-proxy installed."""

import os

import pytest

from .hubtools import missing_setup


@pytest.fixture(scope="module")
def setup_ok():
    problem = missing_setup()
    if problem:
        message = f"THE JUPYTERHUB TEST DID NOT RUN: {problem}. Run `bash tests/hub/setup.sh` first."
        if os.environ.get("CI"):
            pytest.fail(message)  # in CI the setup always runs: its absence is a failure, not a skip
        pytest.skip(message)
