"""The decision-table cases' shared parts: the Case record, the walk that
answers a decision's reads as the executor would, and the facts' builders.

The cases themselves are data, by phase of a task (decide_cases_*.py); the
test that walks them and checks the table is ``test_decide.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from celery.states import FAILURE, PENDING, SUCCESS

from celery_lease.decide import (
    Act,
    BackendState,
    BodyError,
    Claim,
    EndAnswer,
    Failed,
    Holder,
    Newer,
    NotDone,
    Outcome,
    Read,
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
