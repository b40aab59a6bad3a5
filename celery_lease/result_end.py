"""The end mark: a FAILURE celery-lease decided for a task id, recorded before it is stored.

When a leased task's result is not accepted (its commit fenced, its lease
taken over) and celery-lease decides that the task id ends FAILURE, another
copy of the same task id (a redelivery, or a first delivery the broker held
back) may still be running with a newer grant. Were that copy's commit
accepted after the FAILURE was stored, the task id's state would flip from
FAILURE to SUCCESS; stored in the other order, the FAILURE would cover an
accepted result. So the end is recorded first, in the result database, by a
transaction that holds the lock every commit of the key takes (the key's
fence row; with the leases in this database, the key's lease row), and every
commit refuses a row of a task id with a mark (``queries._ENDED_GUARD``,
:class:`~celery_lease.exceptions.TaskEnded`)::

    A (T0, token 1) pauses past its TTL; B (T1) claims token 2
    A: not done, taken over by T1 -> end mark T0 (under the key's lock) -> FAILURE
    C (T0's redelivery) claims token 3, runs, commits -> refused: T0 has ended

Under that lock the mark is refused where it would be wrong:

- ``accepted``: a copy of this task id was accepted first (its SUCCESS is the outcome);
- ``copy_holds``: a copy of this task id holds the key with another grant, or,
  with the leases in the result database, held it and has not released it (it
  decides);
- ``holder_gone``: for a take-over, the key has no live holder any more, or its
  holder is a copy of a task id that has ended too: nobody would then do the
  key's work, so this task runs again instead of ending.

A task id marked before answers ``already``: the copy that marked it stores
its FAILURE, or (if it died first) the copy that finds the mark does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from celery_lease.exceptions import LeaseConfigError
from celery_lease.sql import Conn
from celery_lease.sql import queries as q
from celery_lease.stores.base import Lease, LeaseRecord
from celery_lease.stores.sql import _record

if TYPE_CHECKING:
    from celery_lease.results import ResultTable

__all__ = ["ACCEPTED", "ALREADY", "COPY_HOLDS", "HOLDER_GONE", "MARKED", "EndMark", "end_task"]

MARKED = "marked"
ALREADY = "already"
ACCEPTED = "accepted"
COPY_HOLDS = "copy_holds"
HOLDER_GONE = "holder_gone"


@dataclass(frozen=True)
class EndMark:
    """What recording a task id's end answered: ``kind`` (see the module), and
    for ``copy_holds`` the seconds left of that copy's lease."""

    kind: str
    remaining: float = 0.0


def end_task(table: ResultTable, lease: Lease, task_id: str, *, take_over: bool) -> EndMark:
    """Record ``task_id``'s end for ``lease``'s key, unless a check refuses it.

    ``take_over``: the FAILURE was decided because another task id holds the
    key (not because a newer result of another task id was accepted), so the
    holder must still be there, and not have ended itself.
    """
    if table.colocated:
        return end_colocated(table, lease, task_id, take_over)
    return end_remote(table, lease, task_id, take_over)


def end_remote(table: ResultTable, lease: Lease, task_id: str, take_over: bool) -> EndMark:
    """Leases elsewhere: hold the key's fence row (the commit's lock), ask the
    lease store for the holder while holding it, check, mark."""
    store = table.store
    if store is None:
        raise LeaseConfigError("a ResultTable needs the lease store to end a task of its leases")
    db = table.db
    with db.transaction() as conn:
        if conn.execute(db.sql.lock_fence, {"key": lease.key}).scalar() is None:
            # No fence row yet: make one (a token is never lowered), so there is a row to lock.
            conn.execute(q.RAISE_FENCE, {"key": lease.key, "token": lease.token, "now": conn.now()})
            conn.execute(db.sql.lock_fence, {"key": lease.key}).scalar()
        # The holder while this transaction holds the fence row: a newer owner
        # registers there before its body, and its commit locks it.
        holder = store.inspect(lease.key)
        return _mark(conn, lease, task_id, take_over, holder, colocated=False)


def end_colocated(table: ResultTable, lease: Lease, task_id: str, take_over: bool) -> EndMark:
    """Leases in this database: lock the key's lease row (the colocated commit
    updates it in its one statement), read the holder from it, check, mark."""
    with table.db.transaction() as conn:
        row = conn.execute(table.db.sql.lease_row, {"key": lease.key}).first()
        holder = None if row is None else _record(row)
        return _mark(conn, lease, task_id, take_over, holder, colocated=True)


def _mark(
    conn: Conn,
    lease: Lease,
    task_id: str,
    take_over: bool,
    holder: LeaseRecord | None,
    *,
    colocated: bool,
) -> EndMark:
    """The checks and the insert, each a statement of its own after the lock, so
    each sees every commit and mark that held the lock before."""
    if _has_ended(conn, task_id):
        return EndMark(ALREADY)
    if conn.execute(q.RESULT_FOR_TASK, {"task_id": task_id}).first() is not None:
        return EndMark(ACCEPTED)
    # A copy of this task id that holds the key decides its outcome itself. With
    # the leases in this database, so does one whose lease row ran out
    # unreleased: its commit is one statement, which judges the lease by the
    # clock and snapshot of its start, before it waits for the row this
    # transaction locked, so it would neither see this mark nor find its lease
    # run out. Elsewhere the commit reads the store after its lock, so a run-out
    # lease is no holder, whether or not the store has deleted its record yet
    # (Redis deletes a hash up to a millisecond after its expiry; a SQL lease
    # store keeps the row).
    if holder is not None and (holder.live or (colocated and holder.owner_id is not None)):
        if holder.task_id == task_id and holder.token != lease.token:
            return EndMark(COPY_HOLDS, holder.remaining)
    if holder is not None and holder.live:
        if take_over and holder.task_id is not None and _has_ended(conn, holder.task_id):
            return EndMark(HOLDER_GONE)
    elif take_over:
        return EndMark(HOLDER_GONE)
    params = {"task_id": task_id, "key": lease.key, "token": lease.token, "now": conn.now()}
    conn.execute(q.ENDED_INSERT, params)
    return EndMark(MARKED)


def _has_ended(conn: Conn, task_id: str) -> bool:
    return conn.execute(q.ENDED_FOR_TASK, {"task_id": task_id}).first() is not None
