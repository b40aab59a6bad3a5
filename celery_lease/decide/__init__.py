"""What a leased task does at each point of its execution: the decisions as code.

Pure functions, no I/O. Each takes the facts known at one point (a frozen
dataclass) and returns an :class:`Outcome`, or a :class:`Read` naming the one
fact it needs next. The executor (``celery_lease.execution``) performs that
read, fills the fact in and asks again, so the reads happen in the order and
number the decisions need them, no more: a first delivery never reads the
result backend, the happy path adds no round trip. One line per row
(``row  facts -> outcome``; "default" is the countdown of a deferral that
waits for no lease, ``min(ttl, 5)``; busy deferrals wait the holder's
remaining lease; a REJECT stores a FAILURE, a REJECT_ENDED leaves the backend
untouched; copy.* rows apply after a raised body and a refused commit alike)::

    claim.granted         lease granted -> RUN
    claim.retry           store unavailable, lease_store_retry left -> RETRY
    claim.store_down      store unavailable past lease_store_retry -> DEFER uncounted, default
    claim.store_done      store unavailable, this task id accepted, backend SUCCESS -> REJECT_ENDED
    claim.same_done       busy by this task id, accepted, backend SUCCESS -> REJECT_ENDED
    claim.same_id         busy by this task id -> DEFER uncounted, holder's remaining
    claim.reject          busy by another task id, reject -> REJECT conflict
    claim.wait            busy by another task id, wait, time left -> WAIT, claim again
    claim.defer           busy by another task id, defer (or the wait over) -> DEFER counted
    lookup.stale          a newer owner claimed before the look-up -> DEFER uncounted, default
    lookup.retry          result db unavailable, lease time left -> RETRY
    lookup.store_down     result db unavailable, no lease time left -> DEFER uncounted, default
    start.run             nothing accepted, no lease outcome (or a first delivery) -> RUN
    start.ended           late copy, backend FAILURE is a LeaseError -> REJECT_ENDED
    start.duplicate       once mode, the key's result accepted -> DUPLICATE
    accepted.no_backend   this task id accepted, no result backend -> REJECT_ENDED
    accepted.db_down      this task id accepted, its row unreadable -> DEFER uncounted, default
    accepted.swept        this task id accepted, its row swept -> REJECT_ENDED
    accepted.backend_down this task id accepted, backend unreadable -> DEFER uncounted, default
    accepted.store        this task id accepted, backend lacks SUCCESS -> STORE_ACCEPTED_THEN_REJECT
    accepted.present      this task id accepted, backend has SUCCESS -> REJECT_ENDED
    body.lapsed           the lease lapsed before the body began -> REQUEUE
    body.run              the lease held when the body begins -> RUN
    duplicate.reject      lease_on_duplicate reject -> REJECT duplicate
    duplicate.db_down     return, the accepted value unreadable -> DEFER uncounted, default
    duplicate.return      return -> RETURN_ACCEPTED
    error.owner           body raised, the lease still held -> RAISE (Celery stores it)
    error.stands          body raised, lease lost, no copy of this task id owns it -> RAISE
    copy.committed        lease lost, this task id committed elsewhere -> LEAVE_TO_COPY
    copy.unstored         lease lost, committed elsewhere, no SUCCESS -> DEFER uncounted, default
    copy.holds            lease lost, a copy of this task id holds the key -> DEFER uncounted
    copy.unreadable       lease lost, its row or the holder unreadable -> DEFER uncounted, default
    commit.accepted       commit accepted -> RUN (return the value)
    commit.fenced         commit refused, a newer token -> NOT_DONE FENCED
    commit.duplicate      commit refused, once mode, the key's result accepted -> DUPLICATE
    commit.retry          store unavailable at commit, lease time left -> RETRY
    commit.unknown        store unavailable at commit, lease ran out -> REQUEUE
    commit.ended          commit refused, this task id has ended -> STORE_FAILURE (end.*)
    not_done.newer        not done, another task id's newer result accepted -> STORE_FAILURE
    not_done.taken_over   not done, a live holder that has not ended -> STORE_FAILURE
    not_done.holder_ended not done, the live holder a late copy of an ended task -> REQUEUE
    not_done.nobody       not done, nobody newer did or does the work -> REQUEUE
    end.unfenced          a FAILURE to store, the task records no result -> STORE_FAILURE
    end.marked            the task id's end recorded under the key's lock -> STORE_FAILURE
    end.stored            recorded before, the backend holds a final state -> REJECT_ENDED
    end.unstored          recorded before, no final state stored yet -> STORE_FAILURE
    end.backend_down      recorded before, the backend unreadable -> DEFER uncounted, default
    end.accepted          not recorded: a copy of this task id accepted -> DEFER uncounted, default
    end.copy_holds        not recorded: a copy of this task id holds the key -> DEFER uncounted
    end.holder_gone       not recorded: the taker gone, or its task id ended -> REQUEUE
    end.unavailable       result db unavailable for the end -> DEFER uncounted, default
    defer.limit           counted, lease_defer_max reached -> REJECT LeaseNotAcquired
    defer.counted         behind another task id's lease -> DEFER, deferrals + 1
    defer.uncounted       behind this task id, or an outage -> DEFER, deferrals unchanged
    republish.queued      the marker names a newer copy of this task id -> DROP
    republish.publish     the marker names this copy, or what it replaces, or none -> PUBLISH

"End": a STORE_FAILURE after the body (``not_done.newer``, ``not_done.taken_over``,
``commit.ended``) is stored only once the task id's end is recorded in the
result table (``end.marked``), where every commit of the key refuses it after:
another copy of the task id can no longer be accepted over the FAILURE.
"Uncounted" deferrals do not spend ``lease_defer_max``: it ends an endless
conflict with *other* task ids; waiting behind a copy of this very task id, or
out an unreachable store or result database, only delays the work.
"Late copy": anything but a task id's first delivery (a redelivery, a
re-publish, a retry), the only copies that can meet their own end. A holder
that is a late copy of a task that ended (its result accepted, or a FAILURE
celery-lease decided) is no take-over: it will be rejected, not do the work.

The rows are coded in three modules, by the point of the execution they
decide at: :mod:`~celery_lease.decide.start` (up to the body),
:mod:`~celery_lease.decide.finish` (after it) and
:mod:`~celery_lease.decide.deferral`; their vocabulary is
:mod:`celery_lease.facts`. This package gathers them.
"""

