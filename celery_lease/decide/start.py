"""The decisions up to the body: the claim, the result table's look-up, the start.

Rows ``claim.*``, ``lookup.*``, ``start.*``, ``accepted.*``, ``body.*`` and
``duplicate.*`` of the table in :mod:`celery_lease.decide`.
"""

from __future__ import annotations

from dataclasses import dataclass

from celery_lease.facts import (
    SUCCESS,
    UNREAD,
    Act,
    BackendState,
    Failed,
    Holder,
    Outcome,
    Read,
    Unread,
    outage_countdown,
)

__all__ = [
    "BodyStart",
    "Claim",
    "Duplicate",
    "Lookup",
    "Start",
    "decide_body_start",
    "decide_claim",
    "decide_duplicate",
    "decide_lookup",
    "decide_start",
]


# -- claim ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    task_id: str
    ttl: float
    on_conflict: str
    granted: bool = False
    error: str | None = None  # the claim raised StoreUnavailable
    retry_left: bool = False  # lease_store_retry not spent
    wait_left: bool = False  # lease_wait_timeout not spent
    holder: Holder | Failed | Unread | None = UNREAD  # Failed: as None, a busy key
    commit: bool = False  # the task records its result in the fenced table
    mine: bool | Unread | None = UNREAD  # this task id committed (None: unreadable)
    own_state: BackendState | Unread | None = UNREAD  # None: unreadable


def decide_claim(c: Claim) -> Outcome | Read:
    if c.granted:
        return Outcome("claim.granted", Act.RUN)
    if c.error is not None:
        if c.retry_left:
            return Outcome("claim.retry", Act.RETRY)
        # A copy of finished work (a broker restore, a deferral) must not
        # circulate through the outage: every copy would defer again, and
        # broker reconnects multiply them. The result table can tell.
        done = _done(c)
        if isinstance(done, Read):
            return done
        if done:
            return Outcome("claim.store_done", Act.REJECT_ENDED, DONE)
        reason = f"lease store unavailable: {c.error}"
        return Outcome("claim.store_down", Act.DEFER, reason, countdown=outage_countdown(c.ttl))
    if c.holder is UNREAD:
        return Read.HOLDER
    holder = c.holder if isinstance(c.holder, Holder) else None
    remaining = holder.remaining if holder is not None else c.ttl
    if holder is not None and holder.task_id == c.task_id:
        # A redelivered copy of this very task met its live owner: defer, never
        # drop (acking it would ack the owner's message too); unless the work
        # is done and stored, when the owner's message needs no cover and a
        # copy re-published would only circulate.
        done = _done(c)
        if isinstance(done, Read):
            return done
        if done:
            return Outcome("claim.same_done", Act.REJECT_ENDED, DONE)
        reason = "a copy of this task id holds the lease"
        return Outcome("claim.same_id", Act.DEFER, reason, countdown=remaining)
    if c.on_conflict == "reject":
        return Outcome("claim.reject", Act.REJECT, "conflict", countdown=remaining)
    if c.on_conflict == "wait" and c.wait_left:
        return Outcome("claim.wait", Act.WAIT)
    reason = "another owner holds the lease"
    return Outcome("claim.defer", Act.DEFER, reason, counted=True, countdown=remaining)


DONE = "this task id's result is accepted and stored"


def _done(c: Claim) -> bool | Read:
    """True if this task id's result is accepted and its SUCCESS stored."""
    if c.commit and c.mine is UNREAD:
        return Read.MINE
    if c.mine is True and c.own_state is UNREAD:
        return Read.OWN_STATE
    state = c.own_state
    return c.mine is True and isinstance(state, BackendState) and state.status == SUCCESS


# -- before the body -----------------------------------------------------------------


@dataclass(frozen=True)
class Lookup:
    """The result table's look-up (``ResultTable.prepare``) once it answered or raised."""

    ttl: float
    stale: bool = False  # StaleFencingToken: a newer owner claimed
    error: str | None = None  # StoreUnavailable
    retry_left: bool = False  # the lease leaves time for another try


