"""The unit tests' fakes answer as what they stand in for: each is checked against the package's Protocol or class
(fakes.differences), and mypy reads fakes.py against them (an override that takes or gives other types), so a
changed interface fails here, by name, rather than leaving tests that pass against the old one."""

from pathlib import Path

import pytest

from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.devices.nvml import NvmlBackend
from gpu_quota_ext.kernel.client import QuotaClient
from gpu_quota_ext.ledger import GrantReads
from gpu_quota_ext.ledger.interface import HeldGrants
from gpu_quota_ext.parking.kernel_channel import KernelChannel
from gpu_quota_ext.parking.parker import ParkedKernels, Sampling
from gpu_quota_ext.usage import Sample
from gpu_quota_ext.usage.kernels import KernelActions, KernelEnds, KernelManagerView, KernelRoots
from gpu_quota_ext.usage.processes import ProcTable
from gpu_quota_ext.usage.sampling import Monitor

from . import fakes
from .fakes import (
    Grants,
    NvmlMonitor,
    OfflineClient,
    ParkerKernels,
    ProcSnapshot,
    StillMonitor,
    UsageKernels,
    differences,
)
from .test_fast_park_parker import PagesKernel
from .test_magic_caps import FakeClient
from .test_magic_park import FakeParkClient
from .test_magic_sync import Client as SyncClient
from .test_parker_states import RestartingKernels
from .test_sample_time import SlowNvml
from .test_types import mypy

# (the fake, what it stands in for): each subclasses its Protocol or class, and has every member a Protocol asks for
SUBCLASSES = [
    (ParkerKernels, ParkedKernels),
    (RestartingKernels, ParkedKernels),
    (UsageKernels, KernelRoots),
    (UsageKernels, KernelEnds),
    (UsageKernels, KernelActions),
    (lambda: StillMonitor(Sample(state="starting")), Sampling),
    (lambda: NvmlMonitor((1,), 1 << 30), Sampling),
    (Grants, HeldGrants),
    (ProcSnapshot, ProcTable),
    (OfflineClient, QuotaClient),
    (FakeClient, QuotaClient),
    (lambda: FakeParkClient(None), QuotaClient),
    (lambda: SyncClient({}), QuotaClient),
    (PagesKernel, KernelChannel),
    (SlowNvml, NvmlBackend),
]

# (the fake, the real class or wider Protocol the code is given): what the fake has of it takes the same parameters
ALIKE = [
    (ParkerKernels, KernelManagerView),  # the parker's and the manager's kernels are a KernelManagerView
    (UsageKernels, KernelManagerView),
    (lambda: StillMonitor(Sample(state="starting")), Monitor),
    (lambda: NvmlMonitor((1,), 1 << 30), Monitor),
    (Grants, GrantReads),  # the parker and the lifecycle are given a ledger's reads only
]


@pytest.fixture(autouse=True)
def no_usage_left():
    yield
    FakeNvml.reset()  # PagesKernel puts its process's usage in the fake NVML


def named(value):
    return getattr(value, "__name__", None)


@pytest.mark.parametrize("make, interface", SUBCLASSES, ids=named)
def test_the_fake_subclasses_what_it_stands_in_for_and_answers_as_it_does(make, interface):
    fake = make()
    assert interface in type(fake).__mro__
    assert differences(fake, interface) == []


@pytest.mark.parametrize("make, interface", ALIKE, ids=named)
def test_what_the_fake_has_of_the_real_one_takes_the_same_parameters(make, interface):
    assert differences(make(), interface, whole=False) == []


def test_a_fake_that_strays_is_found():
    # The check above can fail: a missing member of a Protocol, other parameters, a method that is not async.
    class NoRestarter(ParkedKernels):
        def kernel_ids(self):
            return []

        def activity(self, kernel_id, when):
            return None, None

        def watch_status(self, kernel_id, on_state):
            return None

    class SyncKernels(UsageKernels):
        def dead_ids(self):
            return []

    assert differences(NoRestarter(), ParkedKernels) == [
        "activity: takes (self, kernel_id, when), the interface (self, kernel_id)",
        "on_restart: missing",
        "exit_code: missing",
    ]
    assert differences(SyncKernels(), KernelEnds) == ["dead_ids: async in one of them only"]


def test_mypy_finds_the_fakes_typed_as_what_they_stand_in_for(tmp_path):
    done = mypy(str(Path(fakes.__file__)), cache=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
