"""SQL plumbing shared by the SQL lease store, the fenced result table and fencing.

One :class:`Database` per URL and process: an SQLAlchemy engine, the
dialect's clock, driver errors translated in one place (:meth:`Database.errors`),
and every SQL statement celery-lease runs, as named constants below, so the
queries can be read (and reviewed for locking order) in one file.

Locking order, the same everywhere, so no two operations deadlock:
fence row (``celery_lease_fences``) first, then the lease row.

PostgreSQL runs single statements in autocommit (one round trip each) and
multi-statement work in READ COMMITTED transactions. SQLite runs everything
in ``BEGIN IMMEDIATE`` transactions (one writer at a time, WAL journal), so
its operations serialize without row locks.
"""

from __future__ import annotations

import fcntl
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from importlib import resources
from typing import Any

from sqlalchemy import Connection, Engine, TextClause, create_engine, event, exc, text
from sqlalchemy.engine import make_url

from celery_lease.exceptions import LeaseConfigError, LeaseError, StoreUnavailable
from celery_lease.schema import VERSION_TABLE

__all__ = ["Database", "database", "migrate", "normalize_sql_url"]


def normalize_sql_url(url: str) -> str:
    """Map ``postgresql://``/``postgres://`` to the psycopg 3 driver; keep others as given."""
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            return "postgresql+psycopg://" + url[len(plain) :]
    return url


# ---------------------------------------------------------------------------
# Clocks: the database's own, in epoch seconds.

NOW = {
    "postgresql": "extract(epoch FROM clock_timestamp())::double precision",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}

# ---------------------------------------------------------------------------
# Lease statements. Parameters are always bound, never formatted in.

#: PostgreSQL, one key, one statement: lock the key's fence row (if any), insert
#: or take over an expired/free lease row with a token larger than both the
#: row's and the fence's, and register that token in the fence row.
PG_CLAIM_ONE = f"""
WITH f AS (
    SELECT fencing_token FROM celery_lease_fences WHERE resource = :key FOR UPDATE
), t AS (
    SELECT {NOW["postgresql"]} AS now
), granted AS (
    INSERT INTO celery_lease_leases AS l
        (lease_key, owner_id, fencing_token, ttl, expires_at, acquired_at, renewed_at,
         task_id, task_name, root_id, tenant)
    SELECT :key, :owner_id, COALESCE((SELECT fencing_token FROM f), 0) + 1, :ttl,
           t.now + :ttl, t.now, t.now, :task_id, :task_name, :root_id, :tenant
    FROM t
    ON CONFLICT (lease_key) DO UPDATE SET
        owner_id = EXCLUDED.owner_id,
        fencing_token = GREATEST(l.fencing_token + 1, EXCLUDED.fencing_token),
        ttl = EXCLUDED.ttl,
        expires_at = EXCLUDED.expires_at,
        acquired_at = EXCLUDED.acquired_at,
        renewed_at = EXCLUDED.renewed_at,
        task_id = EXCLUDED.task_id,
        task_name = EXCLUDED.task_name,
        root_id = EXCLUDED.root_id,
        tenant = EXCLUDED.tenant
    WHERE l.owner_id IS NULL OR l.expires_at <= EXCLUDED.acquired_at
        OR l.owner_id = EXCLUDED.owner_id
    RETURNING l.lease_key, l.fencing_token, l.expires_at, l.acquired_at
), fenced AS (
    INSERT INTO celery_lease_fences AS fe (resource, fencing_token, updated_at)
    SELECT lease_key, fencing_token, acquired_at FROM granted
    ON CONFLICT (resource) DO UPDATE SET
        fencing_token = GREATEST(fe.fencing_token, EXCLUDED.fencing_token),
        updated_at = EXCLUDED.updated_at
)
SELECT fencing_token, expires_at, acquired_at FROM granted
"""

