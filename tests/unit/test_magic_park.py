"""`%gpucap park` / `%gpucap resume`, the park line of `%gpucap` and of the usage panel, without a kernel:
a fake client plays the server's answers (shared.contract: 202 {"park": PARK_FIELDS}, refusals, 404)."""

from __future__ import annotations

import time

import pytest

from gpu_quota_ext.kernel.client import ParkAnswer
from gpu_quota_ext.kernel.command import Command, CommandError, help_text, parse_command
from gpu_quota_ext.kernel.magic import GpuCap, format_table
from gpu_quota_ext.kernel.panel import panel_view
from gpu_quota_ext.kernel.park import (
    PARK_ANNOUNCEMENT,
    duration_words,
    refusal_text,
    state_words,
    table_line,
)
from gpu_quota_ext.kernel.state import DeviceCap, KernelCapState
from gpu_quota_ext.shared.contract import PARK_FIELDS, PARK_STATES
from gpu_quota_ext.shared.sizes import GiB

from .fakes import OfflineClient


def park(state="busy", **fields) -> dict:
    """A park object with exactly the contract's fields."""
    value = {"state": state, "since": None, "idle_seconds": None, "host_bytes": None, "parkable": True, "reason": None}
    value.update(waited=None, wait_limit=300.0, told=False, room=None, lost=None, path=None)
    value.update(fields)
    assert set(value) == set(PARK_FIELDS)
    return value


class FakeParkClient(OfflineClient):
    """Answers park/resume like the server would; records what was asked."""

    def __init__(self, answer: ParkAnswer, current=None):
        super().__init__()
        self.answer, self.current, self.calls = answer, current, []

    def park(self):
        self.calls.append("park")
        return self.answer

    def resume(self):
        self.calls.append("resume")
        return self.answer

    def park_state(self):
        self.calls.append("state")
        return self.current


def kernel_state() -> KernelCapState:
    return KernelCapState(kernel_id="k1", devices=[DeviceCap(0, 0, "GPU-a", 20 * GiB, 40 * GiB, 80 * GiB)])


def run(line, client, capsys, state=None):
    GpuCap(object(), state or kernel_state(), client, env={}).magic(line)
    return capsys.readouterr()


# --- the grammar ---------------------------------------------------------------------------------


@pytest.mark.parametrize("word", ["park", "resume"])
def test_park_and_resume_are_commands_without_a_device(word):
    assert parse_command(word, [0]) == Command(word)
    with pytest.raises(CommandError, match=f"--device cannot be used with '{word}'"):
        parse_command(f"--device 0 {word}", [0])


def test_help_names_park_and_resume():
    text = help_text()
    assert "%gpucap park" in text and "%gpucap resume" in text
    assert "next cell" in text


# --- %gpucap park ----------------------------------------------------------------------------------


def test_park_asks_the_server_and_says_so_in_one_line(capsys):
    client = FakeParkClient(ParkAnswer("accepted", park=park("pending"), status=202))
    out = run("park", client, capsys)
    assert client.calls == ["park"]
    assert out.out == f"gpu-quota: {PARK_ANNOUNCEMENT}\n"
    assert out.err == ""
    assert "when this cell ends" in PARK_ANNOUNCEMENT and "next cell brings it back" in PARK_ANNOUNCEMENT


@pytest.mark.parametrize(
    "reason",
    [
        "not parkable: no driver with the checkpoint API (libcuda 535 has no cuCheckpointProcessLock)",
        "not parkable: this kernel is an MPS client (the driver answers 801, not supported)",
        "not parkable: its process belongs to another user (bob)",
        "not parkable: this kernel holds no GPU",
    ],
)
def test_not_parkable_is_the_servers_reason_once(capsys, reason):
    # Whether the server refuses with a status (409 + message) or answers with parkable false, the user
    # reads its reason as written, once: no "cannot park: not parkable: ...".
    for answer in (
        ParkAnswer("refused", reason, status=409),
        ParkAnswer("accepted", park=park("busy", parkable=False, reason=reason), status=202),
    ):
        out = run("park", FakeParkClient(answer), capsys)
        assert out.out == ""
        assert out.err == f"gpu-quota: error: {reason}\n"


