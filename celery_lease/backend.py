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
Each member counts once, and a last member that dies before the publish
leaves its chord to be finished by another worker:
:mod:`celery_lease.backend_chords`.
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

**Leased tasks** (docs/result-backend.md, "Leased tasks"). A LeasedTask's
execution puts a :class:`LeaseWriter` on its request (Celery's ``Context``,
the object the tracer hands to every write of that task) once it holds its
lease: an attribute, not a thread-local or a signal, so exactly the writes
made for that request see it, and only an instance of the class counts (a
message header of the same name is a string). With it:

- every state write of the request (STARTED, RETRY, FAILURE, a custom
  ``update_state``, a SUCCESS the execution stores itself) carries the
  lease's token and is fenced by it in one statement (``meta_fenced``):
  refused over a record whose token is larger (a newer owner of the task id
  wrote it), by a newer grant of the lease's keys registered in this
  database before that owner wrote anything (:func:`lease_writer`; the
  statement's comment says which grants count), and over a SUCCESS
  (Celery's rule, which its key-value code checks with a read before the
  write, made atomic), logged and counted
  (``celery_lease_backend_writes_refused``), never raised into the worker;
- when this backend's database is the fenced result table's, the fenced
  commit writes the task's SUCCESS record (:meth:`LeaseBackend.success_record`:
  what the tracer would write, from Celery's own ``_get_result_meta`` and
  ``encode``) in the commit's transaction, with the token, and marks the
  writer; the tracer's SUCCESS write for that request is then a no-op, unless
  Celery added children after the commit (a link, a chain's next task: sent
  after the body), when it is one fenced write that adds them. The two
  databases are one unless told otherwise: ``lease_result_url`` unset
  defaults to this backend's database (``Config.from_app``). When they
  differ, the tracer's SUCCESS is a write of its own, after the commit,
  fenced like the others.

