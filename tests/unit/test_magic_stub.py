"""The stand-in `%gpucap` registered at kernel start loads the full magic only when it is needed."""

import sys
import types

import pytest
from IPython.core.events import EventManager, available_events

from gpu_quota_ext.kernel import stub


class Shell:
    def __init__(self):
        self.events = EventManager(self, available_events)
        self.magics = {}

    def register_magic_function(self, func, kind, name):
        self.magics[name] = func


class Controller:
    def __init__(self):
        self.cells, self.lines = [], []

    def post_run_cell(self, result):
        self.cells.append(result)

    def magic(self, line):
        self.lines.append(line)


@pytest.fixture
def stand_in(monkeypatch):
    shell = Shell()
    loaded = []

    def load():
        controller = Controller()
        loaded.append(controller)
        return controller

    registered = stub.register(shell)
    monkeypatch.setattr(registered, "controller", lambda: (registered.unregister(), load())[1])
    return shell, registered, loaded


def cell(error=None):
    return types.SimpleNamespace(error_in_exec=error)


def test_a_plain_cell_loads_nothing(stand_in, monkeypatch):
    shell, _, loaded = stand_in
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    shell.events.trigger("post_run_cell", cell())
    assert loaded == []


def test_a_failed_cell_loads_the_magic_and_hands_it_that_cell(stand_in):
    shell, registered, loaded = stand_in
    failed = cell(error=RuntimeError("CUDA out of memory"))
    shell.events.trigger("post_run_cell", failed)
    assert len(loaded) == 1 and loaded[0].cells == [failed]
    assert registered.post_run_cell not in shell.events.callbacks["post_run_cell"]


def test_cuda_started_loads_the_magic(stand_in, monkeypatch):
    shell, _, loaded = stand_in
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    shell.events.trigger("post_run_cell", cell())
    assert len(loaded) == 1


def test_the_magic_runs_the_full_one(stand_in):
    shell, _, loaded = stand_in
    shell.magics["gpucap"]("0.3")
    assert loaded[0].lines == ["0.3"]


def test_a_failing_bootstrap_prints_nothing_at_start_and_tells_after_the_first_cell(monkeypatch, capfd):
    # The kernel's stderr at start is the server's terminal: nothing goes there. The notebook hears of
    # it after the first cell, once, and from `%gpucap`.
    import IPython

    from gpu_quota_ext.kernel import bootstrap
    from gpu_quota_ext.launch_env import STARTUP_FILE

    shell = Shell()
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    monkeypatch.setattr(bootstrap, "run", lambda namespace: (_ for _ in ()).throw(RuntimeError("boom")))
    monkeypatch.setenv("PYTHONSTARTUP", str(STARTUP_FILE))  # restored after the test (the startup unsets it)
    exec(compile(STARTUP_FILE.read_text(), str(STARTUP_FILE), "exec"), {"__name__": "__main__"})
    assert capfd.readouterr() == ("", "")
    said = "gpu-quota: problem: the gpu-quota-ext bootstrap failed: RuntimeError('boom'); no GPU cap applied in this kernel\n"
    shell.events.trigger("post_run_cell", cell())
    assert capfd.readouterr().err == said
    shell.events.trigger("post_run_cell", cell())
    assert capfd.readouterr().err == ""  # once
    shell.magics["gpucap"]("")
    assert capfd.readouterr().err == said


# --- the stand-in's real controller: the full magic, loaded in its place -------------------------


@pytest.fixture
def unmanaged(monkeypatch):
    """A kernel no server started, and no full magic loaded yet; whatever the test loads is unloaded."""
    from gpu_quota_ext.kernel import magic, state
    from gpu_quota_ext.shared.env_vars import KERNEL_ID

    monkeypatch.delenv(KERNEL_ID, raising=False)
    monkeypatch.setattr(state, "STATE", state.KernelCapState())
    monkeypatch.setattr(magic, "_loaded", [])
    yield magic
    magic.unload(None)


def test_the_controller_is_the_full_magic_registered_in_the_stand_ins_place(unmanaged, capsys):
    shell = Shell()
    registered = stub.register(shell)
    controller = registered.controller()
    assert isinstance(controller, unmanaged.GpuCap) and unmanaged._loaded == [controller]
    assert shell.magics["gpucap"] == controller.magic
    hooks = shell.events.callbacks["post_run_cell"]
    assert registered.post_run_cell not in hooks and controller.post_run_cell in hooks
    assert controller.pre_run_cell in shell.events.callbacks["pre_run_cell"]
    assert unmanaged.NO_SERVER in capsys.readouterr().out


def test_no_second_controller_when_load_ext_already_loaded_the_magic(unmanaged, capsys):
    shell = Shell()
    first = unmanaged.load(shell)  # `%load_ext gpu_quota_ext`
    registered = stub.register(shell)
    assert registered.controller() is None
    assert unmanaged._loaded == [first]
    assert registered.post_run_cell not in shell.events.callbacks["post_run_cell"]


def test_the_stand_ins_magic_runs_the_loaded_one_through_the_shell_when_already_loaded(unmanaged):
    shell = Shell()
    unmanaged.load(shell)
    lines = []
    shell.run_line_magic = lambda name, line: lines.append((name, line))
    stub.register(shell).magic("0.3")
    assert lines == [("gpucap", "0.3")]


def test_a_plain_cell_starts_the_background_sync_and_tells_the_start_once(unmanaged, monkeypatch, capfd):
    from gpu_quota_ext.kernel import state, sync

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    synced = []
    monkeypatch.setattr(sync, "after_cell", lambda record: synced.append(record))
    state.STATE.problems.append("something at start")
    shell = Shell()
    stub.register(shell)
    shell.events.trigger("post_run_cell", cell())
    shell.events.trigger("post_run_cell", cell())
    assert synced == [state.STATE, state.STATE]
    assert capfd.readouterr().err == "gpu-quota: problem: something at start\n"
    assert unmanaged._loaded == []  # the full magic is still not loaded
