"""Allocator readings (never starting CUDA), the per-cell line, the panel's view, and the kernel's HTTP
client against a small local server: the secret goes in its header only, usage reports never block."""

from __future__ import annotations

import json
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpu_quota_ext.kernel.cells import CellReporter, format_cell_report
from gpu_quota_ext.kernel.client import TOKEN_HEADER, QuotaClient
from gpu_quota_ext.kernel.panel import panel_view
from gpu_quota_ext.kernel.state import DeviceCap, KernelCapState
from gpu_quota_ext.kernel.usage import (
    DeviceUsage,
    read_usage,
    report_to_server,
    usage_report,
)
from gpu_quota_ext.shared.sizes import GiB

from .fake_torch import fake_torch

SECRET = "s3cret-token-value"


def state_on(index=3) -> KernelCapState:
    return KernelCapState(kernel_id="k1", devices=[DeviceCap(0, index, "GPU-a", 20 * GiB, 40 * GiB, 80 * GiB)])


# --- readings -----------------------------------------------------------------------------------------


def test_no_readings_without_torch_or_before_cuda_starts(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert read_usage() == {}
    torch = fake_torch(80 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert read_usage() == {}
    assert torch.cuda.context_calls == 0


def test_readings_once_cuda_runs_and_usage_report_uses_server_indexes(monkeypatch):
    torch = fake_torch(80 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    torch.cuda.init()
    torch.cuda.allocated[0], torch.cuda.reserved[0], torch.cuda.peak[0] = 1 * GiB, 2 * GiB, 3 * GiB
    readings = read_usage([0])
    assert readings[0] == DeviceUsage(0, 1 * GiB, 2 * GiB, 3 * GiB, 3 * GiB, 80 * GiB)
    assert usage_report(state_on(index=3), readings) == [
        {"index": 3, "allocated": GiB, "reserved": 2 * GiB, "peak": 3 * GiB}
    ]


# --- per-cell report ------------------------------------------------------------------------------------


def test_cell_line_shows_peak_against_the_cap_and_the_change_in_allocated():
    after = {0: DeviceUsage(0, 3 * GiB, 6 * GiB, 5 * GiB, 5 * GiB)}
    line = format_cell_report({0: 4 * GiB}, after, {0: 20 * GiB})
    assert line == "gpu-quota: cuda:0 peak 5.0 GiB of 20.0 GiB cap (25%), allocated -1.0 GiB (now 3.0 GiB)"


def test_cell_reporter_resets_peaks_only_when_on(monkeypatch, capsys):
    torch = fake_torch(80 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    torch.cuda.init()
    reporter = CellReporter(state_on())
    torch.cuda.peak[0] = 9 * GiB
    reporter.pre_run_cell()
    reporter.post_run_cell()
    assert torch.cuda.peak[0] == 9 * GiB and capsys.readouterr().err == ""
    reporter.enabled = True
    torch.cuda.reserved[0] = GiB
    reporter.pre_run_cell()
    torch.cuda.allocated[0] = GiB
    reporter.post_run_cell()
    said = capsys.readouterr()
    assert said.out == ""  # the cell's stdout is the user's own: the report goes beside it, on stderr
    assert said.err.strip() == "gpu-quota: cuda:0 peak 1.0 GiB of 20.0 GiB cap (5%), allocated +1.0 GiB (now 1.0 GiB)"


# --- the panel's view ------------------------------------------------------------------------------------


def test_panel_view_states():
    state = state_on()
    cpu_torch = panel_view(state, {}, "this kernel's torch 2.13.0+cpu is built without CUDA")
    # The grant is shown, usage marked as not available, and why (the simulated demo's case).
    assert cpu_torch.gpu_visible and len(cpu_torch.rows) == 1
    assert (
        cpu_torch.status
        == "usage not available: this kernel's torch 2.13.0+cpu is built without CUDA; the caps below are this "
            "kernel's grants"
    )
    row = cpu_torch.rows[0]
    assert row.label == "cuda:0 (server GPU 3)" and row.cap == 20 * GiB and row.allocated is None
    assert row.details().startswith(
        "usage not available (this kernel's torch 2.13.0+cpu is built without CUDA) · cap 20.0 GiB"
    )
    cpu_only = panel_view(KernelCapState(kernel_id="k", cpu_only_reason="no GPU has 0.25 of budget left"), {}, None)
    assert cpu_only.status == "this kernel started without a GPU (CPU-only): no GPU has 0.25 of budget left"
    assert not cpu_only.gpu_visible and cpu_only.rows == []
    waiting = panel_view(state, {}, None)
    assert waiting.gpu_visible and waiting.status.startswith("GPU not in use yet") and waiting.rows[0].allocated is None
    assert waiting.rows[0].unavailable is None
    live = panel_view(state, {0: DeviceUsage(0, 5 * GiB, 10 * GiB, 12 * GiB, 6 * GiB, 79 * GiB)}, None)
    row = live.rows[0]
    assert live.status == "live" and row.fill(row.reserved) == 50.0 and row.fill(row.allocated) == 25.0
    assert "reserved 10.0 GiB of 20.0 GiB cap" in row.details() and "peak 12.0 GiB" in row.details()
    plain = panel_view(KernelCapState(), {}, "this kernel's torch 2.13.0+cpu is built without CUDA")
    assert plain.status == "no GPU visible: this kernel's torch 2.13.0+cpu is built without CUDA" and plain.rows == []


def test_no_gpu_on_the_server_says_why(monkeypatch, tmp_path):
    from gpu_quota_ext.kernel import reasons

    no_devices = KernelCapState(kernel_id="k")  # the server started it and granted nothing, for no budget reason
    monkeypatch.setattr(reasons, "NVIDIA_DRIVER_FILE", str(tmp_path / "absent"))
    assert reasons.no_gpu_reason(no_devices).startswith("no GPU on this server: no NVIDIA driver is loaded")
    (tmp_path / "version").write_text("NVRM version: 580\n")
    monkeypatch.setattr(reasons, "NVIDIA_DRIVER_FILE", str(tmp_path / "version"))
    assert reasons.no_gpu_reason(no_devices).startswith("no GPU on this server that it may use")
    assert reasons.no_gpu_reason(state_on()) is None and reasons.no_gpu_reason(KernelCapState()) is None
    assert panel_view(no_devices, {}, None).status == reasons.no_gpu_reason(no_devices)


def test_usage_unavailable_reason_never_starts_cuda(monkeypatch):
    from gpu_quota_ext.kernel.reasons import usage_unavailable_reason

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert usage_unavailable_reason() is None  # no torch: usage comes once torch starts CUDA
    torch = fake_torch(80 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert usage_unavailable_reason() is None
    torch.version.cuda = None
    assert usage_unavailable_reason() == f"this kernel's torch {torch.__version__} is built without CUDA"
    assert torch.cuda.context_calls == 0 and not torch.cuda.initialized


def counting_refreshes(panel) -> list:
    ticks: list = []
    refresh = panel.refresh

    def counted():
        ticks.append(1)
        return refresh()

    panel.refresh = counted
    return ticks


def test_panel_widget_without_a_gpu_does_not_start_cuda(monkeypatch):
    pytest.importorskip("ipywidgets")
    from gpu_quota_ext.kernel.panel import GpuUsagePanel

    torch = fake_torch(80 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    panel = GpuUsagePanel(interval=0.02, state=state_on())
    try:
        ticks = counting_refreshes(panel)
        assert panel.running
        assert "GPU not in use yet" in panel.status.value
        assert len(panel.rows.children) == 1
        wait_for(lambda: len(ticks) >= 3)  # three readings by the thread
        assert torch.cuda.context_calls == 0 and not torch.cuda.initialized
    finally:
        panel.close()
    assert not panel.running


def test_closing_the_widget_stops_the_thread(monkeypatch):
    pytest.importorskip("ipywidgets")
    from gpu_quota_ext.kernel.panel import GpuUsagePanel

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    panel = GpuUsagePanel(interval=3600, state=state_on())  # a thread that would sleep for an hour
    assert panel.running
    panel.widget.close()  # what the browser or the user does; not the panel's own close()
    panel._thread.join(timeout=5)
    assert not panel.running


def test_a_new_panel_replaces_the_one_before(monkeypatch, capsys):
    pytest.importorskip("ipywidgets")
    from gpu_quota_ext.kernel.magic import GpuCap

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    from IPython.core.events import EventManager, available_events

    shell = types.SimpleNamespace(events=EventManager(None, available_events))
    controller = GpuCap(shell=shell, state=state_on(), client=None, env={})
    for _ in range(5):
        controller.magic("panel")
    first = controller.panels[0]
    controller.magic("panel")
    (latest,) = controller.panels
    assert latest is not first and latest.running and not first.running
    assert first.widget.comm is None  # its widgets are closed: the browser drops the old view
    live = [t for t in threading.enumerate() if t.name == "gpu-quota-panel"]
    assert live == [latest._thread]
    controller.unregister()  # %unload_ext: the last panel stops too
    assert not latest.running


class HistoryServer:
    """A client whose server keeps `points` (t = 1, 2, ...) and answers only those newer than `since`."""

    def __init__(self, points_max=4):
        self.points: list = []
        self.asked: list = []
        self.points_max = points_max

    def add(self, count):
        start = len(self.points)
        self.points += [{"t": float(start + i + 1), "used": GiB, "allocated": None, "reserved": None,
                         "cap": 2 * GiB, "hard_limit": None, "park": "idle"} for i in range(count)]

    def history(self, since=None):
        self.asked.append(since)
        newer = [p for p in self.points if since is None or p["t"] > since]
        return {"interval": 1.0, "points_max": self.points_max, "points": newer[-self.points_max:]}

    def park_state(self):
        return None

    def report_usage(self, devices):
        pass


def test_the_panels_chart_reads_only_new_points_and_keeps_at_most_the_servers_points_max(monkeypatch):
    pytest.importorskip("ipywidgets")
    from gpu_quota_ext.kernel import panel as panel_module

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(panel_module, "HISTORY_READ_S", 0.0)
    server = HistoryServer()
    server.add(3)
    panel = panel_module.GpuUsagePanel(state=state_on(), client=server, start=False)
    try:
        assert panel.chart.value.count('<svg class="gpu-quota-chart"') == 1
        server.add(3)
        panel.refresh()
        assert server.asked == [None, 3.0]  # the second read asks for what came after the newest point it has
        assert [p["t"] for p in panel._points] == [3.0, 4.0, 5.0, 6.0]  # the server's points_max, the oldest gone
        assert not panel.read_history()  # nothing new: the chart is left as it is
    finally:
        panel.close()


# --- the HTTP client -------------------------------------------------------------------------------------


class Recorder(BaseHTTPRequestHandler):
    requests: list = []
    hold = None  # a threading.Event: when given, each answer waits until it is set
    answered = 0  # answers written so far
    answer = (
        200,
        {
            "outcome": "granted",
            "message": "ok",
            "kernel": {"source": "kernel request", "devices": [{"index": 3, "cap": 1}]},
        },
    )

    def _handle(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        headers = {k.lower(): v for k, v in self.headers.items()}  # HTTP header names are case-insensitive
        Recorder.requests.append((self.command, self.path, headers, json.loads(body)))
        if Recorder.hold is not None:
            Recorder.hold.wait(timeout=30)
        status, reply = Recorder.answer
        raw = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)
        Recorder.answered += 1

    do_PUT = do_POST = _handle

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Recorder.requests, Recorder.hold, Recorder.answered = [], None, 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/base%40x/"
    httpd.shutdown()
    httpd.server_close()


def test_cap_request_carries_the_secret_in_its_header_only(server):
    client = QuotaClient(server, "kernel-1", SECRET)
    answer = client.request_cap("30%", 3)
    method, path, headers, body = Recorder.requests[0]
    assert (method, path, body) == ("PUT", "/base%40x/api/gpu-quota/kernels/kernel-1", {"cap": "30%", "device": 3})
    assert headers[TOKEN_HEADER.lower()] == SECRET
    assert (
        answer.outcome == "granted" and answer.devices == [{"index": 3, "cap": 1}] and answer.source == "kernel request"
    )
    assert SECRET not in repr(client)


@pytest.mark.parametrize(
    "status, reply, outcome, says",
    [
        (409, {"outcome": "refused", "message": "above max_cap", "kernel": {}}, "refused", "above max_cap"),
        (403, {"message": "this secret does not belong to kernel kernel-1"}, "error", "(403)"),
        (400, {"message": "cap: bad"}, "error", "cap: bad"),
        (404, None, "error", "HTTP 404"),
    ],
)
def test_answers_other_than_a_grant(server, status, reply, outcome, says):
    Recorder.answer = (status, reply)
    try:
        answer = QuotaClient(server, "kernel-1", SECRET).reset()
    finally:
        Recorder.answer = (200, {"outcome": "granted", "message": "ok", "kernel": {}})
    assert answer.outcome == outcome and says in answer.message and SECRET not in answer.message
    assert Recorder.requests[0][3] == {"reset": True}


def test_unreachable_server_is_an_error_answer():
    answer = QuotaClient("http://127.0.0.1:9/", "k", SECRET).request_cap("0.3")
    assert answer.outcome == "error" and "cannot reach" in answer.message and SECRET not in answer.message


def test_usage_report_is_fire_and_forget(server, monkeypatch):
    Recorder.hold = threading.Event()  # the server keeps every answer until the test lets it go
    client = QuotaClient(server, "kernel-1", SECRET)
    torch = fake_torch(80 * GiB)
    monkeypatch.setitem(sys.modules, "torch", torch)
    torch.cuda.init()
    torch.cuda.allocated[0] = GiB
    report_to_server(state_on(index=3), client)
    report_to_server(state_on(index=3), client)  # skipped: the first is still in flight
    # Both calls returned before the server answered (it cannot answer until the test lets it): the cell
    # never waits for the report.
    assert Recorder.answered == 0
    wait_for(lambda: Recorder.requests)
    Recorder.hold.set()
    wait_for(lambda: _report_finished(client))
    assert len(Recorder.requests) == 1
    method, path, headers, body = Recorder.requests[0]
    assert (method, path) == ("POST", "/base%40x/api/gpu-quota/kernels/kernel-1/usage")
    assert headers[TOKEN_HEADER.lower()] == SECRET
    assert body == {"devices": [{"index": 3, "allocated": GiB, "reserved": 0, "peak": 0}]}


def _report_finished(client) -> bool:
    if not client._usage_in_flight.acquire(blocking=False):
        return False
    client._usage_in_flight.release()
    return True


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_no_usage_report_before_cuda_starts(server, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(80 * GiB))
    client = QuotaClient(server, "kernel-1", SECRET)
    report_to_server(state_on(), client)
    # A report, once started, holds the in-flight lock until the server has recorded it: the lock free
    # and no request recorded (read in this order) means none was started.
    assert _report_finished(client)
    assert Recorder.requests == []