Writes without a writer (tasks that are not leased, anything outside the
worker's execution) follow Celery's key-value path as before, with one
change: the upsert never replaces the SUCCESS of a record that has a token,
in the same statement.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery import states
from celery.backends.base import KeyValueStoreBackend
from celery.exceptions import BackendGetMetaError
from kombu.utils.encoding import bytes_to_str

from celery_lease import backend_chords as chords
from celery_lease import metrics
from celery_lease.backend_url import (
    SCHEME,
    LeaseBackendConfigError,
    check_backend_url,
    lease_backend_database,
    lease_backend_url,
)
from celery_lease.exceptions import StoreUnavailable
from celery_lease.result_commit import MetaRecord
from celery_lease.sql import Database, database
from celery_lease.sql.dialects import key_params
from celery_lease.sql.migrate import on_first_use
from celery_lease.urls import redact_url

__all__ = [
    "SCHEME",
    "LeaseBackend",
    "LeaseBackendConfigError",
    "LeaseWriter",
    "commit_record",
    "lease_backend_database",
    "lease_backend_url",
    "lease_writer",
    "writer_of",
]

logger = logging.getLogger(__name__)

#: Keys read per statement by :meth:`LeaseBackend.mget` (SQLite binds at most
#: 32,766 parameters; a group of any size stays under it).
MGET_BATCH = 500

#: Final states besides SUCCESS: refused only by a newer grant of the same task id.
_FINAL = states.READY_STATES - {states.SUCCESS}


@dataclass
class LeaseWriter:
    """What a LeasedTask's execution tells this backend about the request it runs.

    Set as ``request.celery_lease_writer`` once the execution holds its lease,
    and left there until Celery is done with the request, so that the
    tracer's own writes after the body (SUCCESS, RETRY, FAILURE) carry it too.
    """

    #: The lease's fencing token: every write of this backend for the request carries it.
    token: int
    #: The lease's keys when this backend's database is the result table's,
    #: whose lease and fence rows then know each key's newer grants (none:
    #: only the row's token fences). See :func:`lease_writer`.
    keys: tuple[str, ...] = ()
    #: Set when the fenced commit wrote the task's SUCCESS record in its
    #: transaction: how many children the request had then.
    committed_children: int | None = None
    #: The request's last fenced write was refused: its chord part, if any, is
    #: the copy's whose state stands (:meth:`LeaseBackend.on_chord_part_return`).
    refused: bool = False

    def committed(self, request: Any) -> None:
        """The fenced commit wrote ``request``'s SUCCESS record. Its keys are
        dropped: the children Celery adds after the commit go into the accepted
        SUCCESS, even once a newer grant of the key (another task id) registered."""
        self.committed_children = len(_children(request))
        self.keys = ()


def lease_writer(task: Any, lease: Any, results_db: Database) -> LeaseWriter:
    """The :class:`LeaseWriter` of an execution holding ``lease`` (its
    ``token`` and ``keys``): with the keys only in a ``lease+`` backend whose
    database is ``results_db``, the result table's. There the claims of the
    key register their tokens (the lease rows of leases in that database, the
    fence rows of leases elsewhere); in another database the rows of the same
    names say nothing of these grants, and only the record's token fences."""
    backend = task.backend
    same = isinstance(backend, LeaseBackend) and backend.db is results_db
    return LeaseWriter(lease.token, tuple(lease.keys) if same else ())


#: The request attribute that holds a :class:`LeaseWriter`.
WRITER_ATTR = "celery_lease_writer"


def writer_of(request: Any) -> LeaseWriter | None:
    """``request``'s :class:`LeaseWriter`, or None (only an instance counts:
    Celery makes message headers request attributes, and a header is never one)."""
    writer = getattr(request, WRITER_ATTR, None) if request is not None else None
    return writer if isinstance(writer, LeaseWriter) else None


def commit_record(
    task: Any, request: Any, task_id: str, retval: Any, results_db: Database
) -> MetaRecord | None:
    """The SUCCESS record for a leased task's fenced commit to write in its
    transaction: only if Celery would store one (not ``ignore_result``, not an
    eager call without ``store_eager_result``), in a ``lease+`` backend whose
    database is ``results_db``, the result table's. None: the tracer writes it
    after the commit (a write of its own, fenced by the token here).

    Never for a chord's header member: Celery counts the member in the call
    that stores its SUCCESS (``mark_as_done``, then ``on_chord_part_return``),
    and acknowledges without a count a message whose worker died after its
    SUCCESS was stored ("succeeded before the worker was lost"). A SUCCESS in
    the commit would open the whole rest of the execution to a death that
    loses the count for good, and the chord would wait forever. Stored by the
    tracer, a death before it leaves no SUCCESS: the message comes back, and
    the copy stores the accepted value through ``mark_as_done``, which counts
    the member."""
    backend = task.backend
    if not isinstance(backend, LeaseBackend) or backend.db is not results_db:
        return None
    if getattr(request, "chord", None):
        return None
    ignored = task.ignore_result or getattr(request, "ignore_result", False)
    eager = getattr(request, "is_eager", False)
    if ignored or (eager and not getattr(task, "store_eager_result", False)):
        return None
    return backend.success_record(task_id, retval, request)


def _children(request: Any) -> list[Any]:
    return list(getattr(request, "children", None) or ())


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
        on_first_use(self.db)

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
        self._write(key, value, self._expires(state), state)

    def _expires(self, state: str) -> Any:
        return self.failure_expires if state == states.FAILURE else self.expires

    def _write(self, key: str, value: str | bytes, expires: Any, state: str | None = None) -> None:
        """Celery's write of ``key`` (never over a leased task's SUCCESS)."""
        text_key = _text(key)
        params = {"key": text_key, "value": _text(value), "ttl": _seconds(expires)}
        with self.db.single() as conn:
            written = conn.execute(self.db.sql.meta_set, params).first()
        if written is None:
            self._refused(text_key, state, None)

    def delete(self, key: str) -> None:
        text_key = _text(key)
        chords.delete(self.db, text_key, chord=text_key.startswith(self.chord_keyprefix))

    def incr(self, key: str) -> int:
        """Add one to ``key``'s counter and return it (a chord's count: backend_chords)."""
        return chords.count(self.db, _text(key), _seconds(self._chord_ttl()))

    def _chord_ttl(self) -> Any:
        """How long a chord's counter and marks live: Celery 5.7's ``chord_expires``
        (``result_chord_expires``); before 5.7 Celery renews the counter with
        ``result_expires``, so the marks live as long."""
        return getattr(self, "chord_expires", self.expires)

    def restore_group(self, group_id: str, cache: bool = True) -> Any:
        group = super().restore_group(group_id, cache=cache)
        chords.restored(group_id, group)
        return group

    def on_chord_part_return(self, request: Any, state: str, result: Any, **kwargs: Any) -> Any:
        """Celery's chord count, each header member once (the module's docstring)."""
        writer = writer_of(request)
        if writer is not None and writer.refused:
            logger.info("result backend: %s's state was refused: no chord count", request.id)
            return None
        with chords.counting(request):
            return super().on_chord_part_return(request, state, result, **kwargs)

    def expire(self, key: str, value: Any) -> None:
        """Make ``key`` expire ``value`` seconds from now (0 or None: never)."""
        params = {"key": _text(key), "ttl": _seconds(value)}
        with self.db.single() as conn:
            conn.execute(self.db.sql.meta_expire, params)

    # -- leased tasks: fenced writes (the module's docstring) --------------------

    def _store_result(
        self,
        task_id: str,
        result: Any,
        state: str,
        traceback: Any = None,
        request: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Celery's ``_store_result``; for a leased task's request, fenced by its token."""
        writer = writer_of(request)
        if writer is None:
            return super()._store_result(
                task_id, result, state, traceback, request=request, **kwargs
            )
        if state == states.SUCCESS and writer.committed_children == len(_children(request)):
            logger.debug("result backend: %s's SUCCESS was written by its commit", task_id)
            return result
        meta = self._task_meta(task_id, result, state, traceback, request)
        key = _text(self.get_key_for_task(task_id))
        keys = list(writer.keys)
        params = {
            "key": key,
            "value": _text(self.encode(meta)),
            "ttl": _seconds(self._expires(state)),
            "token": writer.token,
            "task_id": bytes_to_str(task_id),  # type: ignore[no-untyped-call]
            "keys": json.dumps(keys) if self.db.is_sqlite else keys,
        }
        kind = "success" if state == states.SUCCESS else "final" if state in _FINAL else "active"
        with self.db.single() as conn:
            written = conn.execute(self.db.sql.meta_fenced[kind], params).first()
        writer.refused = written is None
        if written is None:
            self._refused(key, state, writer.token)
        return result

    def success_record(self, task_id: str, result: Any, request: Any) -> MetaRecord:
        """The SUCCESS record Celery's tracer would write for ``request`` returning
        ``result`` (its own ``encode_result``, ``_get_result_meta`` and ``encode``:
        ``result_extended`` fields, children, ``date_done`` now), for the fenced
        commit to write in its transaction."""
        encoded = self.encode_result(result, states.SUCCESS)
        meta = self._task_meta(task_id, encoded, states.SUCCESS, None, request)
        return MetaRecord(
            _text(self.get_key_for_task(task_id)),
            _text(self.encode(meta)),
            _seconds(self.expires),
        )

    def _task_meta(
        self, task_id: str, result: Any, state: str, traceback: Any, request: Any
    ) -> dict[str, Any]:
        """The record Celery's key-value ``_store_result`` encodes, made the same way."""
        meta: dict[str, Any] = self._get_result_meta(
            result=result, state=state, traceback=traceback, request=request
        )
        meta["task_id"] = bytes_to_str(task_id)  # type: ignore[no-untyped-call]
        return meta

    def _refused(self, key: str, state: str | None, token: int | None) -> None:
        """Log and count a write the statement refused (never raised: the record stands)."""
        try:
            with self.db.read() as conn:
                found = conn.execute(self.db.sql.meta_fence, {"key": key}).first()
        except StoreUnavailable:
            found = None
        metrics.backend_writes_refused.inc()
        logger.warning(
            "result backend: refused the %s write of %s by token %s: the record holds %s "
            "by token %s",
            state or "-",
            key,
            "-" if token is None else token,
            found.status if found is not None else "?",
            found.token if found is not None else "?",
            extra={
                "action": "backend_write_refused",
                "key": key,
                "state": state,
                "token": token,
                "held_token": found.token if found is not None else None,
            },
        )

    # -- retention -------------------------------------------------------------

    def cleanup(self) -> int:
        """Delete the rows past their expiry, and the due marks of expired chords
        (Celery beat's ``celery.backend_cleanup``)."""
        with self.db.transaction() as conn:
            deleted = conn.execute(self.db.sql.meta_cleanup).rowcount
            conn.execute(self.db.sql.chord_due_cleanup)
        logger.info(
            "result backend: deleted %d expired record(s)",
            deleted,
            extra={"action": "backend_cleanup", "deleted": deleted},
        )
        return int(deleted)
