"""Real Unix users for the real-hub tests, and a Python they can run.

The tests run as root (CI too, on a clean clone that may sit under /root, mode 0700): another user can run
neither the test environment's Python nor read the checkout. So each user's server runs from an environment of
its own, outside /root and world-readable: a venv of Debian's /usr/bin/python3 in
/var/tmp/gq-hub-users-<hash>/ (the hash of the checkout's path, of pyproject.toml and of the JupyterHub,
jupyter_server and ipykernel versions of the test environment, installed there at the same versions), with this
checkout's package from a wheel built from it. One environment per checkout: two checkouts on one machine (git
worktrees) never reinstall their package under each other's running servers. It is reused while current: a second
run with the same checkout installs nothing (the package's sources have their own stamp, so a change to them
reinstalls the package alone, without its dependencies, in about two seconds). `UnixUsers` creates the users with
`useradd` and removes them, and their processes (each by its PID), at the end.

`users_python()` raises `NotProvided` with what is missing; `users_python_or_end_the_test()` fails the test with
it in CI (a skip there would hide the test), and skips elsewhere.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pwd
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import List, Optional

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
BASE_PYTHON = "/usr/bin/python3"  # Debian's: outside every user's home, runnable by all
PINNED = ("jupyterhub", "jupyter_server", "ipykernel")  # at the test environment's versions
BUILD_TOOLS = ("hatchling", "hatch-jupyter-builder")  # the wheel is built with the users' Python, offline


class NotProvided(Exception):
    """What this machine lacks for servers of real Unix users."""


def problem() -> Optional[str]:
    """Why real Unix users cannot be had here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "creating Unix users needs root (CI runs as root)"
    for tool in ("useradd", "userdel"):
        if not any(os.access(os.path.join(d, tool), os.X_OK) for d in ("/usr/sbin", "/sbin", "/usr/bin")):
            return f"{tool} is missing (Debian's passwd package)"
    if not os.access(BASE_PYTHON, os.X_OK):
        return f"{BASE_PYTHON} is missing: the users' servers need a Python outside /root (Debian's python3)"
    probe = subprocess.run([BASE_PYTHON, "-c", "import venv, ensurepip"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{BASE_PYTHON} cannot make a venv (Debian's python3-venv): {probe.stderr.strip()[-200:]}"
    return None


def _pins() -> List[str]:
    return [f"{name}=={version(name)}" for name in PINNED]


def _folder() -> Path:
    key = str(REPO).encode() + b"\0" + (REPO / "pyproject.toml").read_bytes() + " ".join(_pins()).encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return Path("/var/tmp") / f"gq-hub-users-{digest}"


def _sources_digest() -> str:
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes())
    for path in sorted((REPO / "gpu_quota_ext").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and "labextension" not in path.parts:
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _run(command: List[str], what: str, env: Optional[dict] = None) -> None:
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=540)
    if done.returncode != 0:
        raise NotProvided(f"{what} failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-1500:]}")


def users_python() -> str:
    """The users' Python, its environment made or brought up to date first (under a lock: runs may overlap)."""
    reason = problem()
    if reason:
        raise NotProvided(reason)
    folder = _folder()
    old = os.umask(0o022)  # everything in it readable by every user
    try:
        folder.mkdir(mode=0o755, exist_ok=True)
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return _bring_up_to_date(folder)
    finally:
        os.umask(old)


def users_python_or_end_the_test() -> str:
    """users_python(), or the test ends with what is missing: failed on CI (a skip there would hide it), skipped
    elsewhere."""
    try:
        return users_python()
    except NotProvided as missing:
        message = f"THE REAL-UNIX-USERS TEST DID NOT RUN: {missing}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _bring_up_to_date(folder: Path) -> str:
    venv = folder / "venv"
    python = str(venv / "bin" / "python")
    ready, package_stamp = folder / "dependencies-installed", folder / "package-sources"
    if not ready.exists():
        _run([BASE_PYTHON, "-m", "venv", "--clear", str(venv)], f"{BASE_PYTHON} -m venv {venv}")
        _run([python, "-m", "pip", "install", "--quiet", *BUILD_TOOLS], "installing the build tools")
    sources = _sources_digest()
    if ready.exists() and package_stamp.exists() and package_stamp.read_text() == sources:
        return python
    with tempfile.TemporaryDirectory() as wheels:
        # The JupyterLab extension is no business of these servers: the build hook is skipped.
        env = {**os.environ, "SKIP_JUPYTER_BUILDER": "1"}
        build = [python, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheels, str(REPO)]
        _run(build, "building the package's wheel from the checkout", env)
        (wheel,) = Path(wheels).glob("gpu_quota_ext-*.whl")
        if ready.exists():
            _run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall", str(wheel)], "pip")
        else:
            _run([python, "-m", "pip", "install", "--quiet", str(wheel), *_pins()], "installing the users' servers")
            ready.write_text(" ".join(_pins()) + "\n")
    package_stamp.write_text(sources)
    return python


class UnixUsers:
    """`with UnixUsers(names):` the users exist (with homes) inside, and neither they nor a process of theirs after."""

    def __init__(self, names: List[str]):
        self.names = list(names)
        self.created: List[str] = []

    def __enter__(self) -> "UnixUsers":
        try:
            for name in self.names:
                subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", name], check=True)
                self.created.append(name)
        except BaseException:
            self.__exit__()
            raise
        return self

    def uid(self, name: str) -> int:
        return pwd.getpwnam(name).pw_uid

    def processes(self, name: str) -> List[psutil.Process]:
        uid = self.uid(name)
        found = []
        for process in psutil.process_iter(["uids"]):
            uids = process.info["uids"]
            if uids is not None and uid in (uids.real, uids.effective):
                found.append(process)
        return found

    def __exit__(self, *_exc) -> None:
        for name in reversed(self.created):
            for process in self.processes(name):  # each by its PID: only these users' own
                try:
                    process.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(self.processes(name), timeout=10)
            subprocess.run(["userdel", "--remove", name], check=False, capture_output=True)
        self.created = []


if __name__ == "__main__":  # python -m tests.hub.unix_users: make the environment now (CI's setup, a developer)
    print(users_python())
    sys.exit(0)
