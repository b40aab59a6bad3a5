"""The fenced commit's two transactions (the reasoning: :mod:`celery_lease.results`).

:func:`commit_colocated`: the leases live in the result database, so one
transaction checks (and releases) the lease rows and inserts.
:func:`commit_remote`: the leases live elsewhere, so the key's fence row is
locked while the lease store is asked, then the row is inserted.
Both return the accepted row's ``accepted_at`` or raise StaleFencingToken /
DuplicateResult with nothing written.

With a :class:`MetaRecord` (the ``lease+`` result backend's table in this
database), the task's SUCCESS record is written by the same transaction as
the accepted row, only if that row is: on PostgreSQL inside the statement
that inserts the result (no round trip added), on SQLite right after it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from celery_lease.exceptions import (
    DuplicateResult,
    LeaseConfigError,
    LeaseError,
    StaleFencingToken,
    StoreUnavailable,
    TaskEnded,
)
from celery_lease.sql import Conn, Database
from celery_lease.sql import queries as q
from celery_lease.sql.dialects import key_params
from celery_lease.stores.base import Lease, LeaseStore

if TYPE_CHECKING:
    from celery_lease.results import ResultTable

__all__ = ["MetaRecord", "commit_colocated", "commit_remote", "insert"]

# The result table's logger: these records are the table's, wherever the code lives.
logger = logging.getLogger("celery_lease.results")


@dataclass(frozen=True)
class MetaRecord:
    """A result backend's record of the committing task (a row of
    ``celery_lease_task_meta``, the ``lease+`` backend's table, in the result
    table's database), written by the commit's transaction with the lease's
    token if, and only if, the commit is accepted.

    ``value`` is the JSON the backend encoded (the caller builds it, e.g.
    ``LeaseBackend.success_record``: this layer knows nothing of Celery);
    ``ttl`` the seconds until it expires, in the database's clock (None: never).
    """

    key: str
    value: str
    ttl: float | None

    def params(self) -> dict[str, Any]:
        """The statements' parameters for this record (beside the result row's)."""
        return {"meta_key": self.key, "meta_value": self.value, "meta_ttl": self.ttl}


def insert(
    db: Database,
    conn: Conn,
    row: dict[str, Any],
    once: bool,
    *,
    commit: bool = False,
    meta: bool = False,
) -> float:
    """Insert the result row (the caller holds the key's lock); its accepted_at.

    ``commit``: the insert ends the transaction (sent with its COMMIT, one
    round trip on PostgreSQL). ``meta``: ``row`` also holds a
    :class:`MetaRecord`'s parameters, written if the row is (PostgreSQL: by
    the insert's own statement; SQLite: by the next one, the transaction
    then ended by the caller's block).

    Raises :class:`DuplicateResult` when nothing was written: once mode found
    an accepted row for the key, or this very commit was accepted earlier
    (:meth:`ResultTable.commit` tells the two apart); :class:`TaskEnded` when
    the task id has an end mark.
    """
    after = meta and db.is_sqlite  # the record as a statement of its own
    sql = db.sql.result_insert_meta[once] if meta and not after else db.sql.result_insert[once]
    inserted = conn.commit_after(sql, row) if commit and not after else conn.execute(sql, row)
    accepted_at = inserted.scalar()
    if accepted_at is None:
        _refused(conn, row)
    if after:
        conn.execute(db.sql.meta_commit, row)
    return float(accepted_at)


def _refused(conn: Conn, row: dict[str, Any]) -> NoReturn:
    """Why the insert wrote nothing: the task id's end mark, else a row of the key."""
    _raise_if_ended(conn, row)
    duplicate = conn.execute(q.RESULT_DUPLICATE, {"key": row["key"]}).scalar()
    raise DuplicateResult(row["key"], None if duplicate is None else int(duplicate))


def _raise_if_ended(conn: Conn, row: dict[str, Any]) -> None:
    """TaskEnded if the refused row's task id has an end mark: reported before a
    duplicate, so its FAILURE stands even in once mode with ``return``."""
    task_id = row["task_id"]
    if task_id is not None:
        marked = conn.execute(q.ENDED_FOR_TASK, {"task_id": task_id}).scalar()
        if marked is not None:  # the token of the copy that ended it: the stale one
            raise TaskEnded(row["key"], int(marked), task_id)


def commit_colocated(
    table: ResultTable,
    lease: Lease,
    row: dict[str, Any],
    mode: str,
    release: bool,
    meta: bool = False,
) -> float:
    """Leases in the result database: check (and release) the lease and insert
    (and write the record, with ``meta``: see :func:`insert`), in one
    transaction; the row's accepted_at."""
    db = table.db
    once = mode == "once"
    if not db.is_sqlite:
        return _commit_colocated_pg(table, lease, row, once, release, meta)
    own = db.sql.result_own_lease(release, len(lease.keys))
    params = key_params(lease.keys)
    params.update(owner_id=lease.owner_id, token=lease.token)
    refused: DuplicateResult | TaskEnded | None = None
    with db.transaction() as conn:
        now = conn.now()
        owned = len(conn.execute(own, {**params, "now": now}).all())
        if owned != len(lease.keys):
            conn.rollback()
            raise StaleFencingToken(
                lease.key,
                lease.token,
                _current_token(table, lease.key),
                "the lease is no longer held by this owner",
            )
        try:
            accepted_at = insert(db, conn, row, once, meta=meta)
        except (DuplicateResult, TaskEnded) as e:
            refused = e  # the release above still commits
    if refused is not None:
        raise refused
    return accepted_at


def _commit_colocated_pg(
    table: ResultTable, lease: Lease, row: dict[str, Any], once: bool, release: bool, meta: bool
) -> float:
    """PostgreSQL: the check, the release and the insert (and the record) in one
    statement, one round trip."""
    n = len(lease.keys)
    statements = q.PG_COMMIT_COLOCATED_META_PY if meta else q.PG_COMMIT_COLOCATED_PY
    if n == 1:
        out = table.db.pg_first(statements[release, once, True], row)
    else:
        params = {**row, "keys": list(lease.keys), "n": n}
        out = table.db.pg_first(statements[release, once, False], params)
    if out is None:  # never: the statement selects one row of scalars
        raise LeaseError("expected exactly one row, the database returned 0")
    owned, duplicate_token, accepted = out
    if int(owned) != n:
        raise StaleFencingToken(
            lease.key,
            lease.token,
            _current_token(table, lease.key),
            "the lease is no longer held by this owner",
        )
    if accepted is None:
        with table.db.single() as conn:
            _raise_if_ended(conn, row)
        raise DuplicateResult(lease.key, None if duplicate_token is None else int(duplicate_token))
    return float(accepted)


def commit_remote(
    table: ResultTable,
    lease: Lease,
    row: dict[str, Any],
    mode: str,
    release: bool,
    meta: bool = False,
) -> float:
    """Leases elsewhere: lock the fence row, ask the lease store while holding the
    lock, insert (and write the record, with ``meta``); the row's accepted_at."""
    store = table.store
    if store is None:
        raise LeaseConfigError("a ResultTable needs the lease store to commit leases from it")
    db = table.db
    lock = db.sql.lock_fence
    released = False
    try:
        with db.transaction() as conn:
            fence = conn.execute(lock, {"key": lease.key}).scalar()
            if fence is None or int(fence) < lease.token:
                # Never registered (or registration lost): register now, under the lock.
                conn.execute(
                    q.RAISE_FENCE,
                    {"key": lease.key, "token": lease.token, "now": conn.now()},
                )
                conn.execute(lock, {"key": lease.key}).scalar()
            elif int(fence) > lease.token:
                conn.rollback()
                raise StaleFencingToken(
                    lease.key, lease.token, int(fence), "a newer owner claimed the key"
                )
            # The lease store's answer, while this transaction holds the fence row.
            still_owner = store.release(lease) if release else store.renew(lease)
            released = release and still_owner
            if not still_owner:
                conn.rollback()
                raise StaleFencingToken(
                    lease.key,
                    lease.token,
                    store.fence_token(lease.key),
                    "the lease expired or was taken over before the commit",
                )
            return insert(db, conn, row, mode == "once", commit=True, meta=meta)
    except DuplicateResult:
        if release and not released:
            _release_quietly(store, lease)
        raise


def _release_quietly(store: LeaseStore, lease: Lease) -> None:
    try:
        store.release(lease)
    except StoreUnavailable:
        logger.warning(
            "could not release after a duplicate; it will expire: key=%s token=%s",
            lease.key,
            lease.token,
            extra={"action": "release_failed", "lease_key": lease.key, "token": lease.token},
        )


def _current_token(table: ResultTable, key: str) -> int | None:
    if table.store is not None:
        return table.store.fence_token(key)
    return table.fence(key)
