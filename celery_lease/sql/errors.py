"""Driver errors (psycopg 3, sqlite3, or SQLAlchemy's wrappers of them) as
celery-lease's: StoreUnavailable (transient, retry), LeaseError (permanent),
LeaseConfigError (the tables are missing). The one place that decides."""

from __future__ import annotations

from sqlalchemy import exc

from celery_lease.exceptions import LeaseConfigError, LeaseError, StoreUnavailable
from celery_lease.urls import redact_url

__all__ = ["SQLITE_CODES", "SQLSTATES", "translate_error"]


def _schema_missing(lowered: str) -> bool:
    """True if a (lower-cased) driver message says a table or function of ours is missing."""
    return "no such table" in lowered or (
        "does not exist" in lowered
        and ("relation" in lowered or "function celery_lease_" in lowered)
    )


#: What a PostgreSQL error means for a lease, by SQLSTATE (a two-character
#: entry stands for its whole class; the five-character code wins): a reason
#: for StoreUnavailable (not now: the caller retries within the lease's
#: validity, a task defers), or None for LeaseError (the input is wrong:
#: retrying would meet it again). A code in neither falls back to the driver's
#: error class (see :func:`translate_error`).
SQLSTATES: dict[str, str | None] = {
    "08": "the connection failed",
    "25006": "the session is read-only (a standby, or default_transaction_read_only)",
    "40001": "transient conflict (serialization failure)",
    "40P01": "transient conflict (deadlock detected)",
    "53": "the server lacks resources (too many connections, disk full, out of memory)",
    "55P03": "a lock was not available in time",
    "57014": "the statement was cancelled (statement_timeout?)",
    "57P01": "the server is shutting down (administrator command)",
    "57P02": "the server is restarting after a crash",
    "57P03": "the server does not accept connections now (starting or shutting down)",
    "57P04": "the server's database was dropped",
    "58": "the server had an I/O error",
    "22": None,  # data exception: a value the database refuses
    "54": None,  # program limit exceeded (a value too large for an index row)
}

#: The same for SQLite, by primary result code (``sqlite_errorcode & 0xFF``).
SQLITE_CODES: dict[int, str | None] = {
    5: "the database is locked (SQLITE_BUSY: a writer held it past the busy timeout)",
    6: "a table is locked (SQLITE_LOCKED)",
    8: "the database is read-only to this process (SQLITE_READONLY)",
    10: "a disk I/O error (SQLITE_IOERR)",
    13: "the disk is full (SQLITE_FULL)",
    14: "the database file cannot be opened (SQLITE_CANTOPEN)",
    15: "a locking protocol error (SQLITE_PROTOCOL)",
    18: None,  # SQLITE_TOOBIG: a value over the size limit
}


def translate_error(
    e: BaseException, url: str, unavailable: tuple[type[BaseException], ...]
) -> LeaseError:
    """celery-lease's error for a driver error or SQLAlchemy's wrapper of one.

    Decided by :data:`SQLSTATES` / :data:`SQLITE_CODES`, then by the driver's
    class (``unavailable``: OperationalError, InterfaceError); tables of ours
    missing are a LeaseConfigError.
    """
    invalidated = False
    if isinstance(e, exc.DBAPIError):
        invalidated = bool(e.connection_invalidated)
        if e.orig is not None:
            e = e.orig
    text = str(e).strip()
    where = redact_url(url)
    if _schema_missing(text.lower()):
        return LeaseConfigError(
            "celery-lease tables are missing or not migrated to the latest revision in "
            f"{where}: run `celery -A proj lease migrate` (or "
            f"celery_lease.migrate(url)) first ({text})"
        )
    if invalidated:
        return StoreUnavailable(f"database {where} unavailable: the connection failed: {text}")
    sqlstate = getattr(e, "sqlstate", None)
    code = getattr(e, "sqlite_errorcode", None)
    if isinstance(sqlstate, str) and (sqlstate in SQLSTATES or sqlstate[:2] in SQLSTATES):
        reason = SQLSTATES.get(sqlstate, SQLSTATES.get(sqlstate[:2]))
        text = f"{text} (SQLSTATE {sqlstate})"
    elif isinstance(code, int) and (code & 0xFF) in SQLITE_CODES:
        reason = SQLITE_CODES[code & 0xFF]
    elif isinstance(e, (*unavailable, exc.OperationalError, exc.InterfaceError)):
        reason = "unreachable"
    else:
        return LeaseError(f"database {where}: {text}")
    if reason is None:
        return LeaseError(f"database {where} refused the value: {text}")
    return StoreUnavailable(f"database {where} unavailable: {reason}: {text}")
