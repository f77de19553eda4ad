"""The parker against the fake driver, driven by random sequences of what can happen to a kernel (park and resume
requests, cells starting and ending, samples, other processes filling the device and leaving it, a restart):
after each step has settled, the driver's view and the parker's agree, no process is left locked or half parked,
and no restore ever ran into a device without room (the fake driver breaks a process for good when one does, as
the real one does). No server: a stand-in for jupyter_server's kernel manager and for the monitor, an event
loop."""

import asyncio
import datetime
import os
from types import SimpleNamespace

from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpu_quota_ext.devices import Device
from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.parking import ParkSettings
from gpu_quota_ext.parking.checkpoint import CHECKPOINTED, DRIVER_RUNNING, LOCKED
from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
from gpu_quota_ext.parking.parker import Parker
from gpu_quota_ext.parking.states import HELD
from gpu_quota_ext.shared.contract import PARK_STATES
from gpu_quota_ext.usage import Sample

from .fakes import KERNEL, UUID, Grants, NvmlMonitor, ParkerKernels, ParkerOnALoop, grant

GiB = 1 << 30
TOTAL = 8 * GiB
PIDS = (os.getpid(), os.getppid())  # live processes the fake driver "parks" (it never touches them)


class RestartingKernels(ParkerKernels):
    """... and jupyter_client's restarter, which calls back when it finds the kernel's process dead."""

    def __init__(self):
        super().__init__()
        self.restart_callbacks: list = []

    def on_restart(self, kernel_id, callback):
        self.restart_callbacks.append(callback)
        return lambda: self.restart_callbacks.remove(callback)

    def exit_code(self, kernel_id):
        return -9  # SIGKILL, as the host's out-of-memory killer sends


