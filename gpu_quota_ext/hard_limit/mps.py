"""NVIDIA MPS's control program and daemon: ask it (with a timeout), start and stop a daemon of our own.

The daemon is an admin's ("external": CUDA_MPS_PIPE_DIRECTORY or MPS's default /tmp/nvidia-mps) or one
this server starts for itself ("managed": pipe and log directories under the server's runtime
directory, mode 0700, so only this server's user reaches it) and stops at shutdown, leaving no process.
A managed daemon is also stopped by a small watcher process when the server dies without shutting down
(SIGTERM outside jupyter_server's handler, SIGKILL, a crash): the watcher waits for the server's end of
a pipe to close (`python -m gpu_quota_ext.hard_limit.mps --watch ...`).

Every call of the control program has a timeout and runs in a process group of its own that is killed
when the time is up: the program can block for good (a daemon that died with its pipes in place).
Signals go only to processes we identified (the daemon's PID file, get_server_list) and only while
their start time is unchanged, so a reused PID is never hit.

What the server does with all this (its state, each kernel's layers) is layer.py; the pure rules are
decisions.py.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

from .decisions import LOG_VARIABLE, PIPE_VARIABLE, Probe

log = logging.getLogger("gpu_quota_ext")

PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the control daemon into its pipe directory
EXTRA_PATH = ("/usr/local/nvidia/bin",)  # where GPU containers and the lent machines keep the driver's tools


class MpsError(Exception):
    """The control program could not do what was asked, in one line."""


# --- the control program -----------------------------------------------------------------------------


def find_control(name: str) -> Optional[str]:
    """The control program's path: `name` itself when it is a path, else found on PATH or in
    /usr/local/nvidia/bin. None when there is none."""
    if os.sep in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(EXTRA_PATH))


def _control_env(pipe_directory: str, log_directory: Optional[str]) -> Dict[str, str]:
    env = dict(os.environ)
    # A daemon started under CUDA_VISIBLE_DEVICES renumbers the devices its servers show clients (NVIDIA's
    # MPS documentation): kernels name theirs by UUID or NVML index, so the daemon must see them all.
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # its device numbers are NVML's (set_default_device_pinned_mem_limit)
    env[PIPE_VARIABLE] = pipe_directory
    if log_directory:
        env[LOG_VARIABLE] = log_directory
    return env


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout=2)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process stuck in the kernel
        pass


def run_control(
    binary: str,
    pipe_directory: str,
    commands: str,
    timeout: float,
    log_directory: Optional[str] = None,
) -> str:
    """`echo commands | nvidia-cuda-mps-control` against this pipe directory; its answer, or MpsError."""
    try:
        process = subprocess.Popen(
            [binary],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_control_env(pipe_directory, log_directory),
            start_new_session=True,  # its own group: a timeout kills whatever it started too
            text=True,
        )
    except OSError as error:
        raise MpsError(f"{binary} could not run ({error.strerror or error})") from None
    try:
        out, err = process.communicate(commands, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        raise MpsError(
            f"{os.path.basename(binary)} did not answer within {timeout:g} s (pipe directory {pipe_directory})"
        ) from None
    if process.returncode != 0:
        said = (err or out or "").strip().splitlines()
        raise MpsError(
            f"{os.path.basename(binary)} exited with status {process.returncode}"
            + (f": {said[0][:200]}" if said else "")
            + f" (pipe directory {pipe_directory})"
        )
    return out


def server_list(binary: str, pipe_directory: str, timeout: float) -> List[int]:
    """PIDs of the MPS servers this daemon runs (`get_server_list`); MpsError when it does not answer."""
    answer = run_control(binary, pipe_directory, "get_server_list\n", timeout)
    pids = []
    for line in answer.splitlines():
        text = line.strip()
        if not text:
            continue
        if not text.isdigit():
            raise MpsError(f"unexpected answer to get_server_list: {text[:200]!r} (pipe directory {pipe_directory})")
        pids.append(int(text))
    return pids


def process_owner(pid: int) -> Optional[int]:
    """The real uid of process `pid` (/proc/PID/status), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_start(pid: int) -> Optional[int]:
    """The process's start time (/proc/PID/stat field 22): tells a PID from a later reuse of the number."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def probe(binary: Optional[str], pipe_directory: str, timeout: float) -> Probe:
    """Does the daemon answer, and whose MPS servers run there?"""
    if binary is None:
        return Probe(False, "nvidia-cuda-mps-control was not found")
    try:
        pids = server_list(binary, pipe_directory, timeout)
    except MpsError as error:
        return Probe(False, str(error))
    return Probe(True, servers=tuple((pid, process_owner(pid)) for pid in pids))


# --- processes we started -------------------------------------------------------------------------


class _Tracked:
    """A PID and its start time: signals go to that process only, never to a later one with its number."""

    def __init__(self, pid: int, start: Optional[int] = None):
        self.pid = pid
        self.start = process_start(pid) if start is None else start

    def alive(self) -> bool:
        start = process_start(self.pid)
        return start is not None and start == self.start and not _is_zombie(self.pid)

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _children(pid: int) -> List[int]:
    """PIDs whose parent is `pid` (/proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if stat.read().rpartition(")")[2].split()[1] == str(pid):
                        found.append(int(entry))
            except (OSError, IndexError):
                continue
    return found


def _wait_gone(processes: Sequence[_Tracked], seconds: float) -> List[_Tracked]:
    """Wait until every process has exited or `seconds` passed; return those still there."""
    deadline = time.monotonic() + seconds
    left = [p for p in processes if p.alive()]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a PID that is not our child: there is nothing to wait on
        left = [p for p in left if p.alive()]
    return left


def make_private(path: str) -> str:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # makedirs' mode is masked by the umask
    return path


# --- the managed daemon ---------------------------------------------------------------------------------


class ManagedDaemon:
    """An MPS control daemon this server starts for itself and stops at shutdown, leaving no process."""

    def __init__(self, binary: str, directory: str, timeout: float):
        """`directory`: where its `pipe` and `log` directories go (kept short: MPS's sockets live there)."""
        self.binary = binary
        self.directory = directory
        self.pipe_directory = os.path.join(directory, "pipe")
        self.log_directory = os.path.join(directory, "log")
        self.timeout = timeout
        self.daemon: Optional[_Tracked] = None
        self._watcher: Optional[subprocess.Popen] = None
        self._stop_lock = threading.Lock()
        self._stopped = False

    def start(self) -> None:
        """`nvidia-cuda-mps-control -d` with our own directories; MpsError when it does not come up."""
        make_private(self.directory)
        make_private(self.pipe_directory)
        make_private(self.log_directory)
        # Output to a file, not a pipe: the daemon it forks may keep the pipe open for good.
        with tempfile.TemporaryFile(mode="w+") as output:
            try:
                launcher = subprocess.Popen(
                    [self.binary, "-d"],
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=output,
                    env=_control_env(self.pipe_directory, self.log_directory),
                    start_new_session=True,
                )
            except OSError as error:
                raise MpsError(f"{self.binary} could not run ({error.strerror or error})") from None
            try:
                code = launcher.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                _kill_group(launcher)
                raise MpsError(f"{os.path.basename(self.binary)} -d did not return within {self.timeout:g} s") from None
            output.seek(0)
            said = output.read().strip().splitlines()
        if code != 0:
            raise MpsError(
                f"{os.path.basename(self.binary)} -d exited with status {code}" + (f": {said[0][:200]}" if said else "")
            )
        pid = self._read_pid(deadline=time.monotonic() + self.timeout)
        if pid is None:
            raise MpsError(
                f"the MPS control daemon wrote no {PID_FILE} in {self.pipe_directory} within {self.timeout:g} s"
            )
        self.daemon = _Tracked(pid)
        self._watcher = self._start_watcher()
        atexit.register(self.stop)
        log.info("gpu-quota-ext: started an MPS control daemon (PID %d), pipe directory %s", pid, self.pipe_directory)

    def configure(self, commands: str) -> Optional[str]:
        """Send settings (default limits) before any client connects; None, or why they were not taken."""
        if not commands:
            return None
        try:
            answer = run_control(self.binary, self.pipe_directory, commands, self.timeout).strip()
        except MpsError as error:
            return str(error)
        # It answers nothing when it takes them.
        return f"it answered {commands.splitlines()[0]!r} with {answer.splitlines()[0][:200]!r}" if answer else None

    def _read_pid(self, deadline: float) -> Optional[int]:
        path = os.path.join(self.pipe_directory, PID_FILE)
        while True:
            try:
                with open(path) as handle:
                    text = handle.read().strip()
                if text.isdigit():
                    return int(text)
            except OSError:
                pass
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)  # the daemon writes the file after it forked: nothing to wait on

    def _start_watcher(self) -> Optional[subprocess.Popen]:
        """A process that stops the daemon when this server's end of its stdin closes (the server died)."""
        try:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gpu_quota_ext.hard_limit.mps",
                    "--watch",
                    self.directory,
                    "--control",
                    self.binary,
                    "--timeout",
                    str(self.timeout),
                    "--pid",
                    str(self.daemon.pid),
                    "--start",
                    str(-1 if self.daemon.start is None else self.daemon.start),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C to the server's terminal must not stop it first
                close_fds=True,
            )
        except OSError as error:  # the daemon still stops at shutdown; only a crash would leave it
            log.warning("gpu-quota-ext: no watcher for the MPS daemon (%s)", error)
            return None

    def stop(self) -> None:
        """`quit`, then make sure the daemon and its MPS servers are gone. Idempotent, thread-safe."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        if self.daemon is not None:  # else it never came up: its launcher's process group was killed
            left = stop_daemon(self.binary, self.pipe_directory, self.daemon, self.timeout)
            if left:
                log.warning("gpu-quota-ext: MPS processes %s did not exit, even after SIGKILL", left)
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            try:
                watcher.stdin.close()  # its signal that the server stopped it already
                watcher.wait(timeout=5 * self.timeout + 2)
            except (OSError, subprocess.TimeoutExpired):
                watcher.kill()
                watcher.wait()
        _remove(self.pipe_directory, self.log_directory)
        atexit.unregister(self.stop)
        if self.daemon is not None:
            log.info("gpu-quota-ext: the MPS control daemon stopped")


def stop_daemon(binary: str, pipe_directory: str, daemon: Optional[_Tracked], timeout: float) -> List[int]:
    """Quit a daemon we started and wait for it and its servers; SIGTERM, then SIGKILL, what stays.
    Each step gets `timeout` seconds. Returns the PIDs still there after all that (normally none)."""
    try:
        listed = server_list(binary, pipe_directory, timeout)
    except MpsError:  # a broken daemon, or its pipe directory was removed under it
        listed = []
    # MPS servers are the daemon's children: found even when the daemon no longer answers.
    children = _children(daemon.pid) if daemon is not None and daemon.alive() else []
    servers = [_Tracked(pid) for pid in sorted(set(listed) | set(children))]
    try:
        run_control(binary, pipe_directory, "quit\n", timeout)
    except MpsError as error:
        log.warning("gpu-quota-ext: quitting the MPS daemon: %s", error)
    processes = ([daemon] if daemon is not None else []) + servers
    left = _wait_gone(processes, timeout)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not left:
            break
        for process in left:
            process.signal(sig)
        left = _wait_gone(left, timeout)
    return [p.pid for p in left]


def watch(directory: str, binary: str, timeout: float, pid: int, start: Optional[int]) -> None:
    """The watcher's whole life: wait for EOF on stdin (the server stopped, one way or another), then stop
    the daemon if it is still there."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, KeyboardInterrupt):
        pass
    daemon = _Tracked(pid, start)
    pipe_directory = os.path.join(directory, "pipe")
    if daemon.alive():  # else the server stopped it already
        stop_daemon(binary, pipe_directory, daemon, timeout)
    _remove(pipe_directory, os.path.join(directory, "log"), directory)


def _remove(*directories: str) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def _main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Stops a managed MPS control daemon once its server is gone.")
    parser.add_argument("--watch", required=True, help="the daemon's directory (pipe/ and log/ inside)")
    parser.add_argument("--control", required=True)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--pid", type=int, required=True, help="the daemon's PID")
    parser.add_argument("--start", type=int, default=-1, help="its start time (/proc/PID/stat field 22)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the closed pipe ends the watch
    watch(args.watch, args.control, args.timeout, args.pid, args.start)


if __name__ == "__main__":
    _main()
