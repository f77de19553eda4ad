"""Driving a real JupyterHub from a test: start it on loopback, call its REST API, run code in a user's
kernel through the hub's proxy (the websocket the browser uses). Stdlib + tornado only."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, Optional, Tuple

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port
from tornado.websocket import websocket_connect

from ..kernel_transport import TRANSPORT_SETTINGS, short_directory

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHP = HERE / "node" / "node_modules" / ".bin" / "configurable-http-proxy"


def missing_setup() -> Optional[str]:
    """Why the hub test cannot run here, or None. Both are installed by tests/hub/setup.sh."""
    problems = []
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        problems.append(f"jupyterhub is not installed in {sys.prefix}")
    if not os.access(CHP, os.X_OK):
        problems.append(f"configurable-http-proxy is not installed at {CHP}")
    return "; ".join(problems) or None


def unused_port() -> int:
    """A loopback port nothing listened on a moment ago, for a program that binds its port itself and takes
    no bound socket (JupyterHub, configurable-http-proxy, a hub-managed service): another process may take
    it first, so whoever starts that program must notice its "address already in use" and start it again.
    A server of this process listens on a socket bound and held instead (listen_here)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listen_here(app) -> Tuple[HTTPServer, int]:
    """`app` served by this process (on its running loop) from a loopback socket bound and held from the
    start: no moment when another process could take its port. (server, port); server.stop() ends it."""
    sock, port = bind_unused_port()
    server = HTTPServer(app)
    server.add_sockets([sock])
    return server, port


# What JupyterHub's log says when the hub or its proxy could not bind a port (Python's words, then Node's),
# and how many times a hub is started before that fails the test.
PORT_CLASHES = ("Address already in use", "EADDRINUSE")
PORT_CLASH_STARTS = 3