class ParkerMachine(ParkerOnALoop, RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        FakeNvml.reset()
        FakeCheckpoint.reset()
        FakeNvml.totals = {UUID: TOTAL}
        for pid in PIDS:
            FakeNvml.set_usage(pid, UUID, GiB)
        self.loop = asyncio.new_event_loop()
        self.kernels = RestartingKernels()
        self.monitor = NvmlMonitor(PIDS, TOTAL)
        self.parker = Parker(
            ParkSettings(fresh_sample_wait=0, min_idle=0, device_margin=GiB // 2),
            FakeCheckpoint(),
            self.kernels,
            Grants([grant(KERNEL, {0: 3 * GiB})]),  # the parker reads grants only
            {0: Device(index=0, name="fake", uuid=UUID, total=TOTAL, nvml_index=0)},
            self.monitor,
            host=lambda: (None, None),
        )
        self.start()

    def teardown(self):
        self.close()

    @rule()
    def sample(self):
        super().sample()

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
        self.deliver(lambda: self.parker.turned_busy(KERNEL))

    @rule()
    def cell_ends(self):
        self.kernels.kernel.execution_state = "idle"
        self.kernels.kernel.last_activity = datetime.datetime.now(datetime.timezone.utc)
        self.deliver(lambda: self.parker.turned_idle(KERNEL))

    @rule()
    def others_fill_the_device(self):
        FakeNvml.other_used = {UUID: TOTAL - GiB}

    @rule()
    def others_leave(self):
        FakeNvml.other_used = {}

    @rule()
    def restart(self):
        # The provisioner's cleanup: the old processes are gone (their fake state with them); the new
        # kernel holds its memory again under the same PIDs, as far as this test is concerned.
        self.deliver(lambda: self.parker.forget(KERNEL))
        self.new_processes()

    @rule()
    def killed(self):
        # The process dies (the host's OOM killer) and jupyter_server's restarter starts it again: its "restart"
        # callbacks first, then the same cleanup as a restart. A kernel the driver held is told it was lost.
        record = self.parker.records.get(KERNEL)
        held = record is not None and record.state in HELD
        told_before = KERNEL in self.parker.lost

        def restarter():
            for callback in list(self.kernels.restart_callbacks):
                callback()
            self.parker.forget(KERNEL)

        self.deliver(restarter)
        self.new_processes()
        assert (KERNEL in self.parker.lost) == (held or told_before)
        if held:
            assert "killed by SIGKILL" in self.parker.lost[KERNEL].why
            assert self.parker.kernel_json(KERNEL)["lost"]["why"] == self.parker.lost[KERNEL].why

    def new_processes(self):
        with FakeCheckpoint._lock:
            FakeCheckpoint.states.clear()
            FakeCheckpoint.host.clear()
        for pid in PIDS:
            FakeNvml.set_usage(pid, UUID, GiB)
        self.kernels.kernel.execution_state = "idle"

    @invariant()
    def the_restarter_is_heard_while_the_driver_holds_the_kernel(self):
        record = self.parker.records.get(KERNEL)
        held = record is not None and record.state in HELD
        assert len(self.kernels.restart_callbacks) == (1 if held else 0)

    @invariant()
    def no_restore_ever_found_a_full_device(self):
        assert FakeCheckpoint.broken == set()
        assert (self.parker.records.get(KERNEL) or SimpleNamespace(state=None)).state != "lost"

    @invariant()
    def the_driver_and_the_parker_agree(self):
        if self.parker._tasks:
            return  # only between settled steps
        park = self.parker.kernel_json(KERNEL)
        assert park["state"] in PARK_STATES
        states = {pid: FakeCheckpoint.states.get(pid, DRIVER_RUNNING) for pid in PIDS}
        record = self.parker.records.get(KERNEL)
        if record is None or record.state in ("running", "pending"):
            assert set(states.values()) == {DRIVER_RUNNING}, states  # nothing left locked or parked
            assert all(pid in FakeNvml.usage for pid in PIDS)
            assert park["host_bytes"] is None
        elif record.state in ("parked", "waiting"):
            assert set(states.values()) == {CHECKPOINTED}, states
            assert not any(pid in FakeNvml.usage for pid in PIDS)  # 0 B in NVML
            assert park["host_bytes"] == 2 * GiB
            if record.state == "waiting":
                assert park["reason"] and park["waited"] is not None
        else:
            raise AssertionError(f"unsettled state {record.state} ({states})")
        assert set(states.values()) <= {DRIVER_RUNNING, CHECKPOINTED, LOCKED}


ParkerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestParkerStates = ParkerMachine.TestCase


def test_a_round_parking_cannot_finish_is_logged_and_never_reaches_the_monitor(caplog):
    class Broken(ParkerKernels):
        def activity(self, kernel_id):
            raise RuntimeError("jupyter_server changed under us")

    parker = Parker(ParkSettings(), FakeCheckpoint(), Broken(), Grants(), {}, NvmlMonitor(PIDS, TOTAL))
    parker.driver_problem = None
    parker.on_sample(Sample(state="ok", time=1.0))  # the watchdog runs after this: it must not raise
    assert "parking skipped one sample" in caplog.text and "jupyter_server changed under us" in caplog.text


def test_a_driver_call_from_before_a_restart_does_not_count_for_the_restarted_kernel():
    # The old kernel's checkpoint call is still out (a slow or stuck driver call) when the kernel is restarted and
    # its new process parks: the old call's outcome must not be taken for the new park's (the op numbers of the new
    # record must not start again from where the old one's did), or the new kernel is checkpointed while the
    # parker believes it runs: nothing would ever restore it.
    import threading

    from gpu_quota_ext.parking.checkpoint import CUDA_ERROR_NOT_FOUND, CheckpointError

    entered, release = threading.Event(), threading.Event()

    class OldCallOut(FakeCheckpoint):
        first = True

        def lock(self, pid, timeout_ms):
            if OldCallOut.first:
                OldCallOut.first = False
                entered.set()
                release.wait(10)
                raise CheckpointError("cuCheckpointProcessLock", pid, CUDA_ERROR_NOT_FOUND)  # its process is gone
            super().lock(pid, timeout_ms)

    machine = ParkerMachine()
    machine.parker.driver = OldCallOut()
    try:
        accepted, _ = machine.run(machine.parker.request_park(KERNEL))
        assert accepted
        machine.run(asyncio.to_thread(entered.wait, 5))  # the old park's lock call is out
        machine.parker.forget(KERNEL)  # restarted: the provisioner's cleanup (the old call stays out)
        new_checkpoint = FakeCheckpoint.hang("cuCheckpointProcessCheckpoint")
        machine.run(machine.parker.request_park(KERNEL))
        assert machine.parker.records[KERNEL].state == "parking"

        async def old_call_returns():
            release.set()
            await asyncio.sleep(0.3)  # its outcome reaches the loop

        machine.run(old_call_returns())
        assert machine.parker.records[KERNEL].state == "parking", machine.parker.records[KERNEL]
        new_checkpoint.set()
        machine.settle()
        assert machine.parker.records[KERNEL].state == "parked"
        assert set(FakeCheckpoint.states.values()) == {CHECKPOINTED}
    finally:
        release.set()
        machine.teardown()
