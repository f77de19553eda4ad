"""The kernel's cap record: one writer (KernelCapState.write_caps) under one lock, used by both the
magic's PUT answer and the background sync after each cell."""

import threading

from gpu_quota_ext.kernel import sync
from gpu_quota_ext.kernel.client import CapAnswer
from gpu_quota_ext.kernel.command import Command
from gpu_quota_ext.kernel.magic import GpuCap
from gpu_quota_ext.kernel.state import DeviceCap, KernelCapState

from .fakes import OfflineClient

WAIT_S = 10  # a deadline for a thread that should finish at once, not a timing threshold


def record() -> KernelCapState:
    return KernelCapState(
        kernel_id="k", devices=[DeviceCap(0, 3, "GPU-a", 10, 40, 100), DeviceCap(1, 4, "GPU-b", 10, 40, 100)]
    )


def test_write_caps_changes_caps_max_caps_and_source_together():
    state = record()
    assert state.write_caps([{"index": 3, "cap": 25, "max_cap": 50}, {"index": 9, "cap": 1}], "the server (x)") is True
    assert [(d.cap, d.max_cap) for d in state.devices] == [(25, 50), (10, 40)]
    assert state.cap_source == "the server (x)"


def test_write_caps_only_if_changed_leaves_an_unchanged_record_alone():
    state = record()
    assert state.write_caps([{"index": 3, "cap": 10, "max_cap": 99}], "sync", only_if_changed=True) is False
    assert state.devices[0].max_cap == 40 and state.cap_source == "the server, at kernel start"
    # Garbage entries are skipped, not raised on.
    assert state.write_caps([None, "x", {"cap": 5}], "sync", only_if_changed=True) is False


def test_the_sync_writes_under_the_records_lock(monkeypatch):
    monkeypatch.setattr(sync, "put_caps_in_force", lambda s, env=None: [])
    state = record()

    class Client(OfflineClient):
        def grant(self):
            return {"source": "user request", "devices": [{"index": 3, "cap": 30, "max_cap": 40}]}

    done = threading.Event()
    with state.lock:  # another writer (the magic's PUT answer) holds the record
        worker = threading.Thread(target=lambda: (sync.sync_caps(state, Client()), done.set()))
        worker.start()
        assert not done.wait(0.2)  # the sync waits for the lock ...
        assert state.devices[0].cap == 10 and state.cap_source == "the server, at kernel start"
    assert done.wait(WAIT_S)  # ... and writes once it is free
    worker.join(WAIT_S)
    assert state.devices[0].cap == 30 and "user request" in state.cap_source


def test_the_magics_put_answer_goes_through_the_same_writer(monkeypatch):
    state = record()
    calls = []
    original = KernelCapState.write_caps

    def spy(self, granted, source, only_if_changed=False):
        assert not self.lock.locked()
        calls.append(source)
        return original(self, granted, source, only_if_changed)

    monkeypatch.setattr(KernelCapState, "write_caps", spy)
    magic = GpuCap(object(), state, client=None, env={})
    answer = CapAnswer("granted", "ok", [{"index": 4, "cap": 33, "max_cap": 40}], "kernel request", 200)
    magic.record(answer, Command(action="set"))
    assert calls == ["%gpucap, granted by the server"]
    assert [d.cap for d in state.devices] == [10, 33] and not state.lock.locked()
