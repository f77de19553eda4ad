"""The kernel side of a parked kernel's next cell (kernel/park_wait.py) in a real IPython shell: its AST transformer
waits while the server says the kernel is parked, ends the cell cleanly when told or interrupted, and never lets a
failure of its own question unregister it (IPython drops a transformer that raises anything but InputRejected, and
from then on every later cell of a parked kernel would wait in the driver, silent and uninterruptible)."""

import http.client

import pytest
from IPython.core.interactiveshell import InteractiveShell

from gpu_quota_ext.kernel.park_wait import ParkWatch, WaitWhileParked


@pytest.fixture
def shell():
    shell = InteractiveShell.instance()
    before = list(shell.ast_transformers)
    yield shell
    shell.ast_transformers[:] = before


def answers(*replies):
    """park_state: each reply in turn (an exception is raised), then running."""
    queue = list(replies)

    def park_state():
        reply = queue.pop(0) if queue else {"state": "idle"}
        if isinstance(reply, BaseException):
            raise reply
        return reply

    return park_state


def watching(shell, park_state, lines):
    watch = ParkWatch(park_state, lines.append)
    watch.maybe_parked.set()
    transformer = WaitWhileParked(watch)
    shell.ast_transformers.append(transformer)
    return watch, transformer


def test_a_question_that_fails_lets_the_cell_run_and_the_wait_stays_installed(shell):
    lines = []
    watch, transformer = watching(shell, answers(http.client.IncompleteRead(b"")), lines)
    result = shell.run_cell("ran = 1")
    assert result.error_before_exec is None and shell.user_ns["ran"] == 1
    assert transformer in shell.ast_transformers  # the next park's cell still waits in Python
    watch.maybe_parked.set()
    watch.park_state = answers({"state": "waiting", "told": True, "reason": "waited 300 s (the park_wait_limit)"})
    result = shell.run_cell("ran = 2")
    assert result.error_before_exec is not None and shell.user_ns["ran"] == 1


def test_an_interrupt_while_asking_the_server_ends_the_cell_cleanly(shell):
    lines = []
    watching(shell, answers({"state": "parked"}, KeyboardInterrupt()), lines)
    result = shell.run_cell("ran = 3")
    assert result.error_before_exec is not None and "interrupted while waiting for the GPU" in str(
        result.error_before_exec
    )
    assert shell.user_ns.get("ran") != 3


def test_a_told_left_from_the_last_wait_does_not_end_the_next_cell(shell):
    # The last wait passed the limit: "told" stays said on the parked kernel until its next wait begins, which the
    # server sees from the kernel's iopub busy. The cell's first question can reach the server before that busy:
    # the cell must wait for room, not end at once with the last wait's words.
    lines = []
    stale = {"state": "parked", "told": True, "reason": "waited 300 s (the park_wait_limit) for device memory"}
    watching(shell, answers(stale, {"state": "waiting", "told": False, "reason": "making room"}), lines)
    result = shell.run_cell("ran = 4")
    assert result.error_before_exec is None and shell.user_ns["ran"] == 4


def test_a_wait_the_server_says_is_past_its_limit_ends_even_when_nobody_tells_it(shell):
    # The broker tells a wait at the limit in a round, and rounds follow the GPU samples: a monitor whose NVML call
    # hangs takes none, and nothing would end the cell. The kernel ends it itself a little after the limit, by the
    # server's own count of the wait.
    lines = []
    past = {"state": "waiting", "told": False, "waited": 312.0, "wait_limit": 300, "reason": "needs 20.0 GiB on GPU 0"}
    watching(shell, answers(past), lines)
    result = shell.run_cell("ran = 5")
    message = str(result.error_before_exec)
    assert "waited 300 s (the park_wait_limit) for device memory: needs 20.0 GiB on GPU 0" in message
    assert shell.user_ns.get("ran") != 5
