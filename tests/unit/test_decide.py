"""Every row of the task's decision table (celery_lease.decide), walked as data.

Pure: no servers. Each case gives a decision point its facts and the answers
to the reads it may ask for, and checks the row, the outcome, and the reads
it asked for, in order: a read a decision does not need is a round trip the
executor would make, so the list is exact. The last test parses the table in
``celery_lease.decide``'s docstring and fails when a row has no case here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from celery.states import FAILURE, PENDING, SUCCESS

from celery_lease import decide
from celery_lease.decide import (
    Act,
    BackendState,
    BodyError,
    BodyStart,
    Claim,
    Commit,
    CommitResult,
    Defer,
    Duplicate,
    End,
    EndAnswer,
    Ended,
    Failed,
    Holder,
    Lookup,
    Newer,
    NotDone,
    Outcome,
    Read,
    Republish,
    Start,
)

ME = "task-1"
OTHER = "task-2"
TTL = 30.0
DEFAULT = 5.0  # min(TTL, 5)

LIVE_OTHER = Holder(live=True, task_id=OTHER, remaining=12.0, token=8)
LIVE_MINE = Holder(live=True, task_id=ME, remaining=7.0, token=9)
LEASE_FAILURE = BackendState(FAILURE, lease_error=True)
USER_FAILURE = BackendState(FAILURE, lease_error=False)
STORED = BackendState(SUCCESS, lease_error=False)
NOTHING = BackendState(PENDING, lease_error=False)


@dataclass(frozen=True)
class Case:
    row: str
    decide: Callable[[Any], Outcome | Read | None]
    facts: Any
    act: Act
    #: Read -> the fields it fills
    answers: dict[Read, dict[str, Any]] = field(default_factory=dict)
    reads: tuple[Read, ...] = ()
    counted: bool = False
    countdown: float | None = None
    reason: str | None = None
    deferrals: int | None = None
    note: str | None = None
    replaces: str | bool | None = False  # False: not checked


def walk(case: Case) -> tuple[Outcome | None, list[Read]]:
    """Run a decision as the executor does: answer each read it asks for."""
    facts, asked = case.facts, []
    for _ in range(20):
        answer = case.decide(facts)
        if not isinstance(answer, Read):
            return answer, asked
        asked.append(answer)
        assert answer in case.answers, f"{case.row}: asked for {answer} with no answer given"
        facts = replace(facts, **case.answers[answer])
    raise AssertionError(f"{case.row}: no decision after 20 reads")


def claim(**kw: Any) -> Claim:
    return Claim(ME, TTL, kw.pop("on_conflict", "defer"), **kw)


def start(**kw: Any) -> Start:
    base: dict[str, Any] = {"accepted": False, "duplicate": False, "backend": True}
    return Start(TTL, **(base | kw))


def body_error(**kw: Any) -> BodyError:
    base: dict[str, Any] = {"backend": True, "held": False, "token": 5}
    return BodyError(ME, TTL, **(base | kw))


def not_done(**kw: Any) -> NotDone:
    base: dict[str, Any] = {"backend": True, "token": 5}
    return NotDone(ME, TTL, **(base | kw))


def newer_holder(newer: Newer | None, holder: Holder | None) -> dict[Read, dict[str, Any]]:
    return {Read.NEWER_AND_HOLDER: {"newer": newer, "holder": holder}}


def end_answer(answer: EndAnswer | Failed) -> dict[Read, dict[str, Any]]:
    return {Read.END: {"answer": answer}}


NOT_MINE = {Read.MINE: {"mine": False}}
LATE = {Read.LATE_COPY: {"late_copy": True}}

CASES = [
    # -- claim
    Case("claim.granted", decide.decide_claim, claim(granted=True), Act.RUN),
    Case(
        "claim.retry",
        decide.decide_claim,
        claim(error="down", retry_left=True),
        Act.RETRY,
    ),
    Case(
        "claim.store_down",
        decide.decide_claim,
        claim(error="down"),
        Act.DEFER,
        countdown=DEFAULT,
        reason="lease store unavailable: down",
    ),
    Case(
        "claim.store_down",
        decide.decide_claim,
        claim(error="down", commit=True),
        Act.DEFER,
        answers=NOT_MINE,
        reads=(Read.MINE,),
        countdown=DEFAULT,
    ),
    Case(
        "claim.store_down",
        decide.decide_claim,
        claim(error="down", commit=True),
        Act.DEFER,
        answers={Read.MINE: {"mine": None}},
        reads=(Read.MINE,),
    ),
    Case(
        "claim.store_down",
        decide.decide_claim,
        claim(error="down", commit=True),
        Act.DEFER,
        answers={
            Read.MINE: {"mine": True},
            Read.OWN_STATE: {"own_state": BackendState("PENDING", lease_error=False)},
        },
        reads=(Read.MINE, Read.OWN_STATE),
    ),
    Case(
        "claim.store_done",
        decide.decide_claim,
        claim(error="down", commit=True),
        Act.REJECT_ENDED,
        answers={Read.MINE: {"mine": True}, Read.OWN_STATE: {"own_state": STORED}},
        reads=(Read.MINE, Read.OWN_STATE),
        reason="this task id's result is accepted and stored",
    ),
    Case(
        "claim.same_id",
        decide.decide_claim,
        claim(on_conflict="reject"),
        Act.DEFER,
        answers={Read.HOLDER: {"holder": LIVE_MINE}},
        reads=(Read.HOLDER,),
        countdown=7.0,
        reason="a copy of this task id holds the lease",
    ),
    Case(  # a copy of work that is done: nothing to cover, nothing to redo
        "claim.same_done",
        decide.decide_claim,
        claim(on_conflict="reject", commit=True),
        Act.REJECT_ENDED,
        answers={
            Read.HOLDER: {"holder": LIVE_MINE},
            Read.MINE: {"mine": True},
            Read.OWN_STATE: {"own_state": STORED},
        },
        reads=(Read.HOLDER, Read.MINE, Read.OWN_STATE),
        reason="this task id's result is accepted and stored",
    ),
    Case(  # committed, SUCCESS not stored yet: the owner may still store it
        "claim.same_id",
        decide.decide_claim,
        claim(on_conflict="reject", commit=True),
        Act.DEFER,
        answers={
            Read.HOLDER: {"holder": LIVE_MINE},
            Read.MINE: {"mine": True},
            Read.OWN_STATE: {"own_state": NOTHING},
        },
        reads=(Read.HOLDER, Read.MINE, Read.OWN_STATE),
        countdown=7.0,
    ),
    Case(  # the result table unreadable: cannot tell, defer
        "claim.same_id",
        decide.decide_claim,
        claim(on_conflict="reject", commit=True),
        Act.DEFER,
        answers={Read.HOLDER: {"holder": LIVE_MINE}, Read.MINE: {"mine": None}},
        reads=(Read.HOLDER, Read.MINE),
        countdown=7.0,
    ),
    Case(
        "claim.reject",
        decide.decide_claim,
        claim(on_conflict="reject"),
        Act.REJECT,
        answers={Read.HOLDER: {"holder": LIVE_OTHER}},
        reads=(Read.HOLDER,),
        countdown=12.0,
        reason="conflict",
    ),
    Case(
        "claim.wait",
        decide.decide_claim,
        claim(on_conflict="wait", wait_left=True),
        Act.WAIT,
        answers={Read.HOLDER: {"holder": LIVE_OTHER}},
        reads=(Read.HOLDER,),
    ),
    Case(
        "claim.defer",
        decide.decide_claim,
        claim(on_conflict="wait"),  # the wait is over
        Act.DEFER,
        answers={Read.HOLDER: {"holder": LIVE_OTHER}},
        reads=(Read.HOLDER,),
        counted=True,
        countdown=12.0,
        reason="another owner holds the lease",
    ),
    Case(  # the holder unreadable: wait a full TTL, counted
        "claim.defer",
        decide.decide_claim,
        claim(),
        Act.DEFER,
        answers={Read.HOLDER: {"holder": Failed("down")}},
        reads=(Read.HOLDER,),
        counted=True,
        countdown=TTL,
    ),
    # -- the look-up
    Case(
        "lookup.stale",
        decide.decide_lookup,
        Lookup(TTL, stale=True),
        Act.DEFER,
        countdown=DEFAULT,
        reason="a newer owner claimed before the body",
    ),
    Case("lookup.retry", decide.decide_lookup, Lookup(TTL, error="x", retry_left=True), Act.RETRY),
    Case(
        "lookup.store_down",
        decide.decide_lookup,
        Lookup(TTL, error="x"),
        Act.DEFER,
        countdown=DEFAULT,
        reason="result database unavailable: x",
    ),
    # -- before the body
    Case(  # a first delivery never reads the result backend
        "start.run",
        decide.decide_start,
        start(),
        Act.RUN,
        answers={Read.LATE_COPY: {"late_copy": False}},
        reads=(Read.LATE_COPY,),
    ),
    Case(  # a late copy whose backend state is a user's FAILURE (a retry): run
        "start.run",
        decide.decide_start,
        start(),
        Act.RUN,
        answers=LATE | {Read.OWN_STATE: {"own_state": USER_FAILURE}},
        reads=(Read.LATE_COPY, Read.OWN_STATE),
    ),
    Case(  # the backend unreadable: run (the commit is fenced anyway)
        "start.run",
        decide.decide_start,
        start(),
        Act.RUN,
        answers=LATE | {Read.OWN_STATE: {"own_state": None}},
        reads=(Read.LATE_COPY, Read.OWN_STATE),
    ),
    Case(  # results ignored: nothing to read
        "start.run",
        decide.decide_start,
        start(backend=False),
        Act.RUN,
        answers=LATE,
        reads=(Read.LATE_COPY,),
    ),
    Case(
        "start.ended",
        decide.decide_start,
        start(),
        Act.REJECT_ENDED,
        answers=LATE | {Read.OWN_STATE: {"own_state": LEASE_FAILURE}},
        reads=(Read.LATE_COPY, Read.OWN_STATE),
        reason="redelivery of a task that already ended",
    ),
    Case(
        "start.duplicate",
        decide.decide_start,
        start(duplicate=True),
        Act.DUPLICATE,
        answers={Read.LATE_COPY: {"late_copy": False}},
        reads=(Read.LATE_COPY,),
    ),
    Case(  # a late copy of an ended task in once mode: rejected as ended, not a duplicate
        "start.ended",
        decide.decide_start,
        start(duplicate=True),
        Act.REJECT_ENDED,
        answers=LATE | {Read.OWN_STATE: {"own_state": LEASE_FAILURE}},
        reads=(Read.LATE_COPY, Read.OWN_STATE),
    ),
    Case(
        "accepted.no_backend",
        decide.decide_start,
        start(accepted=True, backend=False),
        Act.REJECT_ENDED,
        reason="redelivery of an accepted task",
    ),
    Case(
        "accepted.db_down",
        decide.decide_start,
        start(accepted=True),
        Act.DEFER,
        answers={Read.ACCEPTED_ROW: {"accepted_row": Failed("gone")}},
        reads=(Read.ACCEPTED_ROW,),
        countdown=DEFAULT,
        reason="result database unavailable: gone",
    ),
    Case(
        "accepted.swept",
        decide.decide_start,
        start(accepted=True),
        Act.REJECT_ENDED,
        answers={Read.ACCEPTED_ROW: {"accepted_row": False}},
        reads=(Read.ACCEPTED_ROW,),
    ),
    Case(
        "accepted.backend_down",
        decide.decide_start,
        start(accepted=True),
        Act.DEFER,
        answers={Read.ACCEPTED_ROW: {"accepted_row": True}, Read.OWN_STATE: {"own_state": None}},
        reads=(Read.ACCEPTED_ROW, Read.OWN_STATE),
        countdown=DEFAULT,
        reason="result backend unavailable",
    ),
    Case(  # a copy finding its own task id accepted stores SUCCESS the backend lacks
        "accepted.store",
        decide.decide_start,
        start(accepted=True),
        Act.STORE_ACCEPTED_THEN_REJECT,
        answers={
            Read.ACCEPTED_ROW: {"accepted_row": True},
            Read.OWN_STATE: {"own_state": NOTHING},
        },
        reads=(Read.ACCEPTED_ROW, Read.OWN_STATE),
        reason="redelivery of an accepted task",
    ),
    Case(  # even over a lease FAILURE: the table's accepted result wins
        "accepted.store",
        decide.decide_start,
        start(accepted=True, duplicate=True),
        Act.STORE_ACCEPTED_THEN_REJECT,
        answers={
            Read.ACCEPTED_ROW: {"accepted_row": True},
            Read.OWN_STATE: {"own_state": LEASE_FAILURE},
        },
        reads=(Read.ACCEPTED_ROW, Read.OWN_STATE),
    ),
    Case(
        "accepted.present",
        decide.decide_start,
        start(accepted=True),
        Act.REJECT_ENDED,
        answers={Read.ACCEPTED_ROW: {"accepted_row": True}, Read.OWN_STATE: {"own_state": STORED}},
        reads=(Read.ACCEPTED_ROW, Read.OWN_STATE),
    ),
    Case(
        "body.lapsed",
        decide.decide_body_start,
        BodyStart(held=False),
        Act.REQUEUE,
        reason="the lease lapsed before the body started",
    ),
    Case("body.run", decide.decide_body_start, BodyStart(held=True), Act.RUN),
    # -- a duplicate (once mode)
    Case(
        "duplicate.reject",
        decide.decide_duplicate,
        Duplicate(TTL, "reject"),
        Act.REJECT,
        reason="duplicate",
    ),
    Case(
        "duplicate.db_down",
        decide.decide_duplicate,
        Duplicate(TTL, "return"),
        Act.DEFER,
        answers={Read.ACCEPTED_VALUE: {"accepted_value": Failed("x")}},
        reads=(Read.ACCEPTED_VALUE,),
        countdown=DEFAULT,
        reason="result database unavailable: x",
    ),
    Case(
        "duplicate.return",
        decide.decide_duplicate,
        Duplicate(TTL, "return"),
        Act.RETURN_ACCEPTED,
        answers={Read.ACCEPTED_VALUE: {"accepted_value": True}},
        reads=(Read.ACCEPTED_VALUE,),
        reason="duplicate: returned the accepted result",
    ),
    # -- the body raised (an error, Retry)
    Case("error.owner", decide.decide_body_error, body_error(held=True), Act.RAISE),
    Case(
        "error.stands",
        decide.decide_body_error,
        body_error(),
        Act.RAISE,
        answers={Read.HOLDER: {"holder": None}} | NOT_MINE,
        reads=(Read.HOLDER, Read.MINE),
    ),
    Case(  # its own lease, not yet expired in the store, is no copy
        "error.stands",
        decide.decide_body_error,
        body_error(token=9),
        Act.RAISE,
        answers={Read.HOLDER: {"holder": LIVE_MINE}} | NOT_MINE,
        reads=(Read.HOLDER, Read.MINE),
    ),
    Case(  # another task id's holder: the error stands
        "error.stands",
        decide.decide_body_error,
        body_error(),
        Act.RAISE,
        answers={Read.HOLDER: {"holder": LIVE_OTHER}} | NOT_MINE,
        reads=(Read.HOLDER, Read.MINE),
    ),
    # A copy whose lease lapsed and whose body raised leaves the outcome to a
    # copy of its task id that committed or holds the key.
    Case(
        "copy.committed",
        decide.decide_body_error,
        body_error(),
        Act.LEAVE_TO_COPY,
        answers={
            Read.HOLDER: {"holder": None},
            Read.MINE: {"mine": True},
            Read.OWN_STATE: {"own_state": STORED},
        },
        reads=(Read.HOLDER, Read.MINE, Read.OWN_STATE),
        note="another execution of this task id committed",
    ),
    Case(  # results ignored: no backend read
        "copy.committed",
        decide.decide_body_error,
        body_error(backend=False),
        Act.LEAVE_TO_COPY,
        answers={Read.HOLDER: {"holder": None}, Read.MINE: {"mine": True}},
        reads=(Read.HOLDER, Read.MINE),
    ),
    Case(  # the backend unreadable: leave it (the committer's SUCCESS may be there)
        "copy.committed",
        decide.decide_not_done,
        not_done(),
        Act.LEAVE_TO_COPY,
        answers=newer_holder(Newer(5, ME), None)
        | {Read.MINE: {"mine": True}, Read.OWN_STATE: {"own_state": None}},
        reads=(Read.NEWER_AND_HOLDER, Read.OWN_STATE),
    ),
    Case(  # the key's newer row is this task id's own: committed, no MINE read
        "copy.unstored",
        decide.decide_not_done,
        not_done(),
        Act.DEFER,
        answers=newer_holder(Newer(6, ME), None) | {Read.OWN_STATE: {"own_state": NOTHING}},
        reads=(Read.NEWER_AND_HOLDER, Read.OWN_STATE),
        countdown=DEFAULT,
        note="another execution of this task id committed",
    ),
    Case(
        "copy.unstored",
        decide.decide_body_error,
        body_error(),
        Act.DEFER,
        answers={
            Read.HOLDER: {"holder": None},
            Read.MINE: {"mine": True},
            Read.OWN_STATE: {"own_state": NOTHING},
        },
        reads=(Read.HOLDER, Read.MINE, Read.OWN_STATE),
        countdown=DEFAULT,
        reason="store the accepted result",
        note="another execution of this task id committed",
    ),
    Case(
        "copy.holds",
        decide.decide_body_error,
        body_error(),
        Act.DEFER,
        answers={Read.HOLDER: {"holder": LIVE_MINE}} | NOT_MINE,
        reads=(Read.HOLDER, Read.MINE),
        countdown=7.0,
        reason="a copy of this task id holds the lease",
        note="another execution of this task id holds it",
    ),
    Case(  # the result db unreadable: the key's holder still can tell
        "copy.holds",
        decide.decide_not_done,
        not_done(),
        Act.DEFER,
        answers=newer_holder(None, LIVE_MINE) | {Read.MINE: {"mine": None}},
        reads=(Read.NEWER_AND_HOLDER, Read.MINE),
        countdown=7.0,
    ),
    # A fact that could mean "a copy of this task id committed or holds it",
    # unreadable: never a FAILURE (nor the body's error) over that copy's work.
    Case(  # whether this task id committed unreadable, a newer row of another
        "copy.unreadable",
        decide.decide_not_done,
        not_done(),
        Act.DEFER,
        answers=newer_holder(Newer(6, OTHER), None) | {Read.MINE: {"mine": None}},
        reads=(Read.NEWER_AND_HOLDER, Read.MINE),
        countdown=DEFAULT,
        reason="cannot tell whether a copy of this task id committed or holds the lease",
    ),
    Case(  # the holder unreadable (the newest row another task id's, newer)
        "copy.unreadable",
        decide.decide_not_done,
        not_done(),
        Act.DEFER,
        answers=newer_holder(Newer(6, OTHER), Failed("down")) | NOT_MINE,
        reads=(Read.NEWER_AND_HOLDER, Read.MINE),
        countdown=DEFAULT,
    ),
    Case(  # both unreadable, a live holder of another task id: still no take-over
        "copy.unreadable",
        decide.decide_not_done,
        not_done(),
        Act.DEFER,
        answers=newer_holder(Failed("down"), LIVE_OTHER) | {Read.MINE: {"mine": None}},
        reads=(Read.NEWER_AND_HOLDER, Read.MINE),
        countdown=DEFAULT,
    ),
    Case(  # a raised body: the error would be stored over a copy's SUCCESS
        "copy.unreadable",
        decide.decide_body_error,
        body_error(),
        Act.DEFER,
        answers={Read.HOLDER: {"holder": Failed("down")}} | NOT_MINE,
        reads=(Read.HOLDER, Read.MINE),
        countdown=DEFAULT,
    ),
    # -- the commit
    Case("commit.accepted", decide.decide_commit, Commit(CommitResult.ACCEPTED), Act.RUN),
    Case("commit.fenced", decide.decide_commit, Commit(CommitResult.STALE), Act.NOT_DONE),
    Case("commit.duplicate", decide.decide_commit, Commit(CommitResult.DUPLICATE), Act.DUPLICATE),
    Case(
        "commit.retry",
        decide.decide_commit,
        Commit(CommitResult.UNAVAILABLE, "x", retry_left=True),
        Act.RETRY,
    ),
    Case(
        "commit.unknown",
        decide.decide_commit,
        Commit(CommitResult.UNAVAILABLE, "x"),
        Act.REQUEUE,
        reason="commit outcome unknown",
        note="store unavailable at commit: x",
    ),
    Case(  # another copy of this task id ended it: its FAILURE (decide_end next)
        "commit.ended", decide.decide_commit, Commit(CommitResult.ENDED), Act.STORE_FAILURE
    ),
    # -- the end: a FAILURE after the body, recorded first (celery_lease.result_end)
    Case("end.unfenced", decide.decide_end, End(TTL, False, True), Act.STORE_FAILURE),
    Case(
        "end.marked",
        decide.decide_end,
        End(TTL, True, True),
        Act.STORE_FAILURE,
        answers=end_answer(EndAnswer(Ended.MARKED)),
        reads=(Read.END,),
    ),
    Case(  # the refused copy of an ended task id: the FAILURE stored stands
        "end.stored",
        decide.decide_end,
        End(TTL, True, False),
        Act.REJECT_ENDED,
        answers=end_answer(EndAnswer(Ended.ALREADY))
        | {Read.OWN_STATE: {"own_state": LEASE_FAILURE}},
        reads=(Read.END, Read.OWN_STATE),
        reason="its task id has ended",
    ),
    Case(  # the copy that recorded the end died before storing its FAILURE
        "end.unstored",
        decide.decide_end,
        End(TTL, True, False),
        Act.STORE_FAILURE,
        answers=end_answer(EndAnswer(Ended.ALREADY)) | {Read.OWN_STATE: {"own_state": NOTHING}},
        reads=(Read.END, Read.OWN_STATE),
    ),
    Case(
        "end.backend_down",
        decide.decide_end,
        End(TTL, True, False),
        Act.DEFER,
        answers=end_answer(EndAnswer(Ended.ALREADY)) | {Read.OWN_STATE: {"own_state": None}},
        reads=(Read.END, Read.OWN_STATE),
        countdown=DEFAULT,
    ),
    Case(  # a copy that finds the row accepted stores SUCCESS if it is missing
        "end.accepted",
        decide.decide_end,
        End(TTL, True, False),
        Act.DEFER,
        answers=end_answer(EndAnswer(Ended.ACCEPTED)),
        reads=(Read.END,),
        countdown=DEFAULT,
        reason="another execution of this task id committed",
    ),
    Case(  # that copy decides; this one waits its lease out, uncounted
        "end.copy_holds",
        decide.decide_end,
        End(TTL, True, False),
        Act.DEFER,
        answers=end_answer(EndAnswer(Ended.COPY_HOLDS, 7.0)),
        reads=(Read.END,),
        countdown=7.0,
    ),
    Case(  # nobody would do the key's work: run again
        "end.holder_gone",
        decide.decide_end,
        End(TTL, True, True),
        Act.REQUEUE,
        answers=end_answer(EndAnswer(Ended.HOLDER_GONE)),
        reads=(Read.END,),
    ),
    Case(  # never a FAILURE that no mark covers: wait the outage out
        "end.unavailable",
        decide.decide_end,
        End(TTL, True, True),
        Act.DEFER,
        answers=end_answer(Failed("down")),
        reads=(Read.END,),
        countdown=DEFAULT,
        reason="result database unavailable: down",
    ),
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


@pytest.mark.parametrize("case", CASES, ids=[f"{i:02d}-{c.row}" for i, c in enumerate(CASES)])
def test_row(case: Case) -> None:
    outcome, asked = walk(case)
    assert outcome is not None, f"{case.row}: the decision went on instead of deciding"
    assert (outcome.row, outcome.act) == (case.row, case.act)
    assert tuple(asked) == case.reads, "reads (each a round trip) differ"
    assert outcome.counted is case.counted
    if case.countdown is not None:
        assert outcome.countdown == pytest.approx(case.countdown)
    if case.reason is not None:
        assert outcome.reason == case.reason
    if case.deferrals is not None:
        assert outcome.deferrals == case.deferrals
    if case.note is not None:
        assert outcome.note == case.note
    if case.replaces is not False:
        assert outcome.replaces == case.replaces


def test_lookup_that_answered_goes_on() -> None:
    assert decide.decide_lookup(Lookup(TTL)) is None


def table_rows() -> list[str]:
    """The row ids of the table in celery_lease.decide's docstring."""
    doc = decide.__doc__ or ""
    return re.findall(r"^    ([a-z_]+\.[a-z_]+) ", doc, flags=re.MULTILINE)


def test_every_table_row_has_a_case() -> None:
    rows = table_rows()
    assert len(rows) > 40 and len(set(rows)) == len(rows), rows
    covered = {c.row for c in CASES}
    assert set(rows) - covered == set(), "table rows with no case"
    assert covered - set(rows) == set(), "cases for rows the table does not list"


def test_every_row_a_decision_returns_is_in_the_table() -> None:
    # Rows named in the decisions' code (Outcome("row", ...) and the re-queue
    # helper), in every module of the package.
    package = Path(decide.__file__).parent
    source = "".join(m.read_text(encoding="utf-8") for m in sorted(package.glob("*.py")))
    named = set(re.findall(r'(?:Outcome|_requeue)\(\s*"([a-z_]+\.[a-z_]+)"', source))
    assert named == set(table_rows())
