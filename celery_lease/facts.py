"""The vocabulary of the task's decisions (``celery_lease.decide``).

What a decision can ask for (:class:`Read`), what it can decide (:class:`Act`
in an :class:`Outcome`), and the facts a read brings back. Pure data, no I/O:
the executor (``celery_lease.execution``, ``celery_lease.reads``) fills them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: celery.states' names, spelled out: the decisions import nothing of Celery.
SUCCESS = "SUCCESS"
FAILURE = "FAILURE"

__all__ = [
    "FAILURE",
    "SUCCESS",
    "UNREAD",
    "Act",
    "BackendState",
    "EndAnswer",
    "Ended",
    "Failed",
    "Holder",
    "Newer",
    "Outcome",
    "Read",
    "Unread",
    "outage_countdown",
]


class Unread(enum.Enum):
    """A fact not read yet."""

    UNREAD = "unread"


UNREAD = Unread.UNREAD


class Read(enum.Enum):
    """The fact a decision needs next (the value: the field(s) it fills)."""

    HOLDER = "holder"  # the key's holder record (store.inspect)
    LATE_COPY = "late_copy"  # whether this message may be a late copy
    OWN_STATE = "own_state"  # this task id's backend state
    ACCEPTED_ROW = "accepted_row"  # this task id's accepted row (results.get)
    ACCEPTED_VALUE = "accepted_value"  # the key's accepted value (results.accepted)
    MINE = "mine"  # whether this task id committed (results.for_task)
    NEWER_AND_HOLDER = "newer_and_holder"  # the key's accepted result, then its holder
    HOLDER_COMMITTED = "holder_committed"  # whether the holder's task id committed
    HOLDER_STATE = "holder_state"  # the holder's task id's backend state
    MARKER = "marker"  # the task id's deferral marker
    #: record this task id's end before its FAILURE (results.end): a write
    #: whose answer the decision needs, made under the key's lock
    END = "end"


class Act(enum.Enum):
    RUN = "run"  # go on: the claim, the body, the return of the value
    RETRY = "retry"  # the same call again after a back-off
    WAIT = "wait"  # lease_on_conflict=wait: sleep, claim again
    DEFER = "defer"  # re-publish for later, backend untouched
    REJECT = "reject"  # store FAILURE(exc), LEASE_REJECTED, Ignore
    REJECT_ENDED = "reject_ended"  # LEASE_REJECTED, backend untouched, Ignore
    #: SUCCESS with the accepted value, then as REJECT_ENDED
    STORE_ACCEPTED_THEN_REJECT = "store_accepted_then_reject"
    DUPLICATE = "duplicate"  # decide_duplicate
    RETURN_ACCEPTED = "return_accepted"  # SUCCESS(accepted value), LEASE_REJECTED, Ignore
    REQUEUE = "requeue"  # re-publish now, uncounted: redo, never lose the work
    NOT_DONE = "not_done"  # decide_not_done
    LEAVE_TO_COPY = "leave_to_copy"  # another copy of this task id owns the outcome: Ignore
    STORE_FAILURE = "store_failure"  # store FAILURE(exc), the state's event, Ignore
    RAISE = "raise"  # let the body's error (or Retry) stand for Celery to store
    DROP = "drop"  # another deferred copy is queued: LEASE_REJECTED, Ignore
    PUBLISH = "publish"  # publish the copy, then mark it


@dataclass(frozen=True)
class Outcome:
    row: str
    act: Act
    reason: str = ""
    #: DEFER: whether it spends lease_defer_max
    counted: bool = False
    #: DEFER: seconds until the copy claims (before jitter); REJECT: the holder's remaining
    countdown: float = 0.0
    #: The reason of an event sent (with the point's state) before acting
    note: str | None = None
    #: defer.*: the deferral count the copy carries
    deferrals: int = 0
    #: PUBLISH: the deferral marker the new copy replaces (lease_defer_replaces)
    replaces: str | None = None


@dataclass(frozen=True)
class Failed:
    """A read that failed (the store or database was unavailable)."""

    error: str


@dataclass(frozen=True)
class Holder:
    """The parts of a key's lease record the decisions use."""

    live: bool
    task_id: str | None
    remaining: float
    token: int


@dataclass(frozen=True)
class Newer:
    """The key's accepted result."""

    token: int
    task_id: str | None


@dataclass(frozen=True)
class BackendState:
    """A task id's result-backend record."""

    status: str | None
    lease_error: bool  # its result is a celery-lease LeaseError

    @property
    def lease_failure(self) -> bool:
        """A FAILURE celery-lease decided (FENCED, LEASE_LOST, duplicate...)."""
        return self.status == FAILURE and self.lease_error


class Ended(enum.Enum):
    """What recording a task id's end answered (``celery_lease.result_end``)."""

    MARKED = "marked"  # recorded now: its FAILURE is to be stored
    ALREADY = "already"  # recorded before, by another copy of the task id
    ACCEPTED = "accepted"  # a copy of this task id was accepted first
    COPY_HOLDS = "copy_holds"  # a copy of this task id holds the key with another grant
    HOLDER_GONE = "holder_gone"  # take-over: no live holder, or one whose task id ended


@dataclass(frozen=True)
class EndAnswer:
    ended: Ended
    remaining: float = 0.0  # COPY_HOLDS: that copy's lease left


def outage_countdown(ttl: float) -> float:
    """The countdown of a deferral that waits for no lease (an outage): the
    table's "default"."""
    return min(ttl, 5.0)
