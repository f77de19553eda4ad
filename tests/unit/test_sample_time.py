"""A sample's time is when its reading began, not when it came back: what is decided on a sample "taken after"
something (a restore's reservation ends on one, a park counts as under way before one) needs the reading itself to
be later, and attributing the processes after it takes a while."""

import time

from gpu_quota_ext.devices import Device
from gpu_quota_ext.devices.nvml import NvmlBackend
from gpu_quota_ext.usage.sampling import Monitor

from .fakes import UsageKernels

GiB = 1 << 30


class SlowNvml(NvmlBackend):
    def __init__(self):
        self.read_at = None

    def device_used(self, uuid):
        self.read_at = time.time()
        return GiB

    def device_processes(self, uuid):
        time.sleep(0.05)  # the reading is done; what follows it (attribution) takes its time
        return []


def test_a_sample_is_timed_at_the_start_of_its_reading():
    backend = SlowNvml()
    monitor = Monitor([Device(0, "GPU", "GPU-0", 8 * GiB)], backend, UsageKernels(), 1.0)
    sample = monitor.sample({}, set())
    assert sample.state == "ok" and sample.time is not None
    assert sample.time <= backend.read_at


def test_the_host_services_sample_says_when_its_reading_began():
    # The host's broker ends a reservation on a sample taken after the kernel was reported running again, and
    # counts a kernel whose park request was taken as parked on a sample taken since: both need the reading's time.
    from gpu_quota_ext.hub.service.sampler import HostSampler

    backend = SlowNvml()
    sampler = HostSampler(backend, ["GPU-0"], list, dict, 1.0, 5.0, "warn", 10, "{username}")
    sampler._tick()
    assert sampler.last is not None and sampler.last.read_at <= backend.read_at <= sampler.last.taken_at
