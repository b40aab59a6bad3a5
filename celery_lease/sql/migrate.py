"""Alembic glue: apply, undo and check celery-lease's migrations (the
``migrations/`` directory, shipped as ``celery_lease.migrations``).

Alembic is imported only to migrate or to compare a schema in full: a worker
asks the version table which revision a database is at (:func:`current`) and
compares it with :data:`HEAD`, so its processes never load Alembic.
"""

from __future__ import annotations

import fcntl
import os
from importlib import resources
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import SQLAlchemyError

from celery_lease.schema import VERSION_TABLE
from celery_lease.sql.driver import Database, database

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

__all__ = ["HEAD", "check", "current", "downgrade", "ensure_schema", "migrate", "on_first_use"]

#: The newest revision in ``migrations/versions`` (tests/unit/test_schema_head.py
#: holds the two equal).
HEAD = "0007"


def _alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(resources.files("celery_lease.migrations")))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.set_main_option("version_table", VERSION_TABLE)
    return cfg


def migrate(url: str, revision: str = "head", *, _database: Database | None = None) -> None:
    """Apply celery-lease's migrations to ``url`` (up to ``revision``).

    Safe to run from several processes at once (SQLite: a file lock; PostgreSQL:
    an advisory lock), and a no-op when already at ``revision``.
    """
    from alembic import command

    db = _database or database(url)
    cfg = _alembic_config(db.url)
    if db.is_sqlite:
        assert db.sqlite_path is not None
        os.makedirs(os.path.dirname(db.sqlite_path) or ".", exist_ok=True)
        with open(db.sqlite_path + ".migrate-lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with db.errors(), db.engine.connect() as conn:
                    cfg.attributes["connection"] = conn
                    command.upgrade(cfg, revision)
                    conn.commit()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return
    with db.errors(), db.engine.connect() as conn:
        conn.exec_driver_sql("SELECT pg_advisory_lock(7244231)")
        try:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
            conn.commit()
        except BaseException:
            # A failed step leaves the transaction aborted, where the unlock would
            # fail too and its error would replace the migration's own: roll back
            # first. Should that fail as well (the connection is gone), closing
            # the session frees its advisory lock.
            try:
                conn.rollback()
                _unlock(conn)
            except SQLAlchemyError:
                conn.invalidate()
            raise
        _unlock(conn)


def _unlock(conn: Connection) -> None:
    conn.exec_driver_sql("SELECT pg_advisory_unlock(7244231)")
    conn.commit()


def current(db: Database) -> str | None:
    """The revision ``db`` is at, or None when celery-lease's migrations never ran there."""
    from sqlalchemy import inspect, text

    with db.errors(), db.engine.connect() as conn:
        if not inspect(conn).has_table(VERSION_TABLE):
            return None
        row = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).first()
        return None if row is None else str(row[0])


def on_first_use(db: Database) -> None:
    """SQLite: have the first statement this process sends to ``db`` migrate it
    first (:func:`ensure_schema`); nothing is sent now.

    Called where a store, result table or ``lease+`` backend is made: set up
    there, a file that cannot be opened would fail the making (a worker's
    start, a pool child's first task) instead of the first statement, where
    an outage is retried and deferred."""
    if db.is_sqlite and not db._migrated:
        db.set_up = ensure_schema


def ensure_schema(db: Database) -> None:
    """SQLite only: apply the migrations on first use (the embedded default):
    called before the first connection of celery-lease's own is made.

    A database already at :data:`HEAD` is read, not migrated: Alembic stays
    unloaded in the worker's processes (another process migrating at the same
    moment leaves it behind, so this one then migrates too, under the file lock,
    which Alembic makes a no-op)."""
    if db._migrated or not db.is_sqlite:
        return
    if current(db) != HEAD:
        migrate(db.url, _database=db)
    db._migrated = True
    db.set_up = None


def downgrade(url: str, revision: str = "base") -> None:
    """Undo celery-lease's migrations down to ``revision`` (``base`` drops its tables)."""
    from alembic import command

    db = database(url)
    cfg = _alembic_config(db.url)
    with db.errors(), db.engine.connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
        if revision == "base":  # leave nothing behind, Alembic's version table included
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {VERSION_TABLE}")
        conn.commit()
    # The embedded SQLite default migrates again on its next new connection.
    db._migrated = False
    db._pool.close()
    on_first_use(db)


def check(url: str) -> None:
    """Raise if the database schema differs from :mod:`celery_lease.schema` (``alembic check``)."""
    from alembic import command

    db = database(url)
    cfg = _alembic_config(db.url)
    with db.errors(), db.engine.connect() as conn:
        cfg.attributes["connection"] = conn
        command.check(cfg)
