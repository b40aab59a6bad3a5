"""A Celery result backend in celery-lease's SQL database.

``result_backend = "lease+postgresql+psycopg://host/db"`` (or
``lease+postgresql://...``, ``lease+sqlite:///path``): Celery's ``by_url``
splits off ``lease`` (this class, from the ``celery.result_backends``
entry-point group) and hands over the rest, the database URL, which is used
exactly as ``lease_result_url`` would be (:func:`celery_lease.sql.database`:
one connection pool per URL and process, fork-safe, driver errors
translated). The records live in ``celery_lease_task_meta`` (migration 0004),
beside the fenced result table: ``celery -A proj lease migrate`` creates it on
PostgreSQL, and an SQLite file is migrated on first use.

**Why KeyValueStoreBackend.** Celery's key-value base class builds the whole
protocol on eight small operations (get, mget, set, delete, incr, expire),
each one named statement here: task state and ``result_extended`` fields,
groups (``GroupResult.save``/``restore``), ``forget``, ``get_many`` (one
``IN`` read per poll, so ``join_native``), and chords through Celery's own
counter: every header member ends with an atomic ``incr`` of the chord's
key, and the member that reads the header's size publishes the callback.
:class:`~celery.backends.base.BaseBackend` (what Celery's own SQL backend
uses) would mean re-implementing the state, group and chord methods, and its
chords fall back to ``celery.chord_unlock``, a task that polls the header
once a second per chord. Nothing found needs the columns a BaseBackend table
would have: the state is inside the JSON value, and the part that will fence
a leased task's writes conditions on the ``token`` column, not on the state.

**JSON only.** The value is the JSON Celery encoded (text, never pickle): a
``result_serializer`` other than ``json``, or ``result_accept_content``
without JSON, fails when the backend is built. ``result_compression`` is
ignored, with Celery's warning (a JSON document is not arbitrary bytes).

**Expiry.** Each write carries ``result_expires`` (``result_failure_expires``
for a FAILURE) as ``expires_at`` in the database's clock; a row past it reads
as absent at once, as an expired Redis key does, and :meth:`LeaseBackend.cleanup`
(Celery beat's daily ``celery.backend_cleanup``) deletes it.

**Errors.** :class:`~celery_lease.exceptions.StoreUnavailable` (the database
unreachable, read-only, out of connections...) is retryable: as for Celery's
own SQL backend, state writes and reads retry it 3 times with backoff unless
``result_backend_always_retry`` / ``result_backend_max_retries`` say
otherwise; once they are spent, Celery raises its ``BackendGetMetaError`` /
``BackendStoreError``. Both StoreUnavailable and BackendGetMetaError are in
:attr:`LeaseBackend.connection_errors`, which the task layer reads as "the
backend cannot be read" (a deferral, not a failure). Missing tables are a
:class:`~celery_lease.exceptions.LeaseConfigError` that names
``celery -A proj lease migrate``.

This backend is Celery's plain protocol: a leased task's state writes are not
yet fenced, nor committed in the fenced result's transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from celery import states
from celery.backends.base import KeyValueStoreBackend
from celery.exceptions import BackendGetMetaError, ImproperlyConfigured

from celery_lease.exceptions import LeaseConfigError, StoreUnavailable
from celery_lease.sql import Database, database
from celery_lease.sql import meta_queries as mq
from celery_lease.sql.dialects import key_params
from celery_lease.sql.migrate import ensure_schema
from celery_lease.stores.registry import is_sql_url
from celery_lease.urls import check_sql_url, redact_url, scheme_of

__all__ = ["SCHEME", "LeaseBackend", "LeaseBackendConfigError", "lease_backend_url"]

logger = logging.getLogger(__name__)

#: The backend's name in ``result_backend`` (``lease+<database URL>``).
SCHEME = "lease"
#: Keys read per statement by :meth:`LeaseBackend.mget` (SQLite binds at most
#: 32,766 parameters; a group of any size stays under it).
MGET_BATCH = 500

_FORMS = "lease+postgresql+psycopg://host/db, lease+postgresql://host/db or lease+sqlite:///path"


class LeaseBackendConfigError(LeaseConfigError, ImproperlyConfigured):  # type: ignore[misc]
    """The ``lease+`` result backend is misconfigured (its URL, its serializer).

    Both a :class:`~celery_lease.exceptions.LeaseConfigError` and Celery's
    ``ImproperlyConfigured``, so either family's handler catches it.
    """


def lease_backend_url(app: Any) -> str | None:
    """The database URL of ``app``'s result backend if it is this one, else None.

    Read from the settings (``result_backend``), without building the backend.
    """
    setting = app.backend_cls or app.conf.result_backend
    if isinstance(setting, str) and setting.lower().startswith(SCHEME + "+"):
        return setting.split("+", 1)[1]
    return None


def check_backend_url(url: str | None) -> str:
    """``url`` (the part after ``lease+``) if it names a PostgreSQL or SQLite
    database, else a :class:`LeaseBackendConfigError` saying the URL forms."""
    if not url or "://" not in url:
        raise LeaseBackendConfigError(
            f"result_backend: the lease backend needs a database URL after 'lease+': {_FORMS}"
        )
    if scheme_of(url) == SCHEME or not is_sql_url(url):
        raise LeaseBackendConfigError(
            f"result_backend: lease+{redact_url(url)} is not a PostgreSQL or SQLite "
            f"database URL: {_FORMS}"
        )
    try:
        check_sql_url("result_backend", url)
    except LeaseConfigError as e:
        raise LeaseBackendConfigError(str(e)) from e
    return url


def _text(value: str | bytes) -> str:
    """Keys and values as text (Celery hands over either)."""
    return value.decode() if isinstance(value, bytes) else value


def _seconds(value: Any) -> float | None:
    """An expiry in seconds, or None for none (Celery's 0 and None both mean never)."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    return float(value) if value else None


class LeaseBackend(KeyValueStoreBackend):  # type: ignore[misc]
    """Celery's key-value result protocol over ``celery_lease_task_meta``."""

    #: Keys are text (Celery's base class makes bytes by default).
    key_t = str
    #: Chords count their finished members with :meth:`incr` (no chord_unlock polling).
    implements_incr = True
    #: ``get_many`` reads a whole group per statement: ``join_native`` uses it.
    supports_native_join = True
    #: Expired rows read as absent but stay until beat's ``celery.backend_cleanup``.
    supports_autoexpire = False
    supports_failure_expires = True
    supports_result_compression = False
    #: What a read of this backend raises when the database cannot be reached
    #: (the task layer treats the backend as unreadable, not the task as failed):
    #: StoreUnavailable, or Celery's BackendGetMetaError once its retries of it
    #: are spent.
    connection_errors = (StoreUnavailable, BackendGetMetaError)
    # Set by Celery's Backend.__init__ from result_backend_always_retry / _max_retries.
    always_retry: bool | None
    max_retries: float | None

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        database_url = check_backend_url(url)
        super().__init__(url=url, **kwargs)
        if self.serializer != "json":
            raise LeaseBackendConfigError(
                f"result_serializer must be 'json' for the lease result backend (it stores "
                f"task metadata as JSON only), got {self.serializer!r}"
            )
        if "application/json" not in self.accept:
            raise LeaseBackendConfigError(
                "result_accept_content must include 'json' for the lease result backend "
                f"(it stores task metadata as JSON only), got {sorted(self.accept)}"
            )
        conf = self.app.conf
        # Celery's own SQL backend retries transient database errors by default; so does this.
        if not conf.value_set_for("result_backend_always_retry") or self.always_retry is None:
            self.always_retry = True
        if not conf.value_set_for("result_backend_max_retries") or self.max_retries is None:
            self.max_retries = 3
        failure_expires = conf.get("result_failure_expires")
        self.failure_expires = (
            self.expires if failure_expires is None else self.prepare_expires(failure_expires)
        )
        self.db: Database = database(database_url)
        ensure_schema(self.db)

    def __reduce__(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        return super().__reduce__(args, {**(kwargs or {}), "url": self.url})

    def as_uri(self, include_password: bool = False) -> str:
        """``lease+<database URL>``, its password masked unless asked for."""
        url = self.url or ""
        return f"{SCHEME}+{url if include_password else redact_url(url)}"

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        return isinstance(exc, StoreUnavailable)

    @property
    def client(self) -> LeaseBackend:
        """The backend itself: Celery 5.3's key-value chord code, written for Redis,
        deletes a finished chord's counter with ``self.client.delete(key)``."""
        return self

    # -- the key-value protocol ----------------------------------------------

    def get(self, key: str) -> str | None:
        with self.db.read() as conn:
            value = conn.execute(self.db.sql.meta_get, {"key": _text(key)}).scalar()
        return None if value is None else str(value)

    def mget(self, keys: Sequence[str]) -> list[str | None]:
        """The values of ``keys``, in their order (None: absent or expired)."""
        wanted = [_text(k) for k in keys]
        found: dict[str, str] = {}
        for start in range(0, len(wanted), MGET_BATCH):
            batch = wanted[start : start + MGET_BATCH]
            with self.db.read() as conn:
                rows = conn.execute(self.db.sql.meta_mget(len(batch)), key_params(batch)).all()
            found.update((row.key, row.value) for row in rows)
        return [found.get(k) for k in wanted]

    def set(self, key: str, value: str | bytes) -> None:
        """Write ``value``, expiring after ``result_expires``."""
        self._write(key, value, self.expires)

    def _set_with_state(self, key: str, value: str | bytes, state: str) -> None:
        self._write(key, value, self.failure_expires if state == states.FAILURE else self.expires)

    def _write(self, key: str, value: str | bytes, expires: Any) -> None:
        params = {"key": _text(key), "value": _text(value), "ttl": _seconds(expires)}
        with self.db.single() as conn:
            conn.execute(self.db.sql.meta_set, params)

    def delete(self, key: str) -> None:
        with self.db.single() as conn:
            conn.execute(mq.META_DELETE, {"key": _text(key)})

    def incr(self, key: str) -> int:
        """Add one to ``key``'s counter and return the new value (atomic).

        A transaction rather than an autocommit statement: a statement is sent
        again only when its connection died before the transaction committed,
        so a lost reply never counts one chord member twice.
        """
        with self.db.transaction() as conn:
            value = conn.execute(self.db.sql.meta_incr, {"key": _text(key)}).scalar_one()
        return int(value)

    def expire(self, key: str, value: Any) -> None:
        """Make ``key`` expire ``value`` seconds from now (0 or None: never)."""
        params = {"key": _text(key), "ttl": _seconds(value)}
        with self.db.single() as conn:
            conn.execute(self.db.sql.meta_expire, params)

    # -- retention -------------------------------------------------------------

    def cleanup(self) -> int:
        """Delete the rows past their expiry (Celery beat's ``celery.backend_cleanup``)."""
        with self.db.single() as conn:
            deleted = conn.execute(self.db.sql.meta_cleanup).rowcount
        logger.info(
            "result backend: deleted %d expired record(s)",
            deleted,
            extra={"action": "backend_cleanup", "deleted": deleted},
        )
        return int(deleted)
