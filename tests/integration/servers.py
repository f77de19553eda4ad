"""A whole jupyter_server with gpu_quota_ext as a subprocess (for what an in-process server cannot show:
its exit, signals, another Unix user; and for one server shared by a module's read-only checks, which
pytest-jupyter's per-test server and event loop cannot give), and code run in its kernels through their
connection files."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

from ..kernel_transport import TRANSPORT_ARGS, check_connection_dir
from .cell_output import CellOutput
from .fake_mps import wait_until

TOKEN = "hard-cap-test"
# What jupyter_server logs when the port it picked was taken before it listened on it, and how many times a
# server is started before that fails the test.
PORT_CLASH = "is already in use"
PORT_CLASH_STARTS = 3


def server_command(root_dir, *args: str, python: str = sys.executable, token: str = "") -> List[str]:
    """`python -m jupyter_server` serving `root_dir` on a port it picks, with no browser and the `token` given,
    then `args`."""
    return [
        python,
        "-m",
        "jupyter_server",
        "--no-browser",
        "--allow-root",
        "--port=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root_dir}",
        *args,
    ]


class Server:
    """`python -m jupyter_server` with gpu_quota_ext, its stderr collected by a thread.

    `prefix` runs it through another program (`["runuser", "-u", "alice", "--"]`); `runtime` is its
    JUPYTER_RUNTIME_DIR (connection files, its kernels' IPC sockets and the managed MPS daemon's directories
    go there: a short path, kernel_transport.short_directory); `config`
    (a Config as a dict, as pytest-jupyter's jp_server_config) becomes its jupyter_server_config.json."""

    # The Python whose jupyter_server runs, what enables the extension on its command line, and the folder
    # it starts in: a subclass for another installation (tests/package's venv) runs its own Python, enables
    # nothing itself, and starts outside the checkout (`python -m` would import the checkout's package).
    python = sys.executable
    enabling_args: Sequence[str] = ("--ServerApp.jpserver_extensions={'gpu_quota_ext': True}",)
    cwd: Optional[Path] = None

    def __init__(self, runtime: Path, args: Sequence[str], env_extra=None, prefix: Sequence[str] = (), config=None):
        # Its kernels' IPC sockets are named after their connection files in `runtime` (kernel_transport).
        self.runtime = check_connection_dir(runtime)
        if config is not None:
            (self.runtime / "config").mkdir(parents=True, exist_ok=True)
            (self.runtime / "config" / "jupyter_server_config.json").write_text(json.dumps(config))
        self._env = self.base_environment()
        self._env.update(
            JUPYTER_RUNTIME_DIR=str(runtime), JUPYTER_CONFIG_DIR=str(self.runtime / "config"), **(env_extra or {})
        )
        self._command = [
            *prefix,
            *server_command(
                runtime, "--ip=127.0.0.1", *self.enabling_args, *TRANSPORT_ARGS, *args, python=self.python, token=TOKEN
            ),
        ]
        self.starts = 0
        self._start()

    def _start(self) -> None:
        self.starts += 1
        self.lines: list = []
        # A session of its own: kill() reaches a server started through runuser, which forks it.
        self.process = subprocess.Popen(
            self._command, env=self._env, cwd=self.cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def base_environment(self) -> dict:
        """This process's environment without the settings a test must give explicitly."""
        return {k: v for k, v in os.environ.items() if not k.startswith(("GPU_QUOTA_", "CUDA_MPS_"))}

    def _read(self):
        for line in self.process.stderr:
            self.lines.append(line)

    def url(self) -> Optional[str]:
        for line in self.lines:
            match = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
            if match:
                return f"http://127.0.0.1:{match.group(1)}"
        return None

    def wait_serving(self, timeout: float = 60):
        # jupyter_server prints its URL before its loop binds the port (the bind is a loop callback):
        # serving means a connection is accepted, not that the line was printed.
        return wait_until(self._serving, timeout=timeout)

    def _serving(self) -> Optional[str]:
        # With --port=0 jupyter_server binds port 0, reads the port, closes that socket, prints its URL and binds
        # the port again one turn of its loop later; another process may take it in between. It then exits
        # saying so, before anything else happened: start it again (and whatever accepted on that port
        # meanwhile was not this server).
        clashed = any(PORT_CLASH in line for line in self.lines)
        if not clashed:
            url = self._accepts()
            if url is not None or self.process.poll() is None:
                return url
        if self.process.poll() is None:
            return None  # exiting
        self._reader.join(timeout=10)  # every line it wrote before it exited
        if self.starts < PORT_CLASH_STARTS and any(PORT_CLASH in line for line in self.lines):
            self._start()
            return None
        self.fail()

    def _accepts(self) -> Optional[str]:
        url = self.url()
        if url is None:
            return None
        host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError:
            return None
        return url

    def fail(self):
        raise AssertionError("the server exited:\n" + "".join(self.lines))

    def api(self, path, method="GET", body=None, timeout: float = 60):
        """The answer's JSON; any HTTP error fails, with the server's log."""
        status, answer = self.answer(path, method, body, timeout)
        if status >= 400:
            raise AssertionError(f"{method} {path}: HTTP {status} {answer}\n" + "".join(self.lines))
        return answer

    def answer(self, path, method="GET", body=None, timeout: float = 60, headers=None):
        """(HTTP status, the answer's JSON or None), errors included; no answer at all fails."""
        request = urllib.request.Request(
            self.url() + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {TOKEN}", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return answer.status, json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as error:
            text = error.read()
            try:
                return error.code, json.loads(text or b"null")
            except ValueError:
                return error.code, None
        except urllib.error.URLError as error:
            raise AssertionError(f"{method} {path}: {error}\n" + "".join(self.lines)) from None

    def start_kernel(self, name: str = "python3") -> str:
        """A kernel started the way the browser starts one (POST /api/kernels); its id."""
        return self.api("/api/kernels", "POST", {"name": name})["id"]

    def run(self, kernel_id: str, code: str, timeout: float = 120) -> str:
        """Run `code` in one of this server's kernels (through its connection file); its stdout."""
        return run_in_kernel(self.runtime / f"kernel-{kernel_id}.json", code, timeout)

    def cell(self, kernel_id: str, code: str, timeout: float = 120) -> CellOutput:
        """Run `code` in one of this server's kernels; everything it sent, errors included."""
        return cell_in_kernel(self.runtime / f"kernel-{kernel_id}.json", code, timeout)

    def exit_code(self, timeout=60):
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def kill(self, grace: float = 30):
        """SIGTERM (the server shuts its kernels down), then SIGKILL to what is left of its group."""
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)
        self.process.wait()

    def _signal_group(self, sig) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@contextmanager
def serving(runtime: Path, config=None, args: Sequence[str] = ()) -> Iterator[Server]:
    """A Server, serving, for the length of the block (a module-scoped fixture's); killed after it."""
    server = Server(runtime, args, config=config)
    try:
        server.wait_serving()
        yield server
    finally:
        server.kill()


def cell_in_kernel(connection_file: Path, code: str, timeout: float = 120) -> CellOutput:
    """Execute `code` in the kernel of `connection_file`; everything it sent on iopub."""
    from jupyter_client import BlockingKernelClient

    client = BlockingKernelClient(connection_file=str(connection_file))
    client.load_connection_file()
    # No heartbeat channel: a client that no KernelManager made reads one missed beat (a busy machine, a
    # kernel still starting) as a dead kernel; without it, only the timeout decides.
    client.start_channels(hb=False)
    try:
        client.wait_for_ready(timeout=timeout)
        out = CellOutput(status="")
        reply = client.execute_interactive(code, output_hook=out.add, timeout=timeout)
        return out.finish(reply)
    finally:
        client.stop_channels()


def run_in_kernel(connection_file: Path, code: str, timeout: float = 120) -> str:
    """Execute `code` in the kernel of `connection_file`; its stdout. A cell error or a timeout fails."""
    out = cell_in_kernel(connection_file, code, timeout)
    if out.status != "ok" or out.errors:
        raise AssertionError(f"cell failed:\n{code}\n" + "\n".join("\n".join(e["traceback"]) for e in out.errors))
    return out.stdout
