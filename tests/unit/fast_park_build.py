"""The fast park library and the fake CUDA driver under it, compiled for a test module in a folder of its own."""

import pytest

from gpu_quota_ext.parking.pages.build import BuildError, build
from tests.fake_cuda import build_fake


def build_both(tmp_path_factory, name: str):
    """(the library, the fake driver), built under a new folder `name` outside the repository; a compiler that
    fails fails the test, with its words."""
    folder = tmp_path_factory.mktemp(name)
    try:
        return build(folder), build_fake(folder)
    except BuildError as error:
        pytest.fail(f"the fast park tests compile C with the system's compiler, and could not: {error}")