#: Several keys (and every SQLite claim), in one transaction: make the fence
#: rows exist, lock them in key order (PostgreSQL), then read the lease rows.
PG_ENSURE_FENCES = f"""
INSERT INTO celery_lease_fences (resource, fencing_token, updated_at)
SELECT k, 0, {NOW["postgresql"]} FROM unnest(CAST(:keys AS text[])) AS k ORDER BY k
ON CONFLICT (resource) DO NOTHING
"""
PG_LOCK_FENCES = """
SELECT resource, fencing_token FROM celery_lease_fences
WHERE resource = ANY(CAST(:keys AS text[])) ORDER BY resource FOR UPDATE
"""
SELECT_FENCES_IN = """
SELECT resource, fencing_token FROM celery_lease_fences WHERE resource IN ({keys})
"""
SELECT_LEASES_IN = """
SELECT lease_key, owner_id, fencing_token, expires_at FROM celery_lease_leases
WHERE lease_key IN ({keys})
"""
#: Conditional: a row some other claimer made live meanwhile is left alone,
#: and the caller compares the returned row count with the number of keys.
UPSERT_LEASE = """
INSERT INTO celery_lease_leases AS l
    (lease_key, owner_id, fencing_token, ttl, expires_at, acquired_at, renewed_at,
     task_id, task_name, root_id, tenant)
VALUES (:key, :owner_id, :token, :ttl, :now + :ttl, :now, :now,
        :task_id, :task_name, :root_id, :tenant)
ON CONFLICT (lease_key) DO UPDATE SET
    owner_id = excluded.owner_id,
    fencing_token = excluded.fencing_token,
    ttl = excluded.ttl,
    expires_at = excluded.expires_at,
    acquired_at = excluded.acquired_at,
    renewed_at = excluded.renewed_at,
    task_id = excluded.task_id,
    task_name = excluded.task_name,
    root_id = excluded.root_id,
    tenant = excluded.tenant
WHERE (l.owner_id IS NULL OR l.expires_at <= :now OR l.owner_id = :owner_id)
    AND l.fencing_token < excluded.fencing_token
RETURNING lease_key
"""
#: Raise a fence to at least ``token``; never lowers it.
RAISE_FENCE = """
INSERT INTO celery_lease_fences AS fe (resource, fencing_token, updated_at)
VALUES (:key, :token, :now)
ON CONFLICT (resource) DO UPDATE SET
    fencing_token = CASE WHEN fe.fencing_token > excluded.fencing_token
                         THEN fe.fencing_token ELSE excluded.fencing_token END,
    updated_at = excluded.updated_at
"""

#: Renew many leases at once: each (key, owner, token) row must still match a
#: live lease. PostgreSQL: one statement for any number of leases.
PG_RENEW_MANY = f"""
WITH v AS (
    SELECT * FROM unnest(CAST(:keys AS text[]), CAST(:owners AS text[]),
                         CAST(:tokens AS bigint[]), CAST(:ttls AS double precision[]))
        AS v(lease_key, owner_id, fencing_token, ttl)
), t AS (SELECT {NOW["postgresql"]} AS now)
UPDATE celery_lease_leases AS l
SET expires_at = t.now + v.ttl, renewed_at = t.now, ttl = v.ttl
FROM v, t
WHERE l.lease_key = v.lease_key AND l.owner_id = v.owner_id
    AND l.fencing_token = v.fencing_token AND l.expires_at > t.now
RETURNING l.lease_key, l.owner_id, l.fencing_token, l.expires_at
"""
RENEW_ONE = """
UPDATE celery_lease_leases SET expires_at = :now + :ttl, renewed_at = :now, ttl = :ttl
WHERE lease_key = :key AND owner_id = :owner_id AND fencing_token = :token
    AND expires_at > :now
RETURNING lease_key, expires_at
"""
#: Release keeps the row (and its token) and marks it released: expires_at =
#: renewed_at = now (a grant or renewal always leaves expires_at > renewed_at).
#: Only this owner and token release; releasing again answers yes (idempotent,
#: so a retry after a lost reply is not mistaken for a lost lease).
RELEASE_IN = """
UPDATE celery_lease_leases SET expires_at = t.now, renewed_at = t.now
FROM (SELECT {now} AS now) AS t
WHERE lease_key IN ({keys}) AND owner_id = :owner_id AND fencing_token = :token
    AND (expires_at > t.now OR renewed_at = expires_at)
RETURNING lease_key
"""
INSPECT = """
SELECT l.lease_key, l.owner_id, l.fencing_token, l.expires_at, l.acquired_at, l.renewed_at,
       l.ttl, l.task_id, l.task_name, l.root_id, l.tenant,
       (SELECT fencing_token FROM celery_lease_fences WHERE resource = :key) AS fence,
       {now} AS now
FROM (SELECT 1) AS one
LEFT JOIN celery_lease_leases AS l ON l.lease_key = :key
"""
LIST = r"""
SELECT lease_key, owner_id, fencing_token, expires_at, acquired_at, renewed_at, ttl,
       task_id, task_name, root_id, tenant, {now} AS now
FROM celery_lease_leases
WHERE lease_key LIKE :pattern ESCAPE '\'
    AND (:expired OR (owner_id IS NOT NULL AND expires_at > {now}))
ORDER BY lease_key
"""
#: Force release: free the row and raise the fence one past the evicted
#: token, so the evicted owner's guarded writes are refused and the next
#: grant is larger still.
EVICT = """
UPDATE celery_lease_leases SET owner_id = NULL, expires_at = :now, renewed_at = :now
WHERE lease_key = :key
"""
FENCE_TOKEN = """
SELECT COALESCE(MAX(t), 0) FROM (
    SELECT fencing_token AS t FROM celery_lease_fences WHERE resource = :key
    UNION ALL
    SELECT fencing_token AS t FROM celery_lease_leases WHERE lease_key = :key
) AS both_tokens
"""
SELECT_NOW = "SELECT {now}"


