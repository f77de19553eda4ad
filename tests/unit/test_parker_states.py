"""The parker against the fake driver, driven by random sequences of what can happen to a kernel (park
and resume requests, cells starting and ending, samples, restores failing for want of device memory,
a restart): after each step has settled, the driver's view and the parker's agree, and no process is
left locked or half parked. No server: a stand-in for jupyter_server's kernel manager, an event loop."""

import asyncio
import datetime
import os
from types import SimpleNamespace

from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.parking import ParkSettings
from gpu_quota_ext.parking.checkpoint import CHECKPOINTED, LOCKED, RUNNING
from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
from gpu_quota_ext.parking.parker import Parker
from gpu_quota_ext.shared.contract import PARK_STATES

GiB = 1 << 30
KERNEL = "k1"
PIDS = (os.getpid(), os.getppid())  # live processes the fake driver "parks" (it never touches them)


class Kernels:
    """What the parker reads of the server's kernels (usage.kernel_manager.KernelManagerView): ids, execution
    state and last activity, the kernel manager itself (for iopub)."""

    def __init__(self):
        self.kernel = SimpleNamespace(
            execution_state="idle", last_activity=datetime.datetime.now(datetime.timezone.utc)
        )
        self.manager = self

    def kernel_ids(self):
        return [KERNEL]

    def activity(self, kernel_id):
        return (self.kernel.execution_state, self.kernel.last_activity) if kernel_id == KERNEL else (None, None)

    def get_kernel(self, kernel_id):
        if kernel_id != KERNEL:
            raise KeyError(kernel_id)
        return self.kernel  # no connect_iopub: the parker falls back to samples and the calls below


class ParkerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        FakeNvml.reset()
        FakeCheckpoint.reset()
        for pid in PIDS:
            FakeNvml.set_usage(pid, "GPU-0", GiB)
        self.loop = asyncio.new_event_loop()
        self.kernels = Kernels()
        ledger = SimpleNamespace(get=lambda kernel_id: SimpleNamespace(devices=[0]))
        self.parker = Parker(
            ParkSettings(fresh_sample_wait=0),
            FakeCheckpoint(),
            self.kernels,
            ledger,
            host=lambda: (None, None),
            own_uid=0,
        )
        self.run(self._start())

    async def _start(self):
        self.parker.start()
        await self.parker.ready()

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    async def _settle(self):
        while self.parker._tasks:
            await asyncio.gather(*list(self.parker._tasks), return_exceptions=True)

    def settle(self):
        self.run(self._settle())

    def teardown(self):
        self.run(self.parker.stop())
        self.loop.close()
        FakeCheckpoint.reset()
        FakeNvml.reset()

    @rule()
    def sample(self):
        usage = {pid: dict(per) for pid, per in FakeNvml.usage.items() if pid in PIDS}
        kernels = {KERNEL: {0: sum(sum(per.values()) for per in usage.values())}} if usage else {}
        sample = SimpleNamespace(state="ok", kernels=kernels, pids={KERNEL: tuple(sorted(usage))} if usage else {})

        async def deliver():
            self.parker.on_sample(sample)

        self.run(deliver())
        self.settle()

    @rule()
    def request_park(self):
        accepted, park = self.run(self.parker.request_park(KERNEL))
        assert park["state"] in PARK_STATES and isinstance(accepted, bool)
        self.settle()

    @rule()
    def request_resume(self):
        self.run(self.parker.request_resume(KERNEL))
        self.settle()

    @rule()
    def cell_starts(self):
        self.kernels.kernel.execution_state = "busy"

        async def busy():
            self.parker.turned_busy(KERNEL)

        self.run(busy())
        self.settle()

    @rule()
    def cell_ends(self):
        self.kernels.kernel.execution_state = "idle"
        self.kernels.kernel.last_activity = datetime.datetime.now(datetime.timezone.utc)

        async def idle():
            self.parker.turned_idle(KERNEL)

        self.run(idle())
        self.settle()

    @rule()
    def others_take_the_memory(self):
        FakeCheckpoint.fail_restores(1)

    @rule()
    def retry_now(self):
        handle = self.parker._retries.get(KERNEL)
        if handle is not None:
            handle.cancel()

            async def retry():
                self.parker._retry(KERNEL)

            self.run(retry())
            self.settle()

    @rule()
    def restart(self):
        # The provisioner's cleanup: the old processes are gone (their fake state with them); the new
        # kernel holds its memory again under the same PIDs, as far as this test is concerned.
        self.parker.forget(KERNEL)
        with FakeCheckpoint._lock:
            FakeCheckpoint.states.clear()
            FakeCheckpoint.host.clear()
        for pid in PIDS:
            FakeNvml.set_usage(pid, "GPU-0", GiB)
        self.kernels.kernel.execution_state = "idle"

    @invariant()
    def the_driver_and_the_parker_agree(self):
        if self.parker._tasks:
            return  # only between settled steps
        park = self.parker.kernel_json(KERNEL)
        assert park["state"] in PARK_STATES
        states = {pid: FakeCheckpoint.states.get(pid, RUNNING) for pid in PIDS}
        record = self.parker.records.get(KERNEL)
        if record is None or record.state == "pending":
            assert set(states.values()) == {RUNNING}, states  # nothing left locked or parked
            assert all(pid in FakeNvml.usage for pid in PIDS)
            assert park["host_bytes"] is None
        elif record.state == "parked":
            assert set(states.values()) == {CHECKPOINTED}, states
            assert not any(pid in FakeNvml.usage for pid in PIDS)  # 0 B in NVML
            assert park["host_bytes"] == 2 * GiB
        elif record.state == "waiting":
            assert set(states.values()) <= {CHECKPOINTED, LOCKED} and CHECKPOINTED in states.values(), states
            assert "waiting for device memory" in park["reason"]
        else:
            raise AssertionError(f"unsettled state {record.state}")


ParkerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestParkerStates = ParkerMachine.TestCase


def test_a_sample_parking_cannot_read_is_logged_and_never_reaches_the_monitor(caplog):
    ledger = SimpleNamespace(get=lambda kernel_id: None)
    parker = Parker(ParkSettings(), FakeCheckpoint(), Kernels(), ledger)
    parker.on_sample(SimpleNamespace(state="ok", kernels=None, pids=None))  # the watchdog runs after this
    assert "parking skipped one sample" in caplog.text