def test_a_reason_without_a_refusal_word_gets_one(capsys):
    answer = ParkAnswer("accepted", park=park("busy", parkable=False, reason="MPS client"), status=202)
    assert run("park", FakeParkClient(answer), capsys).err == "gpu-quota: error: cannot park: MPS client\n"
    assert refusal_text("Not parkable:  MPS  client") == "Not parkable: MPS client"
    assert refusal_text("", "resume") == "cannot resume"


def test_accepted_but_not_parking_says_why(capsys):
    answer = ParkAnswer(
        "accepted", park=park("idle", idle_seconds=5, reason="did not park: the host has 3.0 GiB free"), status=202
    )
    out = run("park", FakeParkClient(answer), capsys)
    assert out.out == "" and out.err == "gpu-quota: error: did not park: the host has 3.0 GiB free\n"


def test_a_server_without_the_route_or_unreachable_is_one_line(capsys):
    for message in (
        "this server cannot park kernels: it has no park route (HTTP 403; its gpu-quota-ext predates parking)",
        "cannot reach the GPU quota server at http://127.0.0.1:1/: refused",
    ):
        out = run("park", FakeParkClient(ParkAnswer("error", message)), capsys)
        assert out.out == ""
        assert out.err == f"gpu-quota: error: {message}\n"


def test_no_server_no_request(capsys):
    client = FakeParkClient(ParkAnswer("accepted", park=park("pending")))
    out = run("park", client, capsys, state=KernelCapState())
    assert client.calls == []
    assert out.err.startswith("gpu-quota: error: cannot park: no server started this kernel")


# --- %gpucap resume ---------------------------------------------------------------------------------


def test_resume_says_it_is_rarely_needed(capsys):
    client = FakeParkClient(ParkAnswer("accepted", park=park("resuming"), status=202))
    out = run("resume", client, capsys)
    assert client.calls == ["resume"]
    assert out.out == "gpu-quota: resuming; rarely needed: your next cell resumes a parked kernel by itself\n"
    out = run("resume", FakeParkClient(ParkAnswer("accepted", park=park("busy"), status=202)), capsys)
    assert out.out.startswith("gpu-quota: this kernel is not parked (running); rarely needed")


def test_resume_refused_once(capsys):
    out = run("resume", FakeParkClient(ParkAnswer("refused", "kernel k1 is shutting down", status=409)), capsys)
    assert out.err == "gpu-quota: error: cannot resume: kernel k1 is shutting down\n"


# --- the park state in words ------------------------------------------------------------------------


def test_every_contract_state_has_its_own_words():
    words = [state_words(park(state)) for state in PARK_STATES]
    assert len(set(words)) == len(PARK_STATES) and "unknown" not in words and "" not in words, words


def test_state_words():
    since = time.mktime((2026, 11, 29, 14, 2, 0, 0, 0, -1))
    assert state_words(park("busy")) == "running"
    assert state_words(park("idle", idle_seconds=12 * 60 + 5)) == "idle for 12 min"
    assert (
        state_words(park("parked", since=since, host_bytes=int(17.8 * GiB))) == "parked since 14:02, 17.8 GiB on host"
    )
    fast = {"path": "pages", "reason": "torch", "stays_on_device": 612 * 2**20}
    assert state_words(park("parked", since=since, host_bytes=20 * GiB, path=fast)) == (
        "parked since 14:02, 20.0 GiB on host (fast park: 612.0 MiB stays on the GPU)"
    )
    slow = {"path": "checkpoint", "reason": "no torch", "stays_on_device": 0}
    assert state_words(park("parked", since=since, host_bytes=20 * GiB, path=slow)) == (
        "parked since 14:02, 20.0 GiB on host"
    )
    assert state_words(park("resuming")) == "resuming"
    assert state_words(park("waiting", reason="GPU 0 has 2.0 GiB free, 17.8 GiB needed")) == (
        "waiting for device memory (limit 5 min): GPU 0 has 2.0 GiB free, 17.8 GiB needed"
    )
    assert state_words(park("waiting", reason="making room", waited=12, wait_limit=None)) == (
        "waiting for device memory for 12 s: making room"
    )
    assert state_words(park("waiting", reason="making room", told=True)) == (
        "waited past its limit (5 min): the cell did not run; the kernel stays parked with its grant"
    )
    assert [duration_words(s) for s in (40, 720, 7500, 7200, None)] == ["40 s", "12 min", "2 h 5 min", "2 h", ""]
    # A wait and its limit are said exactly: 100 s of a 100 s limit never reads "1 min of at most 1 min".
    exact = [duration_words(s, exact=True) for s in (60, 61, 100, 3599, 7500)]
    assert exact == ["1 min", "1 min 1 s", "1 min 40 s", "59 min 59 s", "2 h 5 min"]
    assert state_words({"state": "waiting", "waited": 100, "wait_limit": 100}).startswith(
        "waiting for device memory for 1 min 40 s (limit 1 min 40 s)"
    )


