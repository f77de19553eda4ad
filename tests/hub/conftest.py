"""What every real-hub test needs first: JupyterHub and configurable-http-proxy installed, and for a test
parametrized over JupyterHub majors (`hub_version`), that major's Python (tests/hub/hub_versions.py). And what
the KubeSpawner tests share (kube_tools.py): no cluster, and a stand-in Kubernetes API."""

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


@pytest.fixture
def no_cluster(tmp_path, monkeypatch, jp_asyncio_loop):
    """KubeSpawner's clients read a kubeconfig of no cluster (each KubeSpawner test module uses it in every test)."""
    from .kube_tools import cluster_free  # KubeSpawner and the Kubernetes clients: imported where a test asks

    yield from cluster_free(tmp_path, monkeypatch, jp_asyncio_loop)


@pytest.fixture
def fake_api(jp_asyncio_loop):
    """A stand-in Kubernetes API on a free port of 127.0.0.1; `fake_api.host` is c.KubeSpawner.k8s_api_host."""
    from .kube_tools import serving_fake_api

    yield from serving_fake_api(jp_asyncio_loop)
