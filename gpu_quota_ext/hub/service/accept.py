"""Accepting connections when file descriptors run out, and asking for more of them at start.

tornado's accept handler lets EMFILE/ENFILE ("Too many open files") out of the event loop's callback: asyncio logs
a traceback and, the listening socket still being readable, calls it again at once, so a flood of connections
turned into a traceback per attempt (96,058 in 48 s under systemd's default LimitNOFILE=1024) and a loop busy
logging them. Here the listening socket is set aside for a short pause instead (the connections wait in its
backlog, as they would for a busy service), and `on_exhausted` says so (guard.py: one line per offender, once a
minute). The open connections finish meanwhile and give their descriptors back.
"""

from __future__ import annotations

import errno
import logging
import resource
import socket
from typing import Any, Callable, Iterable, Optional

from tornado.httpserver import HTTPServer
from tornado.ioloop import IOLoop

log = logging.getLogger("gpu_quota_ext")

PAUSE = 0.25  # seconds the listening socket is set aside when no descriptor is left
BATCH = 128  # connections accepted per readiness, as tornado does: others' callbacks run between batches
WANTED_DESCRIPTORS = 65536  # the soft limit asked for at start, within the hard limit


def descriptor_limit() -> Optional[int]:
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def raise_descriptor_limit(wanted: int = WANTED_DESCRIPTORS) -> Optional[int]:
    """Raise the soft limit on open files towards `wanted`, within the hard limit (what systemd's LimitNOFILE or
    the hub's own limits allow); the limit now in force."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as error:
        log.warning("gpu-quota service: could not raise its limit on open files: %s", error)
    return descriptor_limit()


def guarded_accept(
    sock: socket.socket, callback: Callable[[socket.socket, Any], None], on_exhausted: Callable[[], None]
) -> Callable[[], None]:
    """tornado.netutil.add_accept_handler, pausing instead of raising when no descriptor is left."""
    io_loop = IOLoop.current()
    state = {"removed": False, "paused": False}

    def resume() -> None:
        if state["paused"] and not state["removed"]:
            state["paused"] = False
            io_loop.add_handler(sock, accept, IOLoop.READ)

    def accept(fd: Any, events: int) -> None:
        for _ in range(BATCH):
            if state["removed"] or state["paused"]:
                return
            try:
                connection, address = sock.accept()
            except BlockingIOError:
                return
            except ConnectionAbortedError:
                continue
            except OSError as error:
                if error.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                state["paused"] = True
                io_loop.remove_handler(sock)
                io_loop.call_later(PAUSE, resume)
                on_exhausted()
                return
            callback(connection, address)

    def remove() -> None:
        if not state["paused"]:
            io_loop.remove_handler(sock)
        state["removed"] = True

    io_loop.add_handler(sock, accept, IOLoop.READ)
    return remove


class GuardedHTTPServer(HTTPServer):
    """An HTTPServer whose listening sockets pause, not fail, when descriptors run out (`on_exhausted` told)."""

    def initialize(self, *args: Any, on_exhausted: Callable[[], None] = lambda: None, **kwargs: Any) -> None:
        self._on_exhausted = on_exhausted
        super().initialize(*args, **kwargs)

    def add_sockets(self, sockets: Iterable[socket.socket]) -> None:
        for sock in sockets:
            self._sockets[sock.fileno()] = sock
            self._handlers[sock.fileno()] = guarded_accept(sock, self._handle_connection, self._on_exhausted)