@lru_cache(maxsize=512)
def stmt(sql: str) -> TextClause:
    """``text(sql)``, built once per distinct statement (the hot paths reuse them)."""
    return text(sql)


def in_list(prefix: str, n: int) -> tuple[str, list[str]]:
    """``:p0, :p1, ...`` placeholders for an ``IN (...)`` of n bound values."""
    names = [f"{prefix}{i}" for i in range(n)]
    return ", ".join(f":{name}" for name in names), names


# ---------------------------------------------------------------------------
# Engines


class Database:
    """An engine for one URL in this process, with the dialect's details."""

    def __init__(self, url: str, **engine_options: Any) -> None:
        self.url = normalize_sql_url(url)
        try:
            parsed = make_url(self.url)
        except exc.ArgumentError as e:
            raise LeaseConfigError(f"not a database URL: {url!r} ({e})") from e
        self.dialect = parsed.get_backend_name()
        if self.dialect not in NOW:
            raise LeaseConfigError(
                f"unsupported database {self.dialect!r} in {url!r}: use "
                "postgresql+psycopg://... or sqlite:///..."
            )
        self.now_sql = NOW[self.dialect]
        self.is_sqlite = self.dialect == "sqlite"
        options: dict[str, Any] = {"future": True}
        if self.is_sqlite:
            database = parsed.database or ""
            if database in ("", ":memory:"):
                raise LeaseConfigError(
                    "an SQLite lease store needs a file shared by all processes: sqlite:///path"
                )
            self.sqlite_path: str | None = os.path.abspath(database)
            options["connect_args"] = {"timeout": 30.0, "check_same_thread": False}
        else:
            self.sqlite_path = None
            options["connect_args"] = {"connect_timeout": 5}
            options["pool_size"] = 5
            options["max_overflow"] = 20
        options.update(engine_options)
        self.engine: Engine = create_engine(self.url, **options)
        if self.is_sqlite:
            _sqlite_listeners(self.engine)
            self.single_engine: Engine = self.engine
        else:
            self.single_engine = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self._migrated = False
        _after_fork_dispose(self)

    # -- running statements ------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A short transaction (``BEGIN IMMEDIATE`` on SQLite); errors translated."""
        with self.errors(), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def single(self) -> Iterator[Connection]:
        """A connection for one statement: autocommit on PostgreSQL (one round trip)."""
        with self.errors(), self.single_engine.begin() as conn:
            yield conn

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Translate driver errors into celery-lease's (the one place that does)."""
        try:
            yield
        except exc.DBAPIError as e:
            raise translate_error(e, self.url) from e

    def dispose(self) -> None:
        self.engine.dispose()

    def now(self) -> float:
        with self.single() as conn:
            return float(conn.exec_driver_sql(SELECT_NOW.format(now=self.now_sql)).scalar_one())

    def ensure_schema(self) -> None:
        """SQLite only: apply the migrations on first use (the embedded default)."""
        if self._migrated or not self.is_sqlite:
            return
        migrate(self.url, _database=self)
        self._migrated = True


