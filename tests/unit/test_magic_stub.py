"""The stand-in `%gpucap` registered at kernel start loads the full magic only when it is needed."""

import sys
import types

import pytest
from IPython.core.events import EventManager, available_events

from gpu_quota_ext.kernel import stub
from gpu_quota_ext.shared.sizes import GiB

from .fake_torch import fake_torch


class Shell:
    def __init__(self):
        self.events = EventManager(self, available_events)
        self.magics = {}

    def register_magic_function(self, func, kind, name):
        self.magics[name] = func


def cell(error=None):
    return types.SimpleNamespace(error_in_exec=error)


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
    said = (
        "gpu-quota: problem: the gpu-quota-ext bootstrap failed: RuntimeError('boom'); no GPU cap applied in this "
        "kernel\n"
    )
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


def test_gpucap_never_expands_its_argument(unmanaged):
    # IPython expands $names and {expressions} in a line magic's argument unless the magic carries its
    # no_var_expand mark; a 100,000-character argument took 80 s there. The stand-in and the full magic carry it.
    from IPython.core.magic import MAGIC_NO_VAR_EXPAND_ATTR

    shell = Shell()
    registered = stub.register(shell)
    assert getattr(registered.magic, MAGIC_NO_VAR_EXPAND_ATTR, False) is True
    controller = registered.controller()
    assert shell.magics["gpucap"] == controller.magic
    assert getattr(controller.magic, MAGIC_NO_VAR_EXPAND_ATTR, False) is True


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


# --- what makes the stand-in load the full magic: the real controller, no stand-in for it --------


def test_a_plain_cell_loads_nothing(unmanaged, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    shell = Shell()
    registered = stub.register(shell)
    shell.events.trigger("post_run_cell", cell())
    assert unmanaged._loaded == [] and registered.post_run_cell in shell.events.callbacks["post_run_cell"]


def test_a_failed_cell_loads_the_magic_and_hands_it_that_cell(unmanaged, monkeypatch, capsys):
    # The cell's error is a torch OOM: only the full magic, handed this very cell, can explain it.
    torch = fake_torch(80 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    shell = Shell()
    registered = stub.register(shell)
    shell.events.trigger(
        "post_run_cell", cell(error=torch.OutOfMemoryError("CUDA out of memory. GPU 0 has a total capacity of 80 GiB"))
    )
    assert len(unmanaged._loaded) == 1
    hooks = shell.events.callbacks["post_run_cell"]
    assert registered.post_run_cell not in hooks and unmanaged._loaded[0].post_run_cell in hooks
    assert "cuda:0 itself is full" in capsys.readouterr().err


def test_any_failed_cell_loads_the_magic(unmanaged, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    shell = Shell()
    stub.register(shell)
    shell.events.trigger("post_run_cell", cell(error=ValueError("not a GPU matter")))
    assert len(unmanaged._loaded) == 1


def test_cuda_started_loads_the_magic_and_not_before(unmanaged, monkeypatch):
    torch = fake_torch(80 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    shell = Shell()
    stub.register(shell)
    shell.events.trigger("post_run_cell", cell())  # torch imported, CUDA not started: usage has nothing to say
    assert unmanaged._loaded == []
    torch.cuda.init()
    shell.events.trigger("post_run_cell", cell())
    assert len(unmanaged._loaded) == 1


@pytest.mark.parametrize(
    "torch",
    [
        types.SimpleNamespace(),  # a module named torch without cuda (a stub, a half import)
        types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: 1 / 0)),  # asking fails
    ],
    ids=["no-cuda", "is_initialized-raises"],
)
def test_a_torch_that_cannot_say_is_read_as_cuda_not_started(unmanaged, monkeypatch, torch):
    monkeypatch.setitem(sys.modules, "torch", torch)
    shell = Shell()
    stub.register(shell)
    shell.events.trigger("post_run_cell", cell())
    assert unmanaged._loaded == []


def test_the_stand_ins_magic_loads_and_runs_the_full_one(unmanaged, capsys):
    shell = Shell()
    stub.register(shell)
    shell.magics["gpucap"]("--help")
    assert len(unmanaged._loaded) == 1 and shell.magics["gpucap"] == unmanaged._loaded[0].magic
    assert "%gpucap reset" in capsys.readouterr().out