from __future__ import annotations

from celery_lease.decide.deferral import (
    ANY_MARKER,
    Defer,
    Republish,
    decide_defer,
    decide_republish,
)
from celery_lease.decide.finish import (
    BodyError,
    Commit,
    CommitResult,
    End,
    NotDone,
    decide_body_error,
    decide_commit,
    decide_end,
    decide_not_done,
)
from celery_lease.decide.start import (
    BodyStart,
    Claim,
    Duplicate,
    Lookup,
    Start,
    decide_body_start,
    decide_claim,
    decide_duplicate,
    decide_lookup,
    decide_start,
)
from celery_lease.facts import (
    UNREAD,
    Act,
    BackendState,
    EndAnswer,
    Ended,
    Failed,
    Holder,
    Newer,
    Outcome,
    Read,
)

__all__ = [
    "ANY_MARKER",
    "UNREAD",
    "Act",
    "BackendState",
    "BodyError",
    "BodyStart",
    "Claim",
    "Commit",
    "CommitResult",
    "Defer",
    "Duplicate",
    "End",
    "EndAnswer",
    "Ended",
    "Failed",
    "Holder",
    "Lookup",
    "Newer",
    "NotDone",
    "Outcome",
    "Read",
    "Republish",
    "Start",
    "decide_body_error",
    "decide_body_start",
    "decide_claim",
    "decide_commit",
    "decide_defer",
    "decide_duplicate",
    "decide_end",
    "decide_lookup",
    "decide_not_done",
    "decide_republish",
    "decide_start",
]