def translate_error(e: exc.DBAPIError, url: str) -> LeaseError:
    from celery_lease.stores.base import redact_url

    text = str(e.orig) if e.orig is not None else str(e)
    lowered = text.lower()
    if "no such table" in lowered or ("does not exist" in lowered and "relation" in lowered):
        return LeaseConfigError(
            f"celery-lease tables are missing in {redact_url(url)}: run "
            f"`celery -A proj lease migrate` (or celery_lease.migrate(url)) first ({text.strip()})"
        )
    sqlstate = str(getattr(e.orig, "sqlstate", None) or "")
    if sqlstate[:2] in ("22", "54") and not e.connection_invalidated:
        # Data exception / program limit exceeded (a value too large for an
        # index row): the input is wrong, retrying would never help.
        return LeaseError(f"database {redact_url(url)} refused the value: {text.strip()}")
    if isinstance(e, (exc.OperationalError, exc.InterfaceError)) or e.connection_invalidated:
        return StoreUnavailable(f"database {redact_url(url)} unavailable: {text.strip()}")
    if "deadlock detected" in lowered or "could not serialize" in lowered:
        return StoreUnavailable(f"database {redact_url(url)}: transient conflict: {text.strip()}")
    return LeaseError(f"database {redact_url(url)}: {text.strip()}")


