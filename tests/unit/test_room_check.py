"""Room before the cell needs it, the kernel's side (kernel/room_check.py, park_wait.room_before_cell) in a real
IPython shell: with the server's flag off a cell asks nothing; with it on, a kernel that uses the device asks for
room before the cell's code runs, says why once the wait lasts, runs the cell when room is made and also when
none is (with one line), and a stop ends the cell before any of its code runs."""

from types import SimpleNamespace

import pytest
from IPython.core.interactiveshell import InteractiveShell

from gpu_quota_ext.kernel import room_check
from gpu_quota_ext.kernel.park_wait import ParkWatch, WaitWhileParked
from gpu_quota_ext.kernel.room_check import room_before_cell


class Clock:
    """The wait's clock, moved on by each of its sleeps."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


@pytest.fixture
def flag():
    room_check.clear()
    room_check.STOPPED = None
    yield room_check
    room_check.clear()
    room_check.STOPPED = None


class Server:
    """ask_room and park_state of a server making room: `states` answered in turn, the last one repeated."""

    def __init__(self, *states, outcome="accepted"):
        self.states = list(states)
        self.outcome = outcome
        self.asked = []

    def ask_room(self, device):
        self.asked.append(device)
        return SimpleNamespace(outcome=self.outcome)

    def park_state(self):
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if isinstance(state, BaseException):
            raise state
        return state


ASKING = {
    "state": "busy",
    "room": "asking",
    "reason": "needs 5.0 GiB on GPU 0; making room: idle kernel kernel a parks now",
    "wait_limit": 300,
}
MADE = {"state": "busy", "room": "made", "reason": "room made: the device has its cap free now", "wait_limit": 300}


@pytest.fixture
def shell(flag):
    shell = InteractiveShell.instance()
    before = list(shell.ast_transformers)
    yield shell
    shell.ast_transformers[:] = before
    for callback in list(shell.events.callbacks["pre_run_cell"]):
        if isinstance(getattr(callback, "__self__", None), room_check.RoomCheck):
            shell.events.unregister("pre_run_cell", callback)


def installed(shell, server, lines, parked=False, clock=None):
    watch = ParkWatch(server.park_state, lines.append)
    shell.ast_transformers.append(WaitWhileParked(watch))
    check = room_check.RoomCheck(server.ask_room, server.park_state, lines.append, lambda: parked)
    clock = clock or Clock()
    check.sleep, check.clock = clock.sleep, clock.monotonic
    room_check.install(shell, check)
    return watch


def test_with_the_flag_off_a_cell_asks_nothing(shell):
    server, lines = Server(MADE), []
    installed(shell, server, lines)
    shell.run_cell("ran = 1")
    assert shell.user_ns["ran"] == 1 and server.asked == [] and lines == []


def test_the_server_sets_and_clears_the_flag_on_the_control_channel(flag):
    watch = ParkWatch(lambda: None)
    assert watch.on_request({"action": "room_flag", "short": True, "device": 1, "holding": True}) == {"short": True}
    assert (flag.SHORT, flag.DEVICE, flag.HOLDING) == (True, 1, True)
    assert watch.on_request({"action": "room_flag", "short": False, "device": None}) == {"short": False}
    assert (flag.SHORT, flag.DEVICE, flag.HOLDING) == (False, None, False)
    for bad in (
        {"action": "room_flag"},
        {"action": "room_flag", "short": 1},
        {"action": "room_flag", "short": True, "device": "0"},
        {"action": "room_flag", "short": True, "device": True},
    ):
        assert "error" in watch.on_request(bad)
        assert flag.SHORT is False


def test_a_park_clears_the_flag(flag):
    flag.on_flag({"short": True, "device": 0, "holding": True})
    ParkWatch(lambda: None).on_request({"action": "trim"})
    assert flag.SHORT is False


def test_a_short_kernel_waits_for_room_says_why_and_then_runs_the_cell(shell):
    server, lines = Server(*[ASKING] * 7, MADE), []
    installed(shell, server, lines)
    room_check.on_flag({"short": True, "device": 0, "holding": True})
    shell.run_cell("ran = 2")
    assert shell.user_ns["ran"] == 2 and server.asked == [0]
    assert lines[0].startswith("gpu-quota: waiting for room before the cell runs (at most 5 min): idle kernels hold")
    assert lines[0].endswith("making room: idle kernel kernel a parks now"), lines
    assert lines[-1].startswith("gpu-quota: room made after 2.") and lines[-1].endswith("; the cell runs now")
    assert len(lines) == 2
    assert room_check.SHORT is False  # asked once: the server says it again when it is so again
    shell.run_cell("ran = 3")
    assert server.asked == [0]


def test_a_short_wait_says_nothing(shell):
    server, lines = Server(ASKING, MADE), []
    installed(shell, server, lines)
    room_check.on_flag({"short": True, "device": 0, "holding": True})
    shell.run_cell("ran = 4")
    assert shell.user_ns["ran"] == 4 and server.asked == [0] and lines == []


def test_no_room_made_the_cell_runs_anyway_with_one_line(shell):
    told = {"state": "busy", "room": "told", "reason": "waited 300 s (the park_wait_limit) for device memory: ..."}
    server, lines = Server(ASKING, told), []
    installed(shell, server, lines)
    room_check.on_flag({"short": True, "device": 0, "holding": True})
    shell.run_cell("ran = 5")
    assert shell.user_ns["ran"] == 5
    assert lines == [
        "gpu-quota: no room made before the cell: waited 300 s (the park_wait_limit) for device memory: ...; the cell "
        "runs anyway (it may find the GPU full)"
    ]


def test_a_wait_nobody_ends_stops_past_the_limit_and_the_cell_runs(shell):
    server, lines = Server({**ASKING, "wait_limit": 2}), []
    installed(shell, server, lines)
    room_check.on_flag({"short": True, "device": 0, "holding": True})
    shell.run_cell("ran = 6")
    assert shell.user_ns["ran"] == 6
    assert lines[-1].startswith("gpu-quota: room is still being made after 12 s; the cell runs now")


def test_a_stop_while_waiting_ends_the_cell_before_its_code_runs(shell):
    server, lines = Server(ASKING, ASKING, KeyboardInterrupt()), []
    installed(shell, server, lines)
    room_check.on_flag({"short": True, "device": 0, "holding": True})
    result = shell.run_cell("ran = 7")
    assert "ran" not in shell.user_ns or shell.user_ns["ran"] != 7
    assert "interrupted while waiting for room on the GPU; the cell did not run" in str(result.error_before_exec)
    assert room_check.STOPPED is None
    shell.run_cell("ran = 8")  # the next cell runs
    assert shell.user_ns["ran"] == 8


def test_a_server_that_makes_no_room_says_nothing_and_the_cell_runs(shell):
    server, lines = Server(MADE, outcome="refused"), []
    installed(shell, server, lines)
    room_check.on_flag({"short": True, "device": 0, "holding": True})
    shell.run_cell("ran = 9")
    assert shell.user_ns["ran"] == 9 and server.asked == [0] and lines == []


def test_a_gpucap_cell_a_parked_kernel_and_a_kernel_off_the_gpu_do_not_ask(shell, monkeypatch):
    server, lines = Server(MADE), []
    installed(shell, server, lines)
    room_check.on_flag({"short": True, "device": 0, "holding": True})
    shell.run_cell("%gpucap  \n")
    assert server.asked == [] and room_check.SHORT is True
    room_check.on_flag({"short": True, "device": 0, "holding": False})  # it holds nothing on the GPU ...
    monkeypatch.delitem(__import__("sys").modules, "cupy", raising=False)
    monkeypatch.delitem(__import__("sys").modules, "torch", raising=False)
    shell.run_cell("ran = 10")
    assert server.asked == [] and shell.user_ns["ran"] == 10  # ... and has not started CUDA: it asks at first use
    room_check.at_first_cuda()
    assert server.asked == [0]


def test_a_parked_kernel_waits_for_its_resume_not_for_room(shell):
    server, lines = Server(MADE), []
    installed(shell, server, lines, parked=True)
    room_check.on_flag({"short": True, "device": 0, "holding": True})
    room_check.CHECK.pre_run_cell(SimpleNamespace(raw_cell="x = 1"))
    assert server.asked == []


def test_room_before_cell_with_no_answer_returns_at_once():
    assert room_before_cell(lambda: None, lambda: None, print) is None
