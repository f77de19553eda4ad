"""No test helper picks a port to bind it later (issue 31): a helper that binds port 0, reads the port and
closes the socket hands out a port that another process may take before whoever it was for binds it. On a
busy machine that failed test_monitor_stall with "Address already in use". Kernels talk over IPC sockets
(tests/kernel_transport.py); servers of the test's own process listen on sockets bound and held
(pytest-jupyter's, hubtools.listen_here); a jupyter_server of its own is given --port=0."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Iterator, List

TESTS = Path(__file__).resolve().parents[1]

# The pickers that stay, and why each cannot bind and hold.
KNOWN = {
    # JupyterHub, configurable-http-proxy and a hub-managed service bind the ports written in their config
    # and take no bound socket; whoever starts them starts them again when the port was taken meanwhile.
    "hub/hubtools.py:unused_port",
    # The stand-in service goes down and comes back on the same port (a hub restarting); nothing else
    # runs meanwhile in that test.
    "unit/test_remote_ledger.py:_free_port",
}

PICK_THEN_BIND = '''
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
'''
BIND_AND_HOLD = '''
def listening():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock
'''


def python_files(root: Path) -> Iterator[Path]:
    """The tests' own sources: not tests/hub/.versions (other JupyterHub majors' environments), no node_modules."""
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in ("node_modules", "__pycache__")]
        yield from (Path(folder) / name for name in files if name.endswith(".py"))


def pickers(source: str) -> List[str]:
    """Functions of `source` that bind a socket to port 0 and return the port they read from it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside = list(ast.walk(node))
            binds_port_0 = any(_binds_port_0(call) for call in inside if isinstance(call, ast.Call))
            returns_the_port = any(
                isinstance(n, ast.Return) and n.value is not None and "getsockname" in ast.dump(n.value) for n in inside
            )
            if binds_port_0 and returns_the_port:
                found.append(node.name)
    return found


def _binds_port_0(call: ast.Call) -> bool:
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "bind" and call.args):
        return False
    address = call.args[0]
    return (
        isinstance(address, ast.Tuple)
        and len(address.elts) == 2
        and isinstance(address.elts[1], ast.Constant)
        and address.elts[1].value == 0
    )


def test_the_check_finds_a_helper_that_picks_a_port_and_not_one_that_holds_it():
    assert pickers(PICK_THEN_BIND) == ["free_port"]
    assert pickers(BIND_AND_HOLD) == []


def test_no_test_helper_picks_a_port_to_bind_it_later():
    found = {
        f"{path.relative_to(TESTS).as_posix()}:{name}"
        for path in python_files(TESTS)
        for name in pickers(path.read_text(encoding="utf-8"))
    }
    assert found == KNOWN, f"new: {sorted(found - KNOWN)}; gone (drop them from KNOWN): {sorted(KNOWN - found)}"