def _sqlite_listeners(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, connection_record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


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

    os.register_at_fork(after_in_child=_reset)


# ---------------------------------------------------------------------------
# Migrations


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
        finally:
            conn.exec_driver_sql("SELECT pg_advisory_unlock(7244231)")
            conn.commit()


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
    db._migrated = False  # the embedded SQLite default migrates again on next use


def check(url: str) -> None:
    """Raise if the database schema differs from :mod:`celery_lease.schema` (``alembic check``)."""
    from alembic import command

    db = database(url)
    cfg = _alembic_config(db.url)
    with db.errors(), db.engine.connect() as conn:
        cfg.attributes["connection"] = conn
        command.check(cfg)


# ---------------------------------------------------------------------------
# Fenced results. See celery_lease/results.py for the reasoning.

#: Same database as the leases: check ownership on the lease row (locking
#: it) and release it, in the same transaction as the result insert.
#: ``{set}`` releases (owner NULL, expired now) or only touches the row.
RESULT_OWN_LEASE = """
UPDATE celery_lease_leases SET {set}
WHERE lease_key IN ({keys}) AND owner_id = :owner_id AND fencing_token = :token
    AND expires_at > :now
RETURNING lease_key
"""
RESULT_RELEASE_SET = "expires_at = :now, renewed_at = :now"
RESULT_KEEP_SET = "renewed_at = renewed_at"
#: Leases elsewhere (Redis, another database): the key's fence row here is the
#: lock every commit of the key takes, and holds the newest registered token.
RESULT_REGISTER = """
INSERT INTO celery_lease_fences AS fe (resource, fencing_token, updated_at)
VALUES (:key, :token, {now})
ON CONFLICT (resource) DO UPDATE SET
    fencing_token = excluded.fencing_token, updated_at = excluded.updated_at
WHERE fe.fencing_token <= excluded.fencing_token
RETURNING fencing_token
"""
RESULT_LOCK_FENCE = """
SELECT fencing_token FROM celery_lease_fences WHERE resource = :key {for_update}
"""
RESULT_DUPLICATE = """
SELECT fencing_token FROM celery_lease_results WHERE lease_key = :key
ORDER BY fencing_token LIMIT 1
"""
#: The result row, written only if (once mode) the key has no accepted row yet;
#: run after the caller holds the key's lock, so its snapshot is fresh. A row
#: with this key and token already there (a retried commit) is left alone.
#: No row returned: a duplicate, or this very commit accepted earlier.
RESULT_INSERT = """
INSERT INTO celery_lease_results
    (lease_key, fencing_token, task_id, task_name, owner_id, tenant, root_id, result, accepted_at)
SELECT :key, :token, :task_id, :task_name, :owner_id, :tenant, :root_id, {result}, {now}
WHERE NOT (:once AND EXISTS (SELECT 1 FROM celery_lease_results WHERE lease_key = :key))
ON CONFLICT (lease_key, fencing_token) DO NOTHING
RETURNING accepted_at
"""
#: PostgreSQL, leases in this database: check ownership on the lease row (and
#: release it), and insert the result, in one statement (one round trip). The
#: duplicate look-up reads the statement's snapshot: only the lease's owner
#: commits, and every earlier owner's commit preceded this owner's claim.
PG_COMMIT_COLOCATED = f"""
WITH t AS (SELECT {NOW["postgresql"]} AS now),
own AS (
    UPDATE celery_lease_leases AS l SET {{set}}
    FROM t
    WHERE l.lease_key = ANY(CAST(:keys AS text[])) AND l.owner_id = :owner_id
        AND l.fencing_token = :token AND l.expires_at > t.now
    RETURNING l.lease_key
),
dup AS (
    SELECT fencing_token FROM celery_lease_results WHERE lease_key = :key AND :once
    ORDER BY fencing_token LIMIT 1
),
ins AS (
    INSERT INTO celery_lease_results
        (lease_key, fencing_token, task_id, task_name, owner_id, tenant, root_id, result,
         accepted_at)
    SELECT :key, :token, :task_id, :task_name, :owner_id, :tenant, :root_id,
           CAST(:result AS jsonb), t.now
    FROM t
    WHERE (SELECT count(*) FROM own) = :n AND NOT EXISTS (SELECT 1 FROM dup)
    ON CONFLICT (lease_key, fencing_token) DO NOTHING
    RETURNING accepted_at
)
SELECT (SELECT count(*) FROM own) AS owned, (SELECT fencing_token FROM dup) AS duplicate,
       (SELECT accepted_at FROM ins) AS accepted_at
"""
PG_COMMIT_RELEASE_SET = "expires_at = t.now, renewed_at = t.now"
PG_COMMIT_KEEP_SET = "renewed_at = l.renewed_at"
RESULT_COLUMNS = """
lease_key, fencing_token, task_id, task_name, owner_id, tenant, root_id, result, accepted_at
"""
RESULT_BY_KEY_TOKEN = f"""
SELECT {RESULT_COLUMNS} FROM celery_lease_results WHERE lease_key = :key AND fencing_token = :token
"""
RESULT_ACCEPTED = f"""
SELECT {RESULT_COLUMNS} FROM celery_lease_results
WHERE lease_key = :key
    AND ((CAST(:tenant AS TEXT) IS NULL AND tenant IS NULL) OR tenant = CAST(:tenant AS TEXT))
ORDER BY fencing_token DESC LIMIT 1
"""
RESULT_FOR_TASK = f"""
SELECT {RESULT_COLUMNS} FROM celery_lease_results WHERE task_id = :task_id
ORDER BY fencing_token DESC LIMIT 1
"""
RESULT_HISTORY = f"""
SELECT {RESULT_COLUMNS} FROM celery_lease_results
WHERE lease_key = :key
    AND ((CAST(:tenant AS TEXT) IS NULL AND tenant IS NULL) OR tenant = CAST(:tenant AS TEXT))
ORDER BY fencing_token DESC LIMIT :limit
"""
#: Sweeper: results past retention; lease rows long expired, after copying
#: their tokens into the fence rows, so a later claim still gets a larger one.
SWEEP_RESULTS = "DELETE FROM celery_lease_results WHERE accepted_at < :cutoff"
SWEEP_KEEP_FENCES = """
INSERT INTO celery_lease_fences AS fe (resource, fencing_token, updated_at)
SELECT lease_key, fencing_token, :now FROM celery_lease_leases
WHERE expires_at < :cutoff
ON CONFLICT (resource) DO UPDATE SET
    fencing_token = CASE WHEN fe.fencing_token > excluded.fencing_token
                         THEN fe.fencing_token ELSE excluded.fencing_token END
"""
SWEEP_LEASES = "DELETE FROM celery_lease_leases WHERE expires_at < :cutoff"
#: fencing.guard(): accept ``token`` for ``resource`` unless a newer one was seen.
GUARD = """
INSERT INTO celery_lease_fences AS fe (resource, fencing_token, updated_at)
VALUES (:resource, :token, {now})
ON CONFLICT (resource) DO UPDATE SET
    fencing_token = excluded.fencing_token, updated_at = excluded.updated_at
WHERE fe.fencing_token <= excluded.fencing_token
RETURNING fencing_token
"""
GUARD_CURRENT = "SELECT fencing_token FROM celery_lease_fences WHERE resource = :resource"

#: Before the body, after the registration (leases elsewhere): whether this
#: task id already has an accepted result (a late redelivery) and, in once
#: mode, whether the key has one (a duplicate).
PREPARE_LOOKUP = """
SELECT (SELECT fencing_token FROM celery_lease_results WHERE task_id = :task_id
        ORDER BY fencing_token DESC LIMIT 1) AS task_token,
       (SELECT fencing_token FROM celery_lease_results WHERE lease_key = :key AND :once
        ORDER BY fencing_token LIMIT 1) AS duplicate_token
"""
