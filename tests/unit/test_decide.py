"""Every row of the task's decision table (celery_lease.decide), walked as data.

Pure: no servers. Each case gives a decision point its facts and the answers
to the reads it may ask for, and checks the row, the outcome, and the reads
it asked for, in order: a read a decision does not need is a round trip the
executor would make, so the list is exact. The last test parses the table in
``celery_lease.decide``'s docstring and fails when a row has no case here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from celery_lease import decide
from celery_lease.decide import Lookup
from tests.unit.decide_cases_end import END
from tests.unit.decide_cases_requeue import REQUEUE
from tests.unit.decide_cases_start import START
from tests.unit.decide_support import TTL, Case, walk

#: In the order of a task's life, so each case's id keeps its number.
CASES: list[Case] = [*START, *END, *REQUEUE]


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
