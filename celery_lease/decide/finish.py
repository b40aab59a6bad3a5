"""The decisions after the body: its error, the commit, a result not accepted, the end.

Rows ``error.*``, ``copy.*``, ``commit.*``, ``not_done.*`` and ``end.*`` of the
table in :mod:`celery_lease.decide`.
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
    outage_countdown,
)

__all__ = [
    "BodyError",
    "Commit",
    "CommitResult",
    "End",
    "NotDone",
    "decide_body_error",
    "decide_commit",
    "decide_end",
    "decide_not_done",
]


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
                return Outcome(
                    "copy.unstored", Act.DEFER, why, countdown=outage_countdown(ttl), note=note
                )
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
        return Outcome("copy.unreadable", Act.DEFER, why, countdown=outage_countdown(ttl))
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
        return Outcome("end.unavailable", Act.DEFER, why, countdown=outage_countdown(s.ttl))
    ended = s.answer.ended
    if ended is Ended.MARKED:
        return Outcome("end.marked", Act.STORE_FAILURE)
    if ended is Ended.ALREADY:
        return _ended_before(s)
    if ended is Ended.ACCEPTED:
        # A copy that finds the row accepted stores its SUCCESS if it is missing.
        why = "another execution of this task id committed"
        return Outcome("end.accepted", Act.DEFER, why, countdown=outage_countdown(s.ttl))
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
        return Outcome("end.backend_down", Act.DEFER, why, countdown=outage_countdown(s.ttl))
    if s.own_state.status in (SUCCESS, FAILURE):
        return Outcome("end.stored", Act.REJECT_ENDED, "its task id has ended")
    return Outcome("end.unstored", Act.STORE_FAILURE)