def decide_lookup(s: Lookup) -> Outcome | None:
    """None: the look-up answered; go on to :func:`decide_start`."""
    if s.stale:
        reason = "a newer owner claimed before the body"
        return Outcome("lookup.stale", Act.DEFER, reason, countdown=outage_countdown(s.ttl))
    if s.error is not None:
        if s.retry_left:
            return Outcome("lookup.retry", Act.RETRY)
        reason = f"result database unavailable: {s.error}"
        return Outcome("lookup.store_down", Act.DEFER, reason, countdown=outage_countdown(s.ttl))
    return None


@dataclass(frozen=True)
class Start:
    ttl: float
    accepted: bool  # the look-up found this task id's accepted result
    duplicate: bool  # once mode: the key's result was accepted
    backend: bool  # results are stored (not ignore_result, a backend enabled)
    late_copy: bool | Unread = UNREAD
    own_state: BackendState | Unread | None = UNREAD  # None: unreadable
    #: True: this task id's accepted row; False: swept, or another task id's
    accepted_row: bool | Failed | Unread = UNREAD


def decide_start(s: Start) -> Outcome | Read:
    if s.accepted:
        return _accepted_redelivery(s)
    if s.late_copy is UNREAD:
        return Read.LATE_COPY
    if s.late_copy and s.backend:
        # A late copy of a task an execution ended as FENCED, LEASE_LOST,
        # duplicate...: run again, it would turn a final FAILURE into SUCCESS.
        if s.own_state is UNREAD:
            return Read.OWN_STATE
        if s.own_state is not None and s.own_state.lease_failure:
            reason = "redelivery of a task that already ended"
            return Outcome("start.ended", Act.REJECT_ENDED, reason)
    if s.duplicate:
        return Outcome("start.duplicate", Act.DUPLICATE)
    return Outcome("start.run", Act.RUN)


def _accepted_redelivery(s: Start) -> Outcome | Read:
    """A late copy of a task whose result was accepted: never run it again, and
    make the backend say what the table says (the committer may have died
    before Celery stored SUCCESS). Read first, write only if needed: a write
    also returns a chord part."""
    reason = "redelivery of an accepted task"
    if not s.backend:
        return Outcome("accepted.no_backend", Act.REJECT_ENDED, reason)
    if s.accepted_row is UNREAD:
        return Read.ACCEPTED_ROW
    if isinstance(s.accepted_row, Failed):
        why = f"result database unavailable: {s.accepted_row.error}"
        return Outcome("accepted.db_down", Act.DEFER, why, countdown=outage_countdown(s.ttl))
    if not s.accepted_row:
        return Outcome("accepted.swept", Act.REJECT_ENDED, reason)
    if s.own_state is UNREAD:
        return Read.OWN_STATE
    if s.own_state is None:
        why = "result backend unavailable"
        return Outcome("accepted.backend_down", Act.DEFER, why, countdown=outage_countdown(s.ttl))
    if s.own_state.status != SUCCESS:
        return Outcome("accepted.store", Act.STORE_ACCEPTED_THEN_REJECT, reason)
    return Outcome("accepted.present", Act.REJECT_ENDED, reason)


@dataclass(frozen=True)
class BodyStart:
    held: bool  # the lease is still valid after the look-up and STARTED


def decide_body_start(s: BodyStart) -> Outcome:
    if not s.held:
        # Run nothing without the lease; the copy claims again (no defer count).
        reason = "the lease lapsed before the body started"
        return Outcome("body.lapsed", Act.REQUEUE, reason)
    return Outcome("body.run", Act.RUN)


@dataclass(frozen=True)
class Duplicate:
    ttl: float
    on_duplicate: str
    accepted_value: bool | Failed | Unread = UNREAD  # read (found or not), or failed


def decide_duplicate(s: Duplicate) -> Outcome | Read:
    if s.on_duplicate != "return":
        return Outcome("duplicate.reject", Act.REJECT, "duplicate")
    if s.accepted_value is UNREAD:
        return Read.ACCEPTED_VALUE
    if isinstance(s.accepted_value, Failed):
        # Not a FAILURE (a later copy would be rejected as "ended"): wait it out.
        why = f"result database unavailable: {s.accepted_value.error}"
        return Outcome("duplicate.db_down", Act.DEFER, why, countdown=outage_countdown(s.ttl))
    reason = "duplicate: returned the accepted result"
    return Outcome("duplicate.return", Act.RETURN_ACCEPTED, reason)
