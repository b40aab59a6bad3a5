"""Connections: one :class:`Database` per URL and process.

A :class:`Database` holds the SQLAlchemy engine (URL handling, TLS options,
connect events, migrations, the CLI), the dialect's statements
(:attr:`Database.sql`) and the interface to the hand-written driver layer of
:mod:`celery_lease.sql.pool`: :meth:`Database.transaction`,
:meth:`Database.single`, :meth:`Database.read` and, for the PostgreSQL hot
paths, :meth:`Database.pg_first` / :meth:`Database.pg_count`.

PostgreSQL runs single statements in autocommit (one round trip each) and
multi-statement work in READ COMMITTED transactions. SQLite runs everything
in ``BEGIN IMMEDIATE`` transactions (one writer at a time, WAL journal), so
its operations serialize without row locks.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, exc
from sqlalchemy.engine import make_url

from celery_lease.exceptions import LeaseConfigError, LeaseError
from celery_lease.sql.dialects import DIALECTS
from celery_lease.sql.errors import translate_error
from celery_lease.sql.pool import Conn, _Pool
from celery_lease.urls import parse_sql_url, redact_url

__all__ = ["Database", "database", "normalize_sql_url"]


def normalize_sql_url(url: str) -> str:
    """One spelling per database: ``postgresql://``/``postgres://`` map to the
    psycopg 3 driver; an SQLite file's path is made absolute, symbolic links
    resolved.

    :func:`database` keys its one :class:`Database` per process by this form.
    Two spellings of one SQLite file (``sqlite:///proj.db`` and the absolute
    path) must share it: as two, the lease store and the result table would
    look like two databases, and a commit holding the file's write lock would
    wait on its own release over the other connection until the busy timeout,
    on every attempt.
    """
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            return "postgresql+psycopg://" + url[len(plain) :]
    if url.startswith("sqlite"):
        try:
            parsed = make_url(url)
        except (exc.ArgumentError, ValueError):
            return url  # Database() says what is wrong with it
        if parsed.drivername == "sqlite+pysqlite":  # SQLAlchemy's default SQLite driver
            parsed = parsed.set(drivername="sqlite")
        if parsed.database not in (None, "", ":memory:"):
            parsed = parsed.set(database=os.path.realpath(parsed.database))
        return parsed.render_as_string(hide_password=False)
    return url


#: How long an SQLite statement waits for another connection's lock (ms).
SQLITE_BUSY_TIMEOUT_MS = 30000

# create_engine's options by dialect (is_sqlite); the caller's engine_options win.
_ENGINE_OPTIONS: dict[bool, dict[str, Any]] = {
    True: {
        "future": True,
        "connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False},
    },
    False: {
        "future": True,
        "connect_args": {
            "connect_timeout": 5,
            # A peer gone without a word (a dead host, a NAT or firewall dropping
            # the flow) leaves a connection half-open; psycopg has no read
            # timeout, so a call on it waits until the kernel gives up (~15 min).
            # Unacknowledged data ends it after 15 s, an idle one is probed
            # after 10 s and dropped 15 s later. A slow server still acknowledges.
            "keepalives": 1,
            "keepalives_idle": 10,
            "keepalives_interval": 5,
            "keepalives_count": 3,
            "tcp_user_timeout": 15_000,  # ms
        },
        "pool_size": 5,
        "max_overflow": 20,
    },
}


def _sqlite_path(database: str | None) -> str:
    if database in (None, "", ":memory:"):
        raise LeaseConfigError(
            "an SQLite lease store needs a file shared by all processes: sqlite:///path "
            "(for tests: celery_lease.testing, memory:// leases and a temporary file)"
        )
    return os.path.abspath(database)


class Database:
    """An engine for one URL in this process, with the dialect's details."""

    def __init__(self, url: str, **engine_options: Any) -> None:
        self.url = normalize_sql_url(url)
        parsed = parse_sql_url("database URL", self.url)
        self.dialect = parsed.get_backend_name()
        if self.dialect not in DIALECTS:
            raise LeaseConfigError(
                f"unsupported database {self.dialect!r} in {redact_url(url)!r}: use "
                "postgresql+psycopg://... or sqlite:///..."
            )
        #: This dialect's statements (celery_lease.sql.dialects.Dialect).
        self.sql = DIALECTS[self.dialect]
        self.is_sqlite = self.dialect == "sqlite"
        #: The SQLite database file, None on PostgreSQL.
        self.sqlite_path: str | None = _sqlite_path(parsed.database) if self.is_sqlite else None
        options = {**_ENGINE_OPTIONS[self.is_sqlite], **engine_options}
        self.engine: Engine = create_engine(self.url, **options)
        if self.is_sqlite:
            _sqlite_listeners(self.engine)
            self.single_engine: Engine = self.engine
        else:
            self.single_engine = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        dbapi = self.engine.dialect.loaded_dbapi
        #: The driver's own errors (the hot paths run on the driver, see Conn).
        self.driver_error: type[BaseException] = dbapi.Error
        #: Those that mean "unavailable, retry later" rather than "wrong".
        self.driver_unavailable: tuple[type[BaseException], ...] = (
            dbapi.OperationalError,
            dbapi.InterfaceError,
        )
        if self.is_sqlite:
            self.pg_row_factory: Any = None
            self.pg_tuple_row: Any = None
        else:
            from psycopg.rows import namedtuple_row, tuple_row

            self.pg_row_factory = namedtuple_row  # rows with attribute access (Conn)
            self.pg_tuple_row = tuple_row  # the free list's cursors: plain tuples
        self._pool = _Pool(self)
        self._migrated = False  # set by celery_lease.sql.migrate.ensure_schema
        #: Run before each new connection of celery-lease's own while set: an
        #: SQLite file's migration on first use (celery_lease.sql.migrate.on_first_use).
        self.set_up: Callable[[Database], None] | None = None
        _after_fork_dispose(self)

    def in_transaction(self, raw: Any) -> bool:
        """True when a driver connection is inside a transaction (or an aborted one)."""
        if self.is_sqlite:
            return bool(raw.in_transaction)
        return bool(raw.pgconn.transaction_status)  # psycopg.pq.TransactionStatus.IDLE is 0

    def is_gone(self, raw: Any) -> bool:
        """True when a driver connection can no longer be used (its server went away)."""
        return raw is None or (not self.is_sqlite and (raw.closed or raw.broken))

    # -- running statements ------------------------------------------------

    def transaction(self) -> Conn:
        """``with db.transaction() as conn``: a short transaction (``BEGIN IMMEDIATE``
        on SQLite), committed at the block's end, rolled back on an exception;
        driver errors translated."""
        return Conn(self, *self._pool.get(), transaction=True)

    def single(self) -> Conn:
        """``with db.single() as conn``: for one statement, autocommit on PostgreSQL
        (one round trip).

        SQLite runs it in a ``BEGIN IMMEDIATE`` transaction: a lone write
        statement in WAL mode could otherwise fail at once (SQLITE_BUSY_SNAPSHOT)
        instead of waiting its turn.
        """
        return Conn(self, *self._pool.get(), transaction=self.is_sqlite)

    def read(self) -> Conn:
        """``with db.read() as conn``: one read-only statement, autocommit on both.

        On SQLite it takes no write lock, so it never waits for a writer (WAL):
        ``fencing.guard`` asks the store from inside the caller's own write
        transaction, which may be on this very file.
        """
        return Conn(self, *self._pool.get(), transaction=False)

    # -- the PostgreSQL hot path ---------------------------------------------

    def pg_first(self, sql: str, params: Mapping[str, Any]) -> Any:
        """PostgreSQL only: one autocommit statement (``sql`` already in psycopg's
        ``%(name)s`` form, e.g. ``queries.PG_CLAIM_ONE_PY``); its first row, or None.

        What ``with db.single() as conn: conn.execute(sql, params).first()``
        does (a connection from the free list, a stale one replaced and the
        statement sent again once, driver errors translated), without the
        :class:`Conn` and :class:`Rows` layers around one statement.
        """
        return self._pool.one(sql, params, True)

    def pg_count(self, sql: str, params: Mapping[str, Any]) -> int:
        """Like :meth:`pg_first`; the number of rows the statement returned."""
        return self._pool.one(sql, params, False)  # type: ignore[no-any-return]

    def translate(self, e: BaseException) -> LeaseError:
        """celery-lease's error for a driver (or SQLAlchemy) error."""
        return translate_error(e, self.url, self.driver_unavailable)

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Translate driver errors into celery-lease's (the one place that does)."""
        try:
            yield
        except (exc.DBAPIError, self.driver_error) as e:
            raise self.translate(e) from e

    def dispose(self) -> None:
        self._pool.close()
        self.engine.dispose()

    def now(self) -> float:
        """The database's clock, in epoch seconds."""
        with self.single() as conn:
            return conn.now()


