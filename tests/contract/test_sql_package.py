"""The SQL layer's own invariants: each statement once, all SQL text in
celery_lease/sql/, and the server functions' claim is the client's claim."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from celery_lease.sql import PG_TRAFFIC, count_pg_traffic, database, functions, queries
from celery_lease.sql.dialects import DIALECTS, rendered

ROOT = Path(__file__).resolve().parents[2]
#: The start of a statement in a string literal: a keyword, then the words that follow it.
SQL_TEXT = re.compile(
    r"""["'](?:\s*)(SELECT\s+\S|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|WITH\s+\w+\s+AS"""
    r"""|BEGIN\b|COMMIT\b|ROLLBACK\b|CREATE\s|DROP\s|CAST\(|FOR\s+UPDATE)""",
)


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_no_two_statements_are_the_same(dialect: str) -> None:
    by_text: dict[str, list[str]] = {}
    for name, sql in rendered(dialect):
        by_text.setdefault(" ".join(sql.split()), []).append(name)
    same = [names for names in by_text.values() if len(names) > 1]
    assert same == [], f"the same statement under several names: {same}"


def test_no_sql_text_outside_the_sql_package() -> None:
    """Every module but celery_lease/sql/ takes its statements from there."""
    found = []
    for path in sorted((ROOT / "celery_lease").rglob("*.py")):
        if path.parent.name == "sql":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if SQL_TEXT.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_the_sql_text_pattern_finds_a_statement() -> None:
    assert SQL_TEXT.search('    x = "SELECT fencing_token FROM celery_lease_fences"')
    assert SQL_TEXT.search("conn.execute('COMMIT')")


def test_the_claim_functions_claim_is_the_client_claim() -> None:
    """``celery_lease_claim_lookup_v1`` runs PG_CLAIM_ONE (on its arguments)."""
    inside = re.sub(r"\bp_(\w+)", r":\1", functions.CREATE_CLAIM_LOOKUP)
    claim = " ".join(queries.PG_CLAIM_ONE.split()).removesuffix(" FROM granted")
    assert claim + " INTO g FROM granted;" in " ".join(inside.split())
    register = " ".join(DIALECTS["postgresql"].register_fence.split())
    inside = re.sub(r"\bp_(\w+)", r":\1", functions.CREATE_REGISTER_LOOKUP)
    assert register + " INTO v;" in " ".join(inside.split())
    register_task = " ".join(DIALECTS["postgresql"].register_task.split())
    assert register_task + ";" in " ".join(inside.split())


def test_pg_traffic_is_counted_only_once_asked(pg_url: str) -> None:
    """PG_TRAFFIC counts round trips and statements for the benchmarks, which opt in;
    without count_pg_traffic() the driver layer counts nothing."""
    db = database(pg_url)
    db.now()  # a connection in the free list, so the calls below are one round trip each
    before = dict(PG_TRAFFIC)
    db.now()  # Conn's path
    db.pg_first("SELECT 1", {})  # the autocommit fast path
    assert PG_TRAFFIC == before
    count_pg_traffic()
    try:
        db.now()
        db.pg_first("SELECT 1", {})
        with db.transaction() as conn:  # BEGIN rides with the first statement: one round trip
            conn.now()
    finally:
        count_pg_traffic(False)
    assert PG_TRAFFIC["round_trips"] - before["round_trips"] >= 3
    assert PG_TRAFFIC["statements"] - before["statements"] >= 4
