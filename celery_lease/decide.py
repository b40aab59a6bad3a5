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
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from celery_lease.facts import (
    FAILURE,
    SUCCESS,
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
    Unread,
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


def _default(ttl: float) -> float:
    """The countdown of a deferral that waits for no lease (an outage)."""
    return min(ttl, 5.0)


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
        return Outcome("claim.store_down", Act.DEFER, reason, countdown=_default(c.ttl))
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
        return Outcome("lookup.stale", Act.DEFER, reason, countdown=_default(s.ttl))
    if s.error is not None:
        if s.retry_left:
            return Outcome("lookup.retry", Act.RETRY)
        reason = f"result database unavailable: {s.error}"
        return Outcome("lookup.store_down", Act.DEFER, reason, countdown=_default(s.ttl))
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
        return Outcome("accepted.db_down", Act.DEFER, why, countdown=_default(s.ttl))
    if not s.accepted_row:
        return Outcome("accepted.swept", Act.REJECT_ENDED, reason)
    if s.own_state is UNREAD:
        return Read.OWN_STATE
    if s.own_state is None:
        why = "result backend unavailable"
        return Outcome("accepted.backend_down", Act.DEFER, why, countdown=_default(s.ttl))
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
        return Outcome("duplicate.db_down", Act.DEFER, why, countdown=_default(s.ttl))
    reason = "duplicate: returned the accepted result"
    return Outcome("duplicate.return", Act.RETURN_ACCEPTED, reason)


# -- after the body ------------------------------------------------------------------


def _leave_to_copy(
    task_id: str,
    ttl: float,
    backend: bool,
    mine: bool | Unread | None,
    own_state: BackendState | Unread | None,
    holder: Holder | Failed | None,
) -> Outcome | Read | None:
    """Whether another execution of this task id owns the outcome (None: no).

    A copy that lost its lease must never write the backend state of a task id
    another copy finished (a stalled copy resuming with an error or a Retry
    after copy 2 stored SUCCESS), nor of one another copy is running. A fact
    that cannot be read (``mine`` None, the holder Failed) may be exactly that:
    not a "no".
    """
    if mine is UNREAD:
        return Read.MINE
    if mine:
        note = "another execution of this task id committed"
        if backend:
            if own_state is UNREAD:
                return Read.OWN_STATE
            if own_state is not None and own_state.status != SUCCESS:
                # It may have died before storing SUCCESS: a copy stores it.
                why = "store the accepted result"
                return Outcome("copy.unstored", Act.DEFER, why, countdown=_default(ttl), note=note)
        return Outcome("copy.committed", Act.LEAVE_TO_COPY, note=note)
    if isinstance(holder, Holder) and holder.live and holder.task_id == task_id:
        # Maybe a restored copy of this very message, sharing its delivery tag,
        # whose unacked entry this execution's ack would remove: leave a
        # deferred copy behind as its crash cover.
        note = "another execution of this task id holds it"
        why = "a copy of this task id holds the lease"
        return Outcome("copy.holds", Act.DEFER, why, countdown=holder.remaining, note=note)
    if mine is None or isinstance(holder, Failed):
        why = "cannot tell whether a copy of this task id committed or holds the lease"
        return Outcome("copy.unreadable", Act.DEFER, why, countdown=_default(ttl))
    return None


@dataclass(frozen=True)
class BodyError:
    """The body raised (an error, ``Retry``)."""

    task_id: str
    ttl: float
    backend: bool  # results are stored (not ignore_result, a backend enabled)
    held: bool  # still the owner
    token: int
    holder: Holder | Failed | Unread | None = UNREAD
    mine: bool | Unread | None = UNREAD  # None: cannot tell
    own_state: BackendState | Unread | None = UNREAD


def decide_body_error(s: BodyError) -> Outcome | Read:
    if s.held:
        return Outcome("error.owner", Act.RAISE)
    if s.holder is UNREAD:
        return Read.HOLDER
    # This execution's own lease, not yet expired in the store, is no copy.
    holder = None if isinstance(s.holder, Holder) and s.holder.token == s.token else s.holder
    leave = _leave_to_copy(s.task_id, s.ttl, s.backend, s.mine, s.own_state, holder)
    if leave is not None:
        return leave
    return Outcome("error.stands", Act.RAISE)


class CommitResult(enum.Enum):
    ACCEPTED = "accepted"
    STALE = "stale"
    DUPLICATE = "duplicate"
    ENDED = "ended"  # TaskEnded: this task id has an end mark
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Commit:
    result: CommitResult
    error: str | None = None
    retry_left: bool = False


def decide_commit(s: Commit) -> Outcome:
    if s.result is CommitResult.ACCEPTED:
        return Outcome("commit.accepted", Act.RUN)
    if s.result is CommitResult.STALE:
        return Outcome("commit.fenced", Act.NOT_DONE)
    if s.result is CommitResult.DUPLICATE:
        return Outcome("commit.duplicate", Act.DUPLICATE)
    if s.result is CommitResult.ENDED:
        return Outcome("commit.ended", Act.STORE_FAILURE)
    if s.retry_left:
        return Outcome("commit.retry", Act.RETRY)
    # The outcome is unknown and the lease has run out: redo. If the commit
    # did land, the re-run is rejected as a redelivery.
    note = f"store unavailable at commit: {s.error}"
    return Outcome("commit.unknown", Act.REQUEUE, "commit outcome unknown", note=note)


@dataclass(frozen=True)
class NotDone:
    """The body ran but its result was not accepted (fenced, or the lease was lost)."""

    task_id: str
    ttl: float
    backend: bool  # results are stored (not ignore_result, a backend enabled)
    token: int | None
    newer: Newer | Failed | Unread | None = UNREAD  # Failed: unreadable
    holder: Holder | Failed | Unread | None = UNREAD
    mine: bool | Unread | None = UNREAD  # None: unreadable
    own_state: BackendState | Unread | None = UNREAD
    holder_committed: bool | Unread | None = UNREAD
    holder_state: BackendState | Unread | None = UNREAD


def decide_not_done(s: NotDone) -> Outcome | Read:
    if s.newer is UNREAD or s.holder is UNREAD:
        return Read.NEWER_AND_HOLDER
    newer = s.newer if isinstance(s.newer, Newer) else None
    # The key's newest row of this very task id: it committed, no read needed.
    mine = True if newer is not None and newer.task_id == s.task_id else s.mine
    leave = _leave_to_copy(s.task_id, s.ttl, s.backend, mine, s.own_state, s.holder)
    if leave is not None:
        return leave
    if newer is not None and s.token is not None and newer.token > s.token:
        return Outcome("not_done.newer", Act.STORE_FAILURE)
    if isinstance(s.holder, Holder) and s.holder.live:
        ended = _finished_elsewhere(s, s.holder, newer)
        if isinstance(ended, Read):
            return ended
        if not ended:
            return Outcome("not_done.taken_over", Act.STORE_FAILURE)
        # The holder is a late copy of a task that already ended: its own
        # look-up rejects it, so it will not do this key's work either.
        return _requeue("not_done.holder_ended")
    return _requeue("not_done.nobody")


def _requeue(row: str) -> Outcome:
    note = "lease lapsed with no new owner: re-queued"
    return Outcome(row, Act.REQUEUE, "lease lapsed with no new owner", note=note)


def _finished_elsewhere(s: NotDone, holder: Holder, newer: Newer | None) -> bool | Read:
    """True if ``holder`` is a late copy of a task that already ended: the
    checks of :func:`decide_start`, here on the holder's task id."""
    if holder.task_id is None:
        return False
    if newer is not None and newer.task_id == holder.task_id:
        return True
    if s.holder_committed is UNREAD:
        return Read.HOLDER_COMMITTED
    if s.holder_committed:
        return True
    if not s.backend:
        return False
    if s.holder_state is UNREAD:
        return Read.HOLDER_STATE
    return s.holder_state is not None and s.holder_state.lease_failure


@dataclass(frozen=True)
class End:
    """A FAILURE to store after the body: first the task id's end (result_end)."""

    ttl: float
    fenced: bool  # the task commits to the result table and stores its state
    take_over: bool  # decided because another task id holds the key
    answer: EndAnswer | Failed | Unread = UNREAD
    own_state: BackendState | Unread | None = UNREAD  # None: unreadable


def decide_end(s: End) -> Outcome | Read:
    if not s.fenced:
        return Outcome("end.unfenced", Act.STORE_FAILURE)
    if s.answer is UNREAD:
        return Read.END
    if isinstance(s.answer, Failed):
        why = f"result database unavailable: {s.answer.error}"
        return Outcome("end.unavailable", Act.DEFER, why, countdown=_default(s.ttl))
    ended = s.answer.ended
    if ended is Ended.MARKED:
        return Outcome("end.marked", Act.STORE_FAILURE)
    if ended is Ended.ALREADY:
        return _ended_before(s)
    if ended is Ended.ACCEPTED:
        # A copy that finds the row accepted stores its SUCCESS if it is missing.
        why = "another execution of this task id committed"
        return Outcome("end.accepted", Act.DEFER, why, countdown=_default(s.ttl))
    if ended is Ended.COPY_HOLDS:
        why = "a copy of this task id holds the lease"
        return Outcome("end.copy_holds", Act.DEFER, why, countdown=s.answer.remaining)
    return _requeue("end.holder_gone")


def _ended_before(s: End) -> Outcome | Read:
    """Another copy recorded the end: its FAILURE stands, unless it died first.
    Read first, write only if needed: a second FAILURE could differ from the first."""
    if s.own_state is UNREAD:
        return Read.OWN_STATE
    if s.own_state is None:
        why = "result backend unavailable"
        return Outcome("end.backend_down", Act.DEFER, why, countdown=_default(s.ttl))
    if s.own_state.status in (SUCCESS, FAILURE):
        return Outcome("end.stored", Act.REJECT_ENDED, "its task id has ended")
    return Outcome("end.unstored", Act.STORE_FAILURE)


# -- deferring -----------------------------------------------------------------------


@dataclass(frozen=True)
class Defer:
    counted: bool
    deferrals: int  # counted deferrals so far
    defer_max: int
    countdown: float
    reason: str


def decide_defer(s: Defer) -> Outcome:
    if s.counted and s.deferrals >= s.defer_max:
        why = f"deferred {s.deferrals} times behind other tasks (lease_defer_max)"
        return Outcome("defer.limit", Act.REJECT, why, countdown=s.countdown)
    if s.counted:
        return Outcome(
            "defer.counted", Act.DEFER, s.reason, True, s.countdown, deferrals=s.deferrals + 1
        )
    deferrals = s.deferrals
    return Outcome("defer.uncounted", Act.DEFER, s.reason, False, s.countdown, deferrals=deferrals)


#: What a copy replaces when its publisher could not read the marker.
ANY_MARKER = "*"


@dataclass(frozen=True)
class Republish:
    """A copy about to defer. Every published copy has its own defer id; the
    store's marker names the newest one, so of two identical copies (a broker
    restore) only the one whose successor took the marker goes on."""

    defer_id: str | None  # this copy's (None: the task's first message)
    #: the marker value this copy's publisher read: the marker this copy
    #: stands for while the publisher's move of it did not land (ANY_MARKER:
    #: its publisher could not read it)
    replaces: str | None = None
    marker: str | Failed | Unread | None = UNREAD  # the defer id the marker names


def decide_republish(s: Republish) -> Outcome | Read:
    if s.marker is UNREAD:
        return Read.MARKER
    # A marker unreadable: a second copy beats losing the work.
    if isinstance(s.marker, Failed):
        return Outcome("republish.publish", Act.PUBLISH, replaces=ANY_MARKER)
    mine = (s.defer_id, s.replaces)
    if s.marker is not None and s.replaces != ANY_MARKER and s.marker not in mine:
        return Outcome("republish.queued", Act.DROP, "a deferred copy is already queued")
    return Outcome("republish.publish", Act.PUBLISH, replaces=s.marker)
