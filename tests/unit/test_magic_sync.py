"""Caps changed outside the kernel: the kernel takes the server's record as it is."""

from gpu_quota_ext.kernel import sync
from gpu_quota_ext.kernel.state import DeviceCap, KernelCapState

from .fakes import OfflineClient


class Client(OfflineClient):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def grant(self):
        return self.record


def state():
    return KernelCapState(kernel_id="k", devices=[DeviceCap(0, 3, "GPU-a", 10, 40, 100)])


def test_a_changed_cap_is_taken_and_put_in_force(monkeypatch):
    applied = []
    monkeypatch.setattr(sync, "put_caps_in_force", lambda s, env=None: applied.append([d.cap for d in s.devices]))
    current = state()
    record = {"source": "user request", "devices": [{"index": 3, "cap": 25, "max_cap": 40}]}
    assert sync.sync_caps(current, Client(record)) is True
    assert current.devices[0].cap == 25 and applied == [[25]]
    assert "user request" in current.cap_source


def test_same_caps_or_no_answer_change_nothing(monkeypatch):
    monkeypatch.setattr(sync, "put_caps_in_force", lambda s, env=None: (_ for _ in ()).throw(AssertionError("applied")))
    current = state()
    assert sync.sync_caps(current, Client({"devices": [{"index": 3, "cap": 10}]})) is False
    assert sync.sync_caps(current, Client(None)) is False
    assert sync.sync_caps(current, Client({"devices": [{"index": 9, "cap": 99}]})) is False  # not our device
    assert current.devices[0].cap == 10


def test_no_thread_for_kernels_without_a_server_or_a_gpu():
    assert sync.after_cell(KernelCapState()) is None  # unmanaged: returns at once
    assert not sync._in_flight.locked()


def test_a_sync_is_due_first_and_then_once_per_interval():
    assert sync.due(100.0, None)
    assert not sync.due(100.0, 99.0)
    assert sync.due(101.0, 99.0) and sync.due(150.0, 99.0)


def test_cells_within_the_interval_start_no_sync_and_the_first_cuda_use_makes_the_one_skipped(monkeypatch):
    import threading

    made: list = []
    done = threading.Event()

    def fake_sync(record):
        made.append(threading.current_thread().name)
        done.set()

    monkeypatch.setattr(sync, "_sync", fake_sync)
    monkeypatch.setattr(sync, "_last_start", None)
    monkeypatch.setattr(sync, "_skipped", False)
    current = state()
    sync.after_cell(current)  # the first cell: a sync in a thread of its own
    assert done.wait(10) and made == ["gpu-quota-cap-sync"]
    with sync._in_flight:  # that thread has let go
        pass
    sync.after_cell(current)  # the next cell, at once: skipped
    sync.after_cell(current)
    assert made == ["gpu-quota-cap-sync"] and sync._skipped
    (at_cuda_start,) = current.before_cuda  # what torch_cap's hook calls at the first CUDA use
    at_cuda_start()  # the skipped sync, made here, before the caps are put in force
    assert made == ["gpu-quota-cap-sync", threading.current_thread().name]
    at_cuda_start()  # nothing skipped since
    assert len(made) == 2
