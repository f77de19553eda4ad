"""The host service's record on disk: grants, servers' leases and the broker's reservations in SQLite (WAL), all
its SQL here.

The book (book.py) writes every change through this store before it answers, so a restart of the
service (the hub restarts it with itself) finds every grant it gave. The database lives in the service's
state directory, which only the service's Unix user may enter (0700): a user's kernel ids and the
servers' names are nobody else's business. No secret is ever written here (no token, no header).

WAL: readers never block the writer; `synchronous=NORMAL` in WAL mode loses nothing when the service's
process dies (only an OS crash can lose the last commits, and leases re-register the kernels then).
One connection; the book holds its lock around every write, so calls never overlap.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
from typing import List, Mapping, Sequence, Tuple

from ...devices import Device
from .book import Lease, Owned, grant_from_record, grant_to_record
from .room import Held

log = logging.getLogger("gpu_quota_ext")

DB_NAME = "host-ledger.sqlite"
SCHEMA_VERSION = "1"
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS grants (
    kernel_id TEXT PRIMARY KEY,
    user TEXT NOT NULL,
    server TEXT NOT NULL,
    granted_at REAL NOT NULL,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS reservations (
    kernel_id TEXT PRIMARY KEY,
    user TEXT NOT NULL,
    server TEXT NOT NULL,
    held TEXT NOT NULL,
    since REAL NOT NULL,
    until REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
    user TEXT NOT NULL,
    server TEXT NOT NULL,
    expires REAL NOT NULL,
    kernels TEXT NOT NULL,
    PRIMARY KEY (user, server)
);
"""


class StateDirError(Exception):
    """The state directory cannot be made private to the service's user."""


def private_dir(path: str) -> str:
    """Create `path` (0700) or check it: owned by this user; group/other bits are taken away (said)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_uid != os.geteuid():
        raise StateDirError(
            f"the state directory {path} belongs to uid {info.st_uid}, not to the service's user ({os.geteuid()})"
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        log.warning("gpu-quota service: state directory %s was mode %o; set to 0700", path, stat.S_IMODE(info.st_mode))
        os.chmod(path, 0o700)
    return path


class Store:
    """Implements book.Journal on SQLite."""

    def __init__(self, state_dir: str, devices: Sequence[Device]):
        self.path = os.path.join(private_dir(state_dir), DB_NAME)
        self._devices = {d.index: d for d in devices}
        self._by_uuid = {d.uuid: d for d in devices}
        old = os.umask(0o077)  # the database and its -wal / -shm files: this user's only
        try:
            self.db = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False
            )  # autocommit; the book's lock serializes
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA busy_timeout=2000")
            self.db.executescript(SCHEMA)
        finally:
            os.umask(old)
        self.db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('schema', ?)", (SCHEMA_VERSION,))

    def journal_mode(self) -> str:
        return self.db.execute("PRAGMA journal_mode").fetchone()[0]

    def close(self) -> None:
        self.db.close()

    # --- book.Journal ------------------------------------------------------------------------

    def save_grant(self, owned: Owned) -> None:
        record = json.dumps(grant_to_record(owned.grant, self._devices))
        self.db.execute(
            "INSERT OR REPLACE INTO grants (kernel_id, user, server, granted_at, record) VALUES (?, ?, ?, ?, ?)",
            (owned.grant.kernel_id, owned.grant.user, owned.server, owned.granted_at, record),
        )

    def delete_grants(self, kernel_ids: Sequence[str]) -> None:
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany("DELETE FROM grants WHERE kernel_id = ?", [(k,) for k in kernel_ids])

    def save_lease(self, lease: Lease) -> None:
        kernels = json.dumps({k: list(p) for k, p in lease.kernels.items()})
        self.db.execute(
            "INSERT OR REPLACE INTO leases (user, server, expires, kernels) VALUES (?, ?, ?, ?)",
            (lease.user, lease.server, lease.expires, kernels),
        )

    def delete_lease(self, user: str, server: str) -> None:
        self.db.execute("DELETE FROM leases WHERE user = ? AND server = ?", (user, server))

    # --- the broker's reservations (room.HostRoom) --------------------------------------------

    def save_reservations(self, held: Sequence[Held]) -> None:
        """Every reservation now, in one transaction, before the "go" that made one is answered: a restart of the
        service (the hub restarts it) must not give the room of a restore in flight to another kernel."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM reservations")
            self.db.executemany(
                "INSERT INTO reservations (kernel_id, user, server, held, since, until) VALUES (?, ?, ?, ?, ?, ?)",
                [(h.kernel_id, h.user, h.server, json.dumps(dict(h.held)), h.since, h.until) for h in held],
            )

    def load_reservations(self) -> List[Held]:
        """The reservations on disk, on this host's devices (bytes on a device gone since are dropped)."""
        rows = self.db.execute("SELECT kernel_id, user, server, held, since, until FROM reservations")
        kept = []
        for kernel_id, user, server, held, since, until in rows:
            on_host = {uuid: int(n) for uuid, n in json.loads(held).items() if uuid in self._by_uuid and int(n) > 0}
            if on_host:
                kept.append(Held(kernel_id, user, server, on_host, since, until))
        return kept

    # --- restart -----------------------------------------------------------------------------

    def load(self) -> Tuple[List[Owned], List[Lease]]:
        """Every grant and lease on disk, on this host's devices (a grant's devices gone since are dropped)."""
        owned = []
        for _user, server, granted_at, record in self.db.execute("SELECT user, server, granted_at, record FROM grants"):
            grant, gone = grant_from_record(json.loads(record), self._by_uuid)
            if gone:
                log.warning("gpu-quota service: kernel %s's devices %s are gone from this host", grant.kernel_id, gone)
            owned.append(Owned(grant, server, granted_at))
        leases = [
            Lease(user, server, expires, {k: tuple(p) for k, p in json.loads(kernels).items()})
            for user, server, expires, kernels in self.db.execute("SELECT user, server, expires, kernels FROM leases")
        ]
        return owned, leases

    def counts(self) -> Mapping[str, int]:
        return {
            table: self.db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]  # noqa: S608 (fixed names)
            for table in ("grants", "leases", "reservations")
        }
