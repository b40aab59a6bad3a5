"""Holding a store operation in flight, for the race cases of the store contract.

A renewal is *in flight* when the store has started it but not finished it.
Where a store serializes its operations behind a lock a test can take, the
test holds that lock from another connection, so the renewal it starts next
waits behind it, deterministically:

* PostgreSQL: a row lock on one lease row (``SELECT ... FOR UPDATE`` in an
  open transaction). A renewal batch naming that lease waits for it, after
  its statement started (and read the clock); :meth:`Gate.wait_blocked`
  proves the wait from ``pg_blocking_pids``. Other rows are not locked, so a
  release or commit of another lease goes through meanwhile.
* SQLite: the database's write lock (``BEGIN IMMEDIATE``); and the
  in-memory store's one lock, of the same shape. Every write waits for it,
  the renewal and the release alike, so the two run one after the other
  once the gate opens, in an order the test cannot choose; SQLite's
  busy wait is not observable from outside, so there is nothing to prove.

Redis (a Lua script) and etcd (a transaction) run each operation atomically:
there is no lock to hold, and :func:`gate` yields None.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from celery_lease import LeaseStore
from celery_lease.stores.sql import SQLLeaseStore
from celery_lease.testing import MemoryLeaseStore
from tests.servers import wait_for

__all__ = ["Gate", "gate"]


class Gate:
    """A lock held from another connection; operations that need it wait."""

    #: True when an operation behind the gate is seen waiting (PostgreSQL); False
    #: when the store serializes every write behind it (SQLite).
    row_level = False

    def wait_blocked(self, timeout: float = 20.0) -> None:
        """Return once an operation waits for the gate (where that is observable)."""


class _PgGate(Gate):
    row_level = True

    def __init__(self, url: str, key: str) -> None:
        self.engine = create_engine(url, poolclass=NullPool)
        self.watcher = create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
        self.conn = self.engine.connect()
        self.pid = self.conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        locked = self.conn.execute(
            text("SELECT lease_key FROM celery_lease_leases WHERE lease_key = :k FOR UPDATE"),
            {"k": key},
        ).all()
        assert len(locked) == 1, f"no lease row {key!r} to lock"

    def waiting(self) -> int:
        """Sessions waiting for this gate's lock (a transaction per read:
        pg_stat_activity is a snapshot per transaction)."""
        sql = "SELECT count(*) FROM pg_stat_activity WHERE :p = ANY(pg_blocking_pids(pid))"
        with self.watcher.connect() as w:
            return int(w.execute(text(sql), {"p": self.pid}).scalar_one())

    def wait_blocked(self, timeout: float = 20.0) -> None:
        wait_for(lambda: self.waiting() > 0, timeout, "an operation to wait on the row lock")

    def open(self) -> None:
        self.conn.rollback()
        self.conn.close()
        self.engine.dispose()
        self.watcher.dispose()


class _SqliteGate(Gate):
    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None, timeout=30.0)
        self.conn.execute("BEGIN IMMEDIATE")

    def open(self) -> None:
        self.conn.execute("ROLLBACK")
        self.conn.close()


class _MemoryGate(Gate):
    """The memory store's one lock: like SQLite's, every operation waits for it."""

    def __init__(self, store: MemoryLeaseStore) -> None:
        self.lock = store._space.lock
        self.lock.acquire()

    def open(self) -> None:
        self.lock.release()


@contextmanager
def gate(store: LeaseStore, key: str) -> Iterator[Gate | None]:
    """Hold operations on ``key``'s lease in flight for the block (None: not possible)."""
    held: _PgGate | _SqliteGate | _MemoryGate | None = None
    if isinstance(store, MemoryLeaseStore):
        held = _MemoryGate(store)
    elif isinstance(store, SQLLeaseStore):
        if store.db.is_sqlite:
            assert store.db.sqlite_path is not None
            held = _SqliteGate(store.db.sqlite_path)
        else:
            held = _PgGate(store.db.url, key)
    try:
        yield held
    finally:
        if held is not None:
            held.open()
