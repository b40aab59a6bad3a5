"""Decision-table cases: not done (a refused commit, a lost lease), deferring, re-publishing."""

from __future__ import annotations

from dataclasses import replace

from celery_lease import decide
from celery_lease.decide import Act, Defer, Failed, Newer, Read, Republish
from tests.unit.decide_support import (
    LEASE_FAILURE,
    LIVE_OTHER,
    NOT_MINE,
    NOTHING,
    OTHER,
    Case,
    newer_holder,
    not_done,
)

REQUEUE = [
    # -- not done (a refused commit, a lost lease)
    Case(  # a newer token's result: no holder read past it, no take-over check
        "not_done.newer",
        decide.decide_not_done,
        not_done(),
        Act.STORE_FAILURE,
        answers=newer_holder(Newer(6, OTHER), LIVE_OTHER) | NOT_MINE,
        reads=(Read.NEWER_AND_HOLDER, Read.MINE),
    ),
    Case(
        "not_done.taken_over",
        decide.decide_not_done,
        not_done(),
        Act.STORE_FAILURE,
        answers=newer_holder(None, LIVE_OTHER)
        | NOT_MINE
        | {
            Read.HOLDER_COMMITTED: {"holder_committed": False},
            Read.HOLDER_STATE: {"holder_state": NOTHING},
        },
        reads=(Read.NEWER_AND_HOLDER, Read.MINE, Read.HOLDER_COMMITTED, Read.HOLDER_STATE),
    ),
    Case(  # the holder's task id: no record (results ignored): a take-over
        "not_done.taken_over",
        decide.decide_not_done,
        not_done(backend=False),
        Act.STORE_FAILURE,
        answers=newer_holder(None, LIVE_OTHER)
        | NOT_MINE
        | {Read.HOLDER_COMMITTED: {"holder_committed": None}},
        reads=(Read.NEWER_AND_HOLDER, Read.MINE, Read.HOLDER_COMMITTED),
    ),
    Case(  # a holder without a task id (a CLI claim) is a take-over, no reads about it
        "not_done.taken_over",
        decide.decide_not_done,
        not_done(),
        Act.STORE_FAILURE,
        answers=newer_holder(None, replace(LIVE_OTHER, task_id=None)) | NOT_MINE,
        reads=(Read.NEWER_AND_HOLDER, Read.MINE),
    ),
    # The take-over check: a live holder that is a late copy of a task that
    # ended does no work: re-queue.
    Case(  # the key's accepted result is the holder's own
        "not_done.holder_ended",
        decide.decide_not_done,
        not_done(token=7),
        Act.REQUEUE,
        answers=newer_holder(Newer(6, OTHER), LIVE_OTHER) | NOT_MINE,
        reads=(Read.NEWER_AND_HOLDER, Read.MINE),
        reason="lease lapsed with no new owner",
        note="lease lapsed with no new owner: re-queued",
    ),
    Case(  # the holder's task id committed (another key's row)
        "not_done.holder_ended",
        decide.decide_not_done,
        not_done(),
        Act.REQUEUE,
        answers=newer_holder(None, LIVE_OTHER)
        | NOT_MINE
        | {Read.HOLDER_COMMITTED: {"holder_committed": True}},
        reads=(Read.NEWER_AND_HOLDER, Read.MINE, Read.HOLDER_COMMITTED),
    ),
    Case(  # the holder's task id ended with a lease outcome (the result db down)
        "not_done.holder_ended",
        decide.decide_not_done,
        not_done(),
        Act.REQUEUE,
        answers=newer_holder(None, LIVE_OTHER)
        | NOT_MINE
        | {
            Read.HOLDER_COMMITTED: {"holder_committed": None},
            Read.HOLDER_STATE: {"holder_state": LEASE_FAILURE},
        },
        reads=(Read.NEWER_AND_HOLDER, Read.MINE, Read.HOLDER_COMMITTED, Read.HOLDER_STATE),
    ),
    Case(
        "not_done.nobody",
        decide.decide_not_done,
        not_done(),
        Act.REQUEUE,
        answers=newer_holder(None, None) | NOT_MINE,
        reads=(Read.NEWER_AND_HOLDER, Read.MINE),
        reason="lease lapsed with no new owner",
        note="lease lapsed with no new owner: re-queued",
    ),
    Case(  # the key's accepted result unreadable, no holder, not committed: redo
        "not_done.nobody",
        decide.decide_not_done,
        not_done(),
        Act.REQUEUE,
        answers=newer_holder(Failed("down"), None) | NOT_MINE,
        reads=(Read.NEWER_AND_HOLDER, Read.MINE),
    ),
    Case(  # an expired holder, an older accepted token: nobody newer
        "not_done.nobody",
        decide.decide_not_done,
        not_done(),
        Act.REQUEUE,
        answers=newer_holder(Newer(4, OTHER), replace(LIVE_OTHER, live=False)) | NOT_MINE,
        reads=(Read.NEWER_AND_HOLDER, Read.MINE),
    ),
    # -- deferring: only deferrals behind another task id are counted
    Case(
        "defer.limit",
        decide.decide_defer,
        Defer(True, 3, 3, 12.0, "another owner holds the lease"),
        Act.REJECT,
        countdown=12.0,
        reason="deferred 3 times behind other tasks (lease_defer_max)",
    ),
    Case(
        "defer.counted",
        decide.decide_defer,
        Defer(True, 2, 3, 12.0, "another owner holds the lease"),
        Act.DEFER,
        counted=True,
        countdown=12.0,
        deferrals=3,
    ),
    Case(  # behind the same task id, past the limit: never rejected, not counted
        "defer.uncounted",
        decide.decide_defer,
        Defer(False, 3, 3, 7.0, "a copy of this task id holds the lease"),
        Act.DEFER,
        countdown=7.0,
        deferrals=3,
    ),
    Case(  # a store or result-db outage, past the limit: likewise
        "defer.uncounted",
        decide.decide_defer,
        Defer(False, 10, 3, 5.0, "lease store unavailable: x"),
        Act.DEFER,
        deferrals=10,
    ),
    # -- re-publishing
    Case(
        "republish.queued",
        decide.decide_republish,
        Republish("mine"),
        Act.DROP,
        answers={Read.MARKER: {"marker": "theirs"}},
        reads=(Read.MARKER,),
        reason="a deferred copy is already queued",
    ),
    Case(
        "republish.publish",
        decide.decide_republish,
        Republish("mine"),
        Act.PUBLISH,
        answers={Read.MARKER: {"marker": "mine"}},
        reads=(Read.MARKER,),
        replaces="mine",
    ),
    Case(
        "republish.publish",
        decide.decide_republish,
        Republish("mine"),
        Act.PUBLISH,
        answers={Read.MARKER: {"marker": None}},
        reads=(Read.MARKER,),
        replaces=None,
    ),
    Case(  # the marker its publisher read: the move did not land (a write refused, a crash)
        "republish.publish",
        decide.decide_republish,
        Republish("mine", replaces="before"),
        Act.PUBLISH,
        answers={Read.MARKER: {"marker": "before"}},
        reads=(Read.MARKER,),
        replaces="before",
    ),
    Case(  # a twin (a broker restore) whose successor took the marker first
        "republish.queued",
        decide.decide_republish,
        Republish("mine", replaces="before"),
        Act.DROP,
        answers={Read.MARKER: {"marker": "twins-successor"}},
        reads=(Read.MARKER,),
    ),
    Case(  # its publisher could not read the marker: it goes on under any
        "republish.publish",
        decide.decide_republish,
        Republish("mine", replaces=decide.ANY_MARKER),
        Act.PUBLISH,
        answers={Read.MARKER: {"marker": "whatever"}},
        reads=(Read.MARKER,),
        replaces="whatever",
    ),
    Case(  # the task's first message, restored after its deferral
        "republish.queued",
        decide.decide_republish,
        Republish(None),
        Act.DROP,
        answers={Read.MARKER: {"marker": "theirs"}},
        reads=(Read.MARKER,),
    ),
    Case(  # the marker unreadable: a second copy beats losing the work
        "republish.publish",
        decide.decide_republish,
        Republish("mine"),
        Act.PUBLISH,
        answers={Read.MARKER: {"marker": Failed("down")}},
        reads=(Read.MARKER,),
        replaces=decide.ANY_MARKER,
    ),
]
