"""A kernel lost while parked, in words (parking/lost.py) and as the restarted kernel says it (kernel/lost_notice.py):
once, on stderr, at the start of its next cell, in a real IPython shell; and the project's notices to the user go to
the cell's stderr, never to the stdout the user's own output is on (issue 31)."""

import json
import os
import signal

import pytest
from IPython.core.interactiveshell import InteractiveShell

from gpu_quota_ext.kernel import lost_notice
from gpu_quota_ext.kernel.park_wait import ParkWatch
from gpu_quota_ext.parking.lost import (
    death_cause,
    notice_env,
    notice_json,
    notice_request,
    shown,
)
from gpu_quota_ext.parking.lost import (
    lost_notice as make_notice,
)
from gpu_quota_ext.shared.env_vars import LOST

# --- the words (server side) --------------------------------------------------------------------------------


def test_the_notice_says_when_why_what_is_gone_and_what_to_do():
    notice = make_notice("parked", 1_000.0, -signal.SIGKILL, clock="01:23")
    assert notice.why == (
        "its process ended while parked (killed by SIGKILL: the host's out-of-memory killer, or a kill -9?)"
    )
    assert notice.words == (
        "gpu-quota: this kernel was restarted at 01:23 because its process ended while parked (killed by SIGKILL: "
        "the host's out-of-memory killer, or a kill -9?); its variables and GPU memory are gone. Run the notebook's "
        "cells again."
    )
    assert notice_json(notice) == {"at": 1_000.0, "why": notice.why, "words": notice.words}
    assert notice_json(None) is None


@pytest.mark.parametrize(
    "exit_code, words",
    [
        (-signal.SIGKILL, "killed by SIGKILL: the host's out-of-memory killer, or a kill -9?"),
        (137, "killed by SIGKILL: the host's out-of-memory killer, or a kill -9?"),
        (-signal.SIGSEGV, "killed by SIGSEGV"),
        (1, "it exited with status 1"),
        (None, "the cause is not known: the host's out-of-memory killer?"),
    ],
)
def test_how_the_process_ended(exit_code, words):
    assert death_cause(exit_code) == words


@pytest.mark.parametrize(
    "state, words",
    [
        ("parking", "while it was being parked"),
        ("waiting", "while parked (waiting for room to come back to)"),
        ("resuming", "while its GPU memory was coming back from host memory"),
    ],
)
def test_what_it_was_doing_when_it_ended(state, words):
    assert f"its process ended {words} (" in make_notice(state, 0.0, -9, clock="00:00").why


def test_the_environment_and_the_request_carry_the_time_and_the_words_and_the_answer_is_read_strictly():
    notice = make_notice("parked", 5.0, -9, clock="00:00")
    assert json.loads(notice_env(notice)) == {"at": 5.0, "words": notice.words}
    assert notice_request(notice) == {"action": "lost", "at": 5.0, "words": notice.words}
    assert shown({"shown": True}) and not shown({"shown": False}) and not shown(None) and not shown({"shown": 1})


# --- the restarted kernel -----------------------------------------------------------------------------------


@pytest.fixture
def kernel_side(monkeypatch):
    monkeypatch.setattr(lost_notice, "PENDING", None)
    monkeypatch.setattr(lost_notice, "SHOWN_AT", None)
    return lost_notice


@pytest.fixture
def shell():
    shell = InteractiveShell.instance()
    hooks = list(shell.events.callbacks["pre_run_cell"])
    yield shell
    shell.events.callbacks["pre_run_cell"][:] = hooks


WORDS = "gpu-quota: this kernel was restarted at 01:23 because its process ended while parked (...)"


def test_the_next_cell_says_it_once_on_stderr_and_its_stdout_is_the_users(kernel_side, shell, capfd, monkeypatch):
    monkeypatch.setenv(LOST, json.dumps({"at": 7.0, "words": WORDS}))
    kernel_side.install(shell)
    assert LOST not in os.environ  # child processes and `!env` never see it
    shell.run_cell("print('mine')")
    said = capfd.readouterr()
    assert said.out == "mine\n" and said.err == WORDS + "\n"
    shell.run_cell("print('again')")
    said = capfd.readouterr()
    assert said.out == "again\n" and said.err == ""
    assert kernel_side.on_request({"action": "lost", "at": 7.0, "words": WORDS}) == {"shown": True}
    shell.run_cell("1")
    assert capfd.readouterr().err == ""  # the server's request after it was said does not bring it back


def test_words_that_come_on_the_control_channel_are_said_at_the_next_cell(kernel_side, capsys):
    assert kernel_side.on_request({"action": "lost", "at": 3.0, "words": WORDS}) == {"shown": False}
    assert kernel_side.on_request({"action": "lost", "at": 3.0, "words": WORDS}) == {"shown": False}  # kept once
    assert kernel_side.say_once() == WORDS and capsys.readouterr().err == WORDS + "\n"
    assert kernel_side.say_once() is None
    assert kernel_side.on_request({"action": "lost", "at": 3.0, "words": WORDS}) == {"shown": True}
    assert kernel_side.on_request({"action": "lost", "at": "3", "words": WORDS}) == {
        "error": "lost needs at (a number) and words (text)"
    }


def test_a_park_watch_request_for_lost_reaches_the_notice(kernel_side):
    watch = ParkWatch(lambda: None)
    assert watch.on_request({"action": "lost", "at": 1.0, "words": WORDS}) == {"shown": False}
    assert kernel_side.PENDING == (1.0, WORDS)


def test_a_parked_kernels_wait_speaks_on_stderr_and_leaves_stdout_to_the_user(capsys, monkeypatch):
    replies = [{"state": "parked", "host_bytes": 1 << 30}, {"state": "resuming"}, {"state": "idle"}]
    clock = iter([0.0, 0.5, 2.0, 2.5, 3.0, 3.5, 4.0])
    monkeypatch.setattr("gpu_quota_ext.kernel.park_wait.time.monotonic", lambda: next(clock))
    monkeypatch.setattr("gpu_quota_ext.kernel.park_wait.time.sleep", lambda seconds: None)
    watch = ParkWatch(lambda: replies.pop(0))
    watch.maybe_parked.set()
    watch.before_cell()
    said = capsys.readouterr()
    assert said.out == ""
    assert said.err.splitlines()[-1].startswith("gpu-quota: back on the GPU after "), said.err
