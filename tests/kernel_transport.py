"""How the tests' kernels and servers get their sockets without racing other processes for a port.

A TCP kernel's five ports are picked by jupyter_client (a socket bound to port 0, its port read, the socket
closed) and bound again by the kernel a second or more later: on a busy machine another process can take
one in between, and the kernel dies with "Address already in use". So every kernel a test starts talks
ZMQ over IPC: Unix sockets named after its connection file (`kernel-<id>-ipc-<n>` next to
`kernel-<id>.json`), unique to that kernel, so there is nothing to race for. A Unix socket's path is at
most 107 bytes, and pytest's own temporary paths come close to that: the folder that holds connection
files (a server's runtime directory) is a short one under /tmp.

A server's HTTP port: pytest-jupyter's in-process server listens on a socket its fixture bound and holds
(bind-and-hold). A server in a process of its own is given `--port=0`: jupyter_server binds port 0 and reads
the port back (tests read it from its log); see servers.Server for the one window left there.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional, Union

# sun_path is 108 bytes, its terminating NUL included.
SOCKET_PATH_LIMIT = 107
# What jupyter_client puts after the connection folder: `kernel-<uuid>-ipc-<n>` (n counts from 1 for each
# of the five channels, so two digits are plenty).
LONGEST_SOCKET_NAME = len("/kernel-00000000-0000-0000-0000-000000000000-ipc-99")

TRANSPORT_SETTINGS = {"KernelManager": {"transport": "ipc"}}
TRANSPORT_ARGS = ("--KernelManager.transport=ipc",)


def short_directory(parent: Optional[Union[str, Path]] = None, prefix: str = "gq") -> Path:
    """A new folder whose path leaves room for a kernel's IPC socket names (under /tmp unless `parent`)."""
    if parent is None:
        parent = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    return check_connection_dir(tempfile.mkdtemp(prefix=prefix, dir=str(parent)))


def check_connection_dir(directory: Union[str, Path]) -> Path:
    """`directory`, if IPC sockets named after connection files in it fit a Unix socket's path; fails if not,
    naming the path, rather than letting a kernel die at its first bind."""
    longest = len(os.fsencode(str(directory))) + LONGEST_SOCKET_NAME
    if longest > SOCKET_PATH_LIMIT:
        raise ValueError(
            f"{directory}: a kernel's IPC socket under it would be {longest} bytes long, over the {SOCKET_PATH_LIMIT}"
            " of a Unix socket's path: give the server a shorter runtime directory (kernel_transport.short_directory)"
        )
    return Path(directory)