def _sqlite_listeners(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, connection_record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            _journal_mode_wal(cursor)
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _journal_mode_wal(cursor: Any) -> None:
    """Switch the file to the WAL journal (it stays so: a no-op once done).

    Processes that open a new file at the same moment (a worker's pool
    children on their first task) all switch it, and SQLite answers all but
    one "database is locked" at once, without waiting out the busy timeout:
    the switch takes the file's exclusive lock while the statement holds a
    shared one, and SQLite does not wait where waiting could deadlock. The
    switch is over in milliseconds, so try again, within the busy timeout.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    delay = 0.005
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


_databases: dict[str, Database] = {}
_databases_lock = threading.Lock()


def database(url: str) -> Database:
    """The process-wide :class:`Database` for ``url`` (shared by store, results, fencing)."""
    key = normalize_sql_url(url)
    with _databases_lock:
        db = _databases.get(key)
        if db is None:
            db = _databases[key] = Database(key)
        return db


def _after_fork_dispose(db: Database) -> None:
    """Never share pooled connections across fork: the child starts a fresh pool."""
    ref = weakref.ref(db)

    def _reset() -> None:
        d = ref()
        if d is not None:
            d.engine.dispose(close=False)
            d._pool.forget()

    os.register_at_fork(after_in_child=_reset)
