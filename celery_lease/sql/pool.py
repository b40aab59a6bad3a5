"""The hand-written driver layer: celery-lease's own connections to the
database, beside SQLAlchemy's pool.

The hot paths (claim, renew, release, prepare, commit) run on the driver
itself (psycopg 3, sqlite3) through :class:`Conn`, not through SQLAlchemy
Core: the benchmarks showed SQLAlchemy's execution and pool checkout cost
more per statement than the statement's round trip (BENCHMARKS.md). The
connections are still made by SQLAlchemy (same URL handling, TLS options and
connect events), then detached from its pool into :class:`_Pool`, a small
free list. On PostgreSQL the commonest hot paths (a single-key claim or
release, a colocated commit, a registration) skip even :class:`Conn`:
:meth:`_Pool.one` sends a statement already in psycopg's placeholders on the
free-list connection's own cursor and returns the plain tuple row. On
PostgreSQL, statements that must run one after the other with nothing in
between are *pipelined* (sent together, one round trip), e.g. ``BEGIN`` with
a transaction's first statement.

Nothing outside this package uses these classes directly but through
:class:`~celery_lease.sql.driver.Database`: ``transaction()``, ``single()``,
``read()`` (a :class:`Conn`) and ``pg_first()`` / ``pg_count()``.
"""

from __future__ import annotations

import os
from collections import namedtuple
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from sqlalchemy import TextClause

from celery_lease.exceptions import LeaseError
from celery_lease.sql.queries import pyformat as _pyformat

if TYPE_CHECKING:
    from celery_lease.sql.driver import Database

__all__ = ["PG_TRAFFIC", "Conn", "Rows", "count_pg_traffic"]


@lru_cache(maxsize=256)
def _row_class(names: tuple[str, ...]) -> Any:
    return namedtuple("Row", names, rename=True)


def _sqlite_row(cursor: Any, values: tuple[Any, ...]) -> Any:
    """sqlite3 rows with attribute access, like psycopg's ``namedtuple_row``."""
    return _row_class(tuple(d[0] for d in cursor.description))(*values)


#: PostgreSQL traffic of this process's hot paths (:class:`Conn`): round trips,
#: and the statements they carried (pipelining makes the two differ). Counted
#: only after :func:`count_pg_traffic` (the benchmarks call it in their
#: workers); plain counters, not locked (exact in a single thread).
PG_TRAFFIC = {"round_trips": 0, "statements": 0}
_counting = False


def count_pg_traffic(enabled: bool = True) -> None:
    """Count PostgreSQL round trips and statements in :data:`PG_TRAFFIC` from now on
    (in this process and children forked later). Off by default: production
    statements pay one flag test, not two counter updates."""
    global _counting
    _counting = enabled


