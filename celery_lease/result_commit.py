"""The fenced commit's two transactions (the reasoning: :mod:`celery_lease.results`).

:func:`commit_colocated`: the leases live in the result database, so one
transaction checks (and releases) the lease rows and inserts.
:func:`commit_remote`: the leases live elsewhere, so the key's fence row is
locked while the lease store is asked, then the row is inserted.
Both return the accepted row's ``accepted_at`` or raise StaleFencingToken /
DuplicateResult with nothing written.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery_lease.exceptions import (
    DuplicateResult,
    LeaseConfigError,
    LeaseError,
    StaleFencingToken,
    StoreUnavailable,
)
from celery_lease.sql import Conn, Database
from celery_lease.sql import queries as q
from celery_lease.sql.dialects import key_params
from celery_lease.stores.base import Lease, LeaseStore

if TYPE_CHECKING:
    from celery_lease.results import ResultTable

__all__ = ["commit_colocated", "commit_remote", "insert"]

# The result table's logger: these records are the table's, wherever the code lives.
logger = logging.getLogger("celery_lease.results")


def insert(
    db: Database, conn: Conn, row: dict[str, Any], once: bool, *, commit: bool = False
) -> float:
    """Insert the result row (the caller holds the key's lock); its accepted_at.

    ``commit``: the insert ends the transaction (sent with its COMMIT, one
    round trip on PostgreSQL).

    Raises :class:`DuplicateResult` when nothing was written: once mode found
    an accepted row for the key, or this very commit was accepted earlier
    (:meth:`ResultTable.commit` tells the two apart).
    """
    sql = db.sql.result_insert[once]
    inserted = conn.commit_after(sql, row) if commit else conn.execute(sql, row)
    accepted_at = inserted.scalar()
    if accepted_at is None:
        duplicate = conn.execute(q.RESULT_DUPLICATE, {"key": row["key"]}).scalar()
        raise DuplicateResult(row["key"], None if duplicate is None else int(duplicate))
    return float(accepted_at)


def commit_colocated(
    table: ResultTable, lease: Lease, row: dict[str, Any], mode: str, release: bool
) -> float:
    """Leases in the result database: check (and release) the lease and insert,
    in one transaction; the row's accepted_at."""
    db = table.db
    once = mode == "once"
    if not db.is_sqlite:
        return _commit_colocated_pg(table, lease, row, once, release)
    own = db.sql.result_own_lease(release, len(lease.keys))
    params = key_params(lease.keys)
    params.update(owner_id=lease.owner_id, token=lease.token)
    duplicate: DuplicateResult | None = None
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
            accepted_at = insert(db, conn, row, once)
        except DuplicateResult as e:
            duplicate = e  # the release above still commits
    if duplicate is not None:
        raise duplicate
    return accepted_at


def _commit_colocated_pg(
    table: ResultTable, lease: Lease, row: dict[str, Any], once: bool, release: bool
) -> float:
    """PostgreSQL: the check, the release and the insert in one statement, one round trip."""
    n = len(lease.keys)
    if n == 1:
        out = table.db.pg_first(q.PG_COMMIT_COLOCATED_PY[release, once, True], row)
    else:
        params = {**row, "keys": list(lease.keys), "n": n}
        out = table.db.pg_first(q.PG_COMMIT_COLOCATED_PY[release, once, False], params)
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
        raise DuplicateResult(lease.key, None if duplicate_token is None else int(duplicate_token))
    return float(accepted)


def commit_remote(
    table: ResultTable, lease: Lease, row: dict[str, Any], mode: str, release: bool
) -> float:
    """Leases elsewhere: lock the fence row, ask the lease store while holding the
    lock, insert; the row's accepted_at."""
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
            return insert(db, conn, row, mode == "once", commit=True)
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
