"""Issue 19, item 5: a refusal decided before a request's body is read reaches a client through the hub's
proxy as itself, not as the proxy's 503.

A real configurable-http-proxy in front of a real jupyter_server with gpu_quota_ext (a subprocess) and of
the host service's web app (in this process, tests/unit/test_host_service_app.py's: no hub answers it, so a
request without a token is its 401).
Each request is sent three times, each on a connection of its own to the proxy, which keeps its own
connections to the servers alive between them. Install the proxy with `bash tests/hub/setup.sh`.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import time
import urllib.request
import uuid

import pytest

from gpu_quota_ext.shared.service_contract import GRANTS_PATH, LEASE_PATH
from tests.integration.servers import TOKEN, Server
from tests.kernel_transport import short_directory

from .hubtools import CHP, PORT_CLASH_STARTS, PORT_CLASHES, listen_here, unused_port

PREFIX = "/services/gpu-quota/"


class Proxy:
    """configurable-http-proxy: every path to `default`, PREFIX to the service."""

    def __init__(self, default: str):
        self.default, self.token, self.starts = default, uuid.uuid4().hex, 0
        self._start()

    def _start(self) -> None:
        # It binds its ports itself (hubtools.unused_port): one taken meanwhile makes it exit, and route()
        # starts it again on others.
        self.starts += 1
        self.port, self.api_port = unused_port(), unused_port()
        command = [str(CHP), "--ip=127.0.0.1", f"--port={self.port}", f"--api-port={self.api_port}",
                   f"--default-target={self.default}"]
        self.process = subprocess.Popen(
            command, env={"CONFIGPROXY_AUTH_TOKEN": self.token, "PATH": "/usr/bin:/bin"},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )

    def route(self, prefix: str, target: str) -> None:
        deadline = time.monotonic() + 30
        while True:
            request = urllib.request.Request(
                f"http://127.0.0.1:{self.api_port}/api/routes{prefix}", method="POST",
                data=json.dumps({"target": target}).encode(), headers={"Authorization": f"token {self.token}"},
            )
            try:
                with urllib.request.urlopen(request, timeout=5) as answer:
                    assert answer.status == 201
                    return
            except OSError:
                if self.process.poll() is not None and self.starts < PORT_CLASH_STARTS:
                    said = self.process.stderr.read()
                    if any(clash in said for clash in PORT_CLASHES):
                        self._start()
                        continue
                    raise AssertionError(f"configurable-http-proxy exited:\n{said[-3000:]}") from None
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def ask(port: int, method: str, path: str, body: bytes, headers: dict) -> tuple:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(method, path, body=body, headers=headers)
        answer = connection.getresponse()
        text = answer.read()
        try:
            return answer.status, json.loads(text).get("message", "")
        except ValueError:
            return answer.status, text[:200].decode(errors="replace")
    finally:
        connection.close()


@pytest.mark.timeout(240)
def test_refusals_before_the_body_reach_the_client_through_the_proxy(setup_ok, service, short_tmp):
    runtime = short_directory(short_tmp)
    server = Server(runtime, ["--GpuQuota.inventory_class=gpu_quota_ext.devices.StaticInventory"])
    proxy = None
    try:
        server.wait_serving()
        kernel_id = server.start_kernel()
        proxy = Proxy(server.url())
        asyncio.run(_through_the_proxy(proxy, server, service, kernel_id))
    except BaseException:
        print("---- server log ----\n" + "".join(server.lines)[-6000:])
        if proxy is not None and proxy.process.poll() is not None:
            print("---- proxy ----\n" + proxy.process.stderr.read()[-3000:])
        raise
    finally:
        if proxy is not None:
            proxy.stop()
        server.kill()


async def _through_the_proxy(proxy, server, service, kernel_id):
    listening, service_port = listen_here(service.web_app(PREFIX))
    try:
        await asyncio.to_thread(proxy.route, PREFIX.rstrip("/"), f"http://127.0.0.1:{service_port}")
        kernel = f"/api/gpu-quota/kernels/{kernel_id}"
        token = {"Authorization": f"token {TOKEN}"}
        cases = [
            # (what, method, path, body, headers, the answer the client must get)
            ("a 2 MB cap request", "PUT", kernel, b'{"cap": "0.5"}' + b" " * 2_000_000, token, 413),
            ("a 100 KB park request", "POST", kernel + "/park", b"x" * 100_000, token, 413),
            ("a 2 MB cap request without credentials", "PUT", kernel, b" " * 2_000_000, {}, 403),
            ("a 100 KB usage report with a wrong secret", "POST", kernel + "/usage", b" " * 100_000,
             {"X-GPU-Quota-Kernel-Token": "guess"}, 413),
            ("the service: a 2 MB grant request without a token", "POST", PREFIX + GRANTS_PATH, b" " * 2_000_000,
             {}, 401),
            ("the service: a 100 KB lease without a token", "POST", PREFIX + LEASE_PATH, b"x" * 100_000, {}, 401),
        ]
        for what, method, path, body, headers, expected in cases:
            answers = [await asyncio.to_thread(ask, proxy.port, method, path, body, headers) for _ in range(3)]
            assert [code for code, _ in answers] == [expected] * 3, (what, answers)
        # Past the refusals, both still answer through the same proxy.
        assert (await asyncio.to_thread(ask, proxy.port, "GET", "/api/gpu-quota/status", b"", token))[0] == 200
    finally:
        listening.stop()


def test_a_malformed_content_length_is_a_400_on_every_service_route(service, caplog):
    """Straight to the service (no proxy needed): with or without a token, no traceback, nothing granted."""

    async def scenario():
        listening, port = listen_here(service.web_app(PREFIX))
        try:
            answers = []
            for path in (GRANTS_PATH, GRANTS_PATH + "/k1", LEASE_PATH, "api/status"):
                for method in ("GET", "POST", "PUT", "DELETE"):
                    for headers in ({}, {"Authorization": "token abc"}):
                        for length in ("abc", "1, 2", "\u00b2", "-5"):
                            sent = {**headers, "Content-Length": length}
                            answers.append(await asyncio.to_thread(_raw, port, method, PREFIX + path, sent))
            return answers
        finally:
            listening.stop()

    with caplog.at_level("INFO"):
        answers = asyncio.run(scenario())
    assert set(answers) == {400}, answers
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= 40], caplog.text[-2000:]
    assert service.book.owned() == []


def _raw(port, method, path, headers):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.endheaders(b"{}")
        return connection.getresponse().status
    except (ConnectionError, http.client.HTTPException) as error:
        return repr(error)
    finally:
        connection.close()