class Rows:
    """A statement's rows, fetched at once (celery-lease's statements return few)."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)

    def all(self) -> list[Any]:
        return self._rows

    def first(self) -> Any:
        return self._rows[0] if self._rows else None

    def one(self) -> Any:
        if len(self._rows) != 1:
            raise LeaseError(f"expected exactly one row, the database returned {len(self._rows)}")
        return self._rows[0]

    def scalar(self) -> Any:
        return self._rows[0][0] if self._rows else None

    def scalar_one(self) -> Any:
        return self.one()[0]


class Conn:
    """A driver connection checked out for one statement or one transaction.

    Offers the small part of SQLAlchemy's ``Connection`` that celery-lease
    uses: :meth:`execute` with ``:name`` parameters (a string or a
    ``text()``), :meth:`exec_driver_sql` and :meth:`rollback`, plus
    :meth:`pipeline`.

    A connection taken from the free list may have died with its server (a
    restart): if the first statement on it fails because the connection is
    gone, it is replaced and the statement sent again, once. Nothing ran on
    the dead session, and every operation of the stores is idempotent anyway.
    """

    __slots__ = ("cursor", "db", "in_transaction", "pending_begin", "raw", "reused", "transaction")

    def __init__(self, db: Database, raw: Any, cursor: Any, reused: bool, *, transaction: bool):
        self.db = db
        self.raw = raw
        self.cursor = cursor  # PostgreSQL: the connection's own, reused
        self.reused = reused
        self.transaction = transaction
        # PostgreSQL: BEGIN is sent with the transaction's first statement.
        self.pending_begin = transaction and not db.is_sqlite
        self.in_transaction = False

    def __enter__(self) -> Conn:
        entered = False
        try:
            if self.transaction and self.db.is_sqlite:
                self.begin()
            entered = True
        except self.db.driver_error as e:
            raise self.db.translate(e) from e
        finally:
            if not entered:
                self._check_in()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if exc is None:
                self.end(commit=True)
        except self.db.driver_error as e:
            raise self.db.translate(e) from e
        finally:
            self._check_in()
        if isinstance(exc, self.db.driver_error):
            raise self.db.translate(exc) from exc

    def _check_in(self) -> None:
        self.end(commit=False)  # still open: an exception ended the block
        self.db._pool.put(self)

    # -- the SQLAlchemy-like surface ------------------------------------------

    def execute(self, sql: str | TextClause, params: Mapping[str, Any] | None = None) -> Rows:
        if isinstance(sql, TextClause):
            sql = sql.text
        return self._run([(sql, params)])[0]

    def exec_driver_sql(self, sql: str) -> Rows:
        return self._run([(sql, None)])[0]

    def pipeline(self, *statements: tuple[str, Mapping[str, Any] | None]) -> list[Rows]:
        """Run statements one after the other, in one round trip on PostgreSQL.

        The server runs each only after the previous one finished (so each
        reads a snapshot taken after its predecessor's lock waits), as if
        they were sent one by one; outside a transaction they share one
        implicit transaction, ended right after the last.
        """
        return self._run(list(statements))

    def commit_after(self, sql: str, params: Mapping[str, Any] | None = None) -> Rows:
        """Run the transaction's last statement and COMMIT with it (one round trip)."""
        rows = self._run([(sql, params), ("COMMIT", None)])[0]
        self.in_transaction = False
        return rows

    def now(self) -> float:
        """The database's clock, in epoch seconds."""
        return float(self._run([(self.db.sql.select_now, None)])[0].scalar_one())

    def rollback(self) -> None:
        """End the transaction now, undoing it; the block's end then does nothing."""
        if self.in_transaction and self.raw is not None:
            self.in_transaction = False
            self._send([("ROLLBACK", None)])

    # -- transaction edges (used by Database._checkout) ----------------------

    def begin(self) -> None:
        """SQLite: take the write lock now (waits up to busy_timeout)."""
        self._run([("BEGIN IMMEDIATE", None)])

    def end(self, *, commit: bool) -> None:
        if self.raw is None:  # discarded: the server ended the transaction with the session
            self.in_transaction = False
        if not self.in_transaction:
            return
        if commit:
            self.in_transaction = False
            self._run([("COMMIT", None)])
            return
        self.in_transaction = False
        try:
            self._send([("ROLLBACK", None)])
        except self.db.driver_error:
            self.discard()  # the connection is no use; the error that ended the block wins

    def discard(self) -> None:
        """Never hand this connection out again."""
        self.reused = False
        if self.raw is not None:
            _close_quietly(self.raw, self.db.driver_error)
            self.raw = self.cursor = None

    # -- running -------------------------------------------------------------

    def _run(self, statements: list[tuple[str, Mapping[str, Any] | None]]) -> list[Rows]:
        if self.pending_begin:
            statements = [("BEGIN", None), *statements]
        if statements[0][0] in ("BEGIN", "BEGIN IMMEDIATE"):
            self.in_transaction = True  # even if the rest fails: the block's end rolls back
        try:
            out = self._send(statements)
        except self.db.driver_error:
            if not (self.reused and self.db.is_gone(self.raw)):
                if self.db.is_gone(self.raw):
                    self.discard()
                raise
            # A stale connection from the free list: replace it, send again once.
            self.discard()
            self.raw, self.cursor = self.db._pool.connect()
            out = self._send(statements)
        self.reused = False
        if self.pending_begin:
            self.pending_begin = False
            out = out[1:]
        return out

    def _send(self, statements: list[tuple[str, Mapping[str, Any] | None]]) -> list[Rows]:
        raw = self.raw
        if self.db.is_sqlite:
            out = []
            for sql, params in statements:
                cur = raw.execute(sql, params or ())
                out.append(Rows(cur.fetchall(), cur.rowcount))
            return out
        if _counting:
            PG_TRAFFIC["round_trips"] += 1
            PG_TRAFFIC["statements"] += len(statements)
        if len(statements) == 1:
            sql, params = statements[0]
            cur = self.cursor
            cur.execute(sql if params is None else _pyformat(sql), params)
            rows = cur.fetchall() if cur.description else []
            if rows:  # the cursor makes plain tuples: name them as pipelined rows are
                make = self.db.pg_row_factory(cur)
                rows = [make(r) for r in rows]
            return [Rows(rows, cur.rowcount)]
        # Several statements, one round trip: psycopg's pipeline mode, which keeps
        # each statement prepared (one simple-protocol query of all of them would
        # be parsed and planned by the server at every call).
        cursors = []
        with raw.pipeline():
            for sql, params in statements:
                cur = raw.cursor(row_factory=self.db.pg_row_factory)
                cur.execute(sql if params is None else _pyformat(sql), params)
                cursors.append(cur)
        return [Rows(c.fetchall() if c.description else [], c.rowcount) for c in cursors]


def _close_quietly(raw: Any, driver_error: type[BaseException]) -> None:
    try:
        raw.close()
    except driver_error:
        pass  # already broken: nothing left to close


#: Connections a forked child inherited: never closed or finalized there
#: (closing would end the parent's sessions), only kept from the collector.
_ORPHANS: list[Any] = []


class _Pool:
    """This process's idle driver connections for one database (a free list)."""

    MAX_IDLE = 8

    def __init__(self, db: Database) -> None:
        self.db = db
        self.idle: list[Any] = []
        self.pid = os.getpid()

    def get(self) -> tuple[Any, Any, bool]:
        """``(connection, its cursor, taken from the free list)``."""
        if self.pid != os.getpid():
            self.forget()
        try:
            raw, cursor = self.idle.pop()
        except IndexError:
            return (*self.connect(), False)
        return raw, cursor, True

    def connect(self) -> tuple[Any, Any]:
        """A new connection, made by SQLAlchemy (URL, TLS, connect events), then detached."""
        set_up = self.db.set_up
        if set_up is not None:
            set_up(self.db)
        with self.db.errors():
            fairy = self.db.engine.raw_connection()
        fairy.detach()  # ours from now on: SQLAlchemy neither pools nor finalizes it
        raw: Any = fairy.dbapi_connection
        if self.db.is_sqlite:
            raw.row_factory = _sqlite_row
            return raw, None
        raw.autocommit = True
        # Plain tuple rows: the hot paths (Database.pg_first) unpack them as they
        # are; Conn makes named tuples of the rows of the statements it runs.
        return raw, raw.cursor(row_factory=self.db.pg_tuple_row)

    def one(self, sql: str, params: Mapping[str, Any], first: bool) -> Any:
        """PostgreSQL only: one autocommit statement in psycopg's form (see
        ``Database.pg_first``); its first row (``first``) or its row count."""
        pool, db = self, self.db
        pid = os.getpid()  # _Pool.get inlined: one getpid for the checkout and the return
        if pool.pid != pid:
            pool.forget()
        try:
            raw, cur = pool.idle.pop()
            reused = True
        except IndexError:
            raw, cur = pool.connect()
            reused = False
        done = False
        try:
            try:
                if _counting:
                    PG_TRAFFIC["round_trips"] += 1
                    PG_TRAFFIC["statements"] += 1
                cur.execute(sql, params)
            except db.driver_error:
                if not (reused and db.is_gone(raw)):
                    raise
                # A stale connection from the free list: replace it, send again once.
                _close_quietly(raw, db.driver_error)
                raw = cur = None
                raw, cur = pool.connect()
                if _counting:
                    PG_TRAFFIC["round_trips"] += 1
                    PG_TRAFFIC["statements"] += 1
                cur.execute(sql, params)
            # RETURNING rows: rowcount is their number, so nothing is fetched to count them.
            out = cur.fetchone() if first else cur.rowcount
            done = True
        except db.driver_error as e:
            raise db.translate(e) from e
        finally:
            if not done:  # an error or an interruption: keep the session only if it is sound
                pool.put_raw(raw, cur)
        # The statement ran and returned: the session is alive and idle (autocommit).
        if pool.pid == pid and len(pool.idle) < pool.MAX_IDLE:
            pool.idle.append((raw, cur))
        else:
            _close_quietly(raw, db.driver_error)
        return out

    def put(self, conn: Conn) -> None:
        if conn.raw is None:
            return
        if conn.in_transaction or self.db.is_gone(conn.raw) or self.db.in_transaction(conn.raw):
            conn.discard()  # never hand out a session in an unknown state
        elif self.pid == os.getpid() and len(self.idle) < self.MAX_IDLE:
            self.idle.append((conn.raw, conn.cursor))
        else:
            conn.discard()

    def put_raw(self, raw: Any, cursor: Any) -> None:
        """:meth:`put` for a connection used without a :class:`Conn` (autocommit)."""
        if raw is None:
            return
        db = self.db
        if db.is_gone(raw) or db.in_transaction(raw):
            _close_quietly(raw, db.driver_error)  # never hand out a session in an unknown state
        elif self.pid == os.getpid() and len(self.idle) < self.MAX_IDLE:
            self.idle.append((raw, cursor))
        else:
            _close_quietly(raw, db.driver_error)

    def forget(self) -> None:
        """In a forked child: drop the parent's connections without touching them."""
        _ORPHANS.extend(self.idle)
        self.idle = []
        self.pid = os.getpid()

    def close(self) -> None:
        idle, self.idle = self.idle, []
        for raw, _ in idle:
            _close_quietly(raw, self.db.driver_error)