class Hub:
    """A JupyterHub process (and its proxy, and the servers it spawns) in a folder of its own."""

    def __init__(self, folder: Path, config_text: str, python: str = sys.executable):
        """`python`: the Python that runs the hub, its service and its servers (another JupyterHub major's
        environment, tests/hub/hub_versions.py); this checkout's gpu_quota_ext is put on its path."""
        self.folder = folder
        self.python = python
        self.admin_token = uuid.uuid4().hex
        self.log_path = folder / "jupyterhub.log"
        self.config_path = folder / "jupyterhub_config.py"
        self.config_text = config_text
        # The spawned servers' kernels talk over IPC sockets (tests/kernel_transport.py): a config folder on
        # their JUPYTER_CONFIG_PATH says so, and each user's runtime folder is a short one. Both under a folder
        # that servers run as other Unix users (LocalProcessSpawner) can reach.
        self.spawned = short_directory()
        self.spawned.chmod(0o755)
        (self.spawned / "config").mkdir(mode=0o755)
        # jupyter_config.json: every Jupyter app reads it, a server given --config=FILE too (which then reads
        # no jupyter_server_config file of the config path).
        (self.spawned / "config" / "jupyter_config.json").write_text(json.dumps(TRANSPORT_SETTINGS))
        self.starts = 0
        self._pick_ports()
        self.process: Optional[subprocess.Popen] = None

    def _pick_ports(self) -> None:
        """Ports for the proxy and the hub, written into its config. JupyterHub and configurable-http-proxy bind
        them themselves and take no socket bound beforehand: another process may take one before they do. Their
        log then says so, and wait_until_up starts the hub again on other ports (PORT_CLASH_STARTS times)."""
        self.port = unused_port()
        self.url = f"http://127.0.0.1:{self.port}"
        header = HUB_CONFIG_HEADER.format(
            port=self.port,
            hub_port=unused_port(),
            proxy_api_port=unused_port(),
            chp=str(CHP),
            folder=str(self.folder),
            spawned=str(self.spawned),
            python=self.python,
            admin_token=self.admin_token,
        )
        self.config_path.write_text(header + "\n" + self.config_text)

    def start(self) -> None:
        self.starts += 1
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "JUPYTER_", "JPY_"))}
        if self.python != sys.executable:
            # That environment has JupyterHub and the package's dependencies, not the package.
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self._log = open(self.log_path, "ab")
        self._log_start = self._log.tell()  # where this start's lines begin (a restart appends)
        self.process = subprocess.Popen(
            [self.python, "-m", "jupyterhub", "-f", str(self.config_path)],
            cwd=self.folder,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the proxy and servers can be stopped with it
        )

    def kernel_transports(self) -> Dict[str, str]:
        """kernel id -> the ZMQ transport of its connection file, for every kernel of the spawned servers."""
        found = {}
        for connection in self.spawned.glob("runtime-*/kernel-*.json"):
            found[connection.stem[len("kernel-"):]] = json.loads(connection.read_text())["transport"]
        return found

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no hub log)"

    def stop(self) -> None:
        """The hub, its proxy and its servers stopped; the spawned servers' folder removed."""
        self._stop_processes()
        shutil.rmtree(self.spawned, ignore_errors=True)

    def _stop_processes(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the hub stops its servers and its proxy
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # anything of this hub's group still left
        except (ProcessLookupError, PermissionError):
            pass
        # The proxy runs in a session of its own; a hub stopped while starting may not have stopped it.
        try:
            proxy_pid = int((self.folder / "proxy.pid").read_text().strip())
            if "configurable-http-proxy" in Path(f"/proc/{proxy_pid}/cmdline").read_bytes().decode(errors="replace"):
                os.kill(proxy_pid, signal.SIGTERM)
        except (OSError, ValueError):
            pass
        self._log.close()

    # --- HTTP -------------------------------------------------------------------------------------

    async def api(
        self, method: str, path: str, body=None, token: Optional[str] = None, ok=(200, 201, 202, 204),
        request_timeout: float = 60,
    ):
        """A request to the hub (or, through its proxy, a user's server); returns (status, JSON or None)."""
        request = HTTPRequest(
            self.url + path,
            method=method,
            headers={"Authorization": f"token {token or self.admin_token}"},
            body=None if body is None and method in ("GET", "DELETE") else json.dumps(body if body is not None else {}),
            request_timeout=request_timeout,
            follow_redirects=False,
        )
        try:
            response = await AsyncHTTPClient().fetch(request, raise_error=False)
        except (ConnectionError, OSError) as error:
            raise ConnectionError(f"{method} {path}: {error}") from None
        try:
            data = json.loads(response.body) if response.body else None
        except ValueError:  # an HTML error page (the proxy before the hub has registered its route)
            data = response.body.decode(errors="replace")
        if response.code not in ok:
            raise AssertionError(f"{method} {path} answered {response.code}: {response.body[:2000]!r}")
        return response.code, data

    async def wait_until_up(self, timeout: float = 40) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            said = self.log_path.read_bytes()[self._log_start:].decode(errors="replace")
            if any(clash in said for clash in PORT_CLASHES):
                if self.starts >= PORT_CLASH_STARTS:
                    raise AssertionError(f"a port of the hub was taken {self.starts} times:\n{self.log_tail()}")
                # JupyterHub exits; configurable-http-proxy says so and goes on without its public port, where
                # whatever took it answers: either way, start again on other ports.
                self._stop_processes()
                self._pick_ports()
                self.start()
                deadline = time.monotonic() + timeout
                continue
            if self.process.poll() is not None:
                raise AssertionError(f"jupyterhub exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                await self.api("GET", "/hub/api/", request_timeout=5)
                return
            except (ConnectionError, AssertionError, HTTPClientError):
                await _sleep(0.3)
        raise AssertionError(f"jupyterhub did not answer within {timeout} s:\n{self.log_tail()}")

    async def start_server(self, user: str) -> None:
        await self.api("POST", f"/hub/api/users/{user}/server")

    async def wait_for_server(self, user: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, model = await self.api("GET", f"/hub/api/users/{user}")
            server = (model.get("servers") or {}).get("")
            if server and server.get("ready"):
                return
            await _sleep(0.3)
        raise AssertionError(f"{user}'s server was not ready within {timeout} s:\n{self.log_tail()}")

    async def user_token(self, user: str) -> str:
        body = {"note": "gpu-quota-ext hub test", "expires_in": 600}
        _, data = await self.api("POST", f"/hub/api/users/{user}/tokens", body)
        return data["token"]

    # --- a kernel, through the proxy, the way the browser reaches it ---------------------------------

    async def execute(self, user: str, token: str, kernel_id: str, code: str, timeout: float = 60) -> Dict[str, str]:
        """Run `code` in the kernel over its websocket; returns {"stdout", "stderr", "error", "status"}."""
        url = f"ws://127.0.0.1:{self.port}/user/{user}/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}"
        connection = await websocket_connect(
            HTTPRequest(url, headers={"Authorization": f"token {token}"}, request_timeout=30)
        )
        try:
            msg_id = uuid.uuid4().hex
            connection.write_message(json.dumps(execute_request(msg_id, code)))
            out = {"stdout": "", "stderr": "", "error": "", "status": ""}
            idle = False
            deadline = time.monotonic() + timeout
            while not (idle and out["status"]):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"no reply from {user}'s kernel within {timeout} s to:\n{code}\nso far: {out}")
                raw = await _with_timeout(connection.read_message(), remaining)
                if raw is None:
                    raise AssertionError(f"{user}'s kernel websocket closed; so far: {out}")
                msg = json.loads(raw)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = msg["msg_type"] if "msg_type" in msg else msg["header"]["msg_type"]
                content = msg["content"]
                if kind == "stream":
                    out[content["name"]] += content["text"]
                elif kind == "error":
                    out["error"] += "\n".join(content["traceback"])
                elif kind == "execute_reply":
                    out["status"] = content["status"]
                elif kind == "status" and content["execution_state"] == "idle":
                    idle = True
            return out
        finally:
            connection.close()


def execute_request(msg_id: str, code: str) -> dict:
    """A Jupyter protocol execute_request as jupyter_server's JSON websocket protocol carries it."""
    return {
        "header": {
            "msg_id": msg_id,
            "msg_type": "execute_request",
            "username": "hub-test",
            "session": uuid.uuid4().hex,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "version": "5.3",
        },
        "parent_header": {},
        "metadata": {},
        "content": {
            "code": code,
            "silent": False,
            "store_history": False,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
        "channel": "shell",
        "buffers": [],
    }


async def _sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def _with_timeout(awaitable, seconds: float):
    return await asyncio.wait_for(awaitable, seconds)


# Loopback only, unused ports, every file in the test's own folder (the spawned servers' short runtime
# folders aside); servers are spawned as this OS user.
HUB_CONFIG_HEADER = """
import os as _os
import pwd as _pwd


def _spawned_runtime(spawner):
    # A short runtime folder of the user's own: its kernels' IPC sockets are named after connection files in it.
    path = _os.path.join({spawned!r}, "runtime-" + spawner.user.name)
    _os.makedirs(path, mode=0o700, exist_ok=True)
    if _os.getuid() == 0:
        try:
            entry = _pwd.getpwnam(spawner.user.name)  # LocalProcessSpawner: the server runs as that user
            _os.chown(path, entry.pw_uid, entry.pw_gid)
        except KeyError:
            pass  # no such Unix user: the server runs as the hub's
    return path


c.Spawner.environment = {{
    "JUPYTER_CONFIG_PATH": {spawned!r} + "/config",
    "JUPYTER_RUNTIME_DIR": _spawned_runtime,
}}
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.ConfigurableHTTPProxy.command = [{chp!r}]
c.ConfigurableHTTPProxy.pid_file = {folder!r} + "/proxy.pid"
c.JupyterHub.db_url = "sqlite:///" + {folder!r} + "/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = {folder!r} + "/cookie_secret"
c.JupyterHub.pid_file = {folder!r} + "/jupyterhub.pid"
c.JupyterHub.authenticator_class = "jupyterhub.auth.NullAuthenticator"
c.JupyterHub.spawner_class = "jupyterhub.spawner.SimpleLocalProcessSpawner"
c.SimpleLocalProcessSpawner.home_dir_template = {folder!r} + "/home/{{username}}"
c.Spawner.cmd = [{python!r}, "-m", "jupyterhub.singleuser"]
c.Spawner.start_timeout = 60
c.Spawner.http_timeout = 60
c.JupyterHub.services = [{{"name": "hub-test-admin", "api_token": {admin_token!r}}}]
c.JupyterHub.load_roles = [{{
    "name": "hub-test-admin",
    "scopes": ["admin:users", "admin:servers", "admin:groups", "tokens", "access:servers", "list:users", "read:users"],
    "services": ["hub-test-admin"],
}}]
c.JupyterHub.log_level = "INFO"
"""