def test_table_line_says_parkable_or_why_not():
    assert table_line(None) is None
    assert table_line(park("busy")).startswith("parking: possible: %gpucap park")
    assert table_line(park("busy", parkable=False, reason="MPS client")) == "parking: not parkable: MPS client"
    # The server's reason may say "not parkable" itself: said once.
    assert (
        table_line(park("busy", parkable=False, reason="not parkable: MPS client"))
        == "parking: not parkable: MPS client"
    )
    assert table_line(park("pending")) == "parking: parks when its current cell ends"


def test_plain_gpucap_shows_the_park_line_when_the_server_sends_one(capsys, monkeypatch):
    monkeypatch.setattr("gpu_quota_ext.kernel.magic.read_usage", lambda ordinals=None: {})
    client = FakeParkClient(None, current=park("busy", parkable=False, reason="MPS client"))
    out = run("", client, capsys)
    assert client.calls == ["state"]
    assert out.out.strip().splitlines()[-1] == "parking: not parkable: MPS client"
    # A server that sends no park state (older, or unreachable): no park line at all.
    out = run("", FakeParkClient(None, current=None), capsys)
    assert "parking" not in out.out
    assert "parking" not in format_table(kernel_state(), {}, None, None)


def test_panel_shows_the_park_state():
    view = panel_view(kernel_state(), {}, None, park("idle", idle_seconds=180))
    assert view.park == "park: idle for 3 min"
    assert (
        panel_view(kernel_state(), {}, None, park("busy", parkable=False, reason="no GPU")).park
        == "park: not parkable: no GPU"
    )
    said_twice = park("busy", parkable=False, reason="not parkable: no GPU")
    assert panel_view(kernel_state(), {}, None, said_twice).park == "park: not parkable: no GPU"
    assert panel_view(kernel_state(), {}, None, None).park == ""


# --- the client reads the server's answers -------------------------------------------------------------


@pytest.mark.parametrize(
    "status, reply, outcome, says",
    [
        (202, {"park": {"state": "pending"}}, "accepted", ""),
        (409, {"message": "not parkable: MPS client"}, "refused", "not parkable: MPS client"),
        (
            403,
            {"message": "this secret does not belong to kernel k1"},
            "error",
            "refused this kernel's credentials (403)",
        ),
        (403, None, "error", "it has no park route (HTTP 403"),  # jupyter_server's HTML page: no such route
        (404, None, "error", "it has no park route (HTTP 404"),
        (404, {"message": "no GPU grant for kernel k1"}, "error", "no GPU grant for kernel k1"),
        (500, None, "error", "the server answered HTTP 500"),
    ],
)
def test_client_reads_park_answers(status, reply, outcome, says):
    from gpu_quota_ext.kernel.client import QuotaClient

    client = QuotaClient("http://127.0.0.1:1/", "k1", "s3cr3t-value")
    sent = []
    client._send = lambda method, url, body, timeout: sent.append((method, url)) or (status, reply)
    answer = client.park()
    assert sent == [("POST", "http://127.0.0.1:1/api/gpu-quota/kernels/k1/park")]
    assert answer.outcome == outcome and says in answer.message and "s3cr3t-value" not in answer.message
    client.resume()
    assert sent[-1] == ("POST", "http://127.0.0.1:1/api/gpu-quota/kernels/k1/resume")
