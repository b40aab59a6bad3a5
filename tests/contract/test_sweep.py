"""The sweeper: deletes old results and long-dead lease rows, never lowers a fence.

``ResultTable.sweep(result_expires, lease_grace)`` deletes results accepted
more than ``result_expires`` seconds ago and lease rows expired (or released)
more than ``lease_grace`` seconds ago. A swept lease row's token is kept in
the key's fence row first, so a later claim still gets a larger token than
any before (invariant 1: tokens only grow, across sweeps).

Each test gets a fresh database so the sweep's counts are exact.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import text

import celery_lease
from celery_lease import DuplicateResult, LeaseStore, StaleFencingToken
from celery_lease.results import ResultTable
from celery_lease.sql import database
from tests.results_helpers import (
    new_key,
    result_rows,
    sweep_past_now,
    wait_for,
    wait_until_expired,
)

LONG_TTL = 30.0

pytestmark = pytest.mark.timeout(60)


@dataclass
class SQL:
    url: str
    store: LeaseStore
    table: ResultTable


@pytest.fixture(params=["pg", "sqlite"])
def sql(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SQL]:
    """The SQL store and the result table in one fresh database."""
    name = None
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'sweep.sqlite3'}"
    else:
        server = request.getfixturevalue("pg_server")
        server.ensure_running()
        name = f"test_sweep_{uuid.uuid4().hex[:10]}"
        url = server.create_database(name)
    celery_lease.migrate(url)
    store = LeaseStore.from_url(url)
    table = ResultTable(url, store)
    assert table.colocated
    yield SQL(url, store, table)
    store.close()
    if name is not None:
        request.getfixturevalue("pg_server").drop_database(name)


def lease_row_exists(url: str, key: str) -> bool:
    with database(url).single() as conn:
        n = conn.execute(
            text("SELECT count(*) FROM celery_lease_leases WHERE lease_key = :k"), {"k": key}
        ).scalar_one()
    return bool(n)


def fence_row(url: str, key: str) -> int | None:
    with database(url).single() as conn:
        v = conn.execute(
            text("SELECT fencing_token FROM celery_lease_fences WHERE resource = :k"), {"k": key}
        ).scalar()
    return None if v is None else int(v)


def test_sweep_deletes_dead_rows_and_never_lowers_a_fence(sql: SQL) -> None:
    store, table = sql.store, sql.table
    released, expired, live = new_key("released"), new_key("expired"), new_key("live")

    tokens = []
    for i in range(3):  # claimed and released (committed) three times
        lease = store.claim(released, ttl=LONG_TTL, owner_id=f"w{i}")
        assert lease is not None
        table.commit(lease, {"run": i})
        tokens.append(lease.token)
    assert tokens == sorted(tokens)
    stalled = store.claim(expired, ttl=1.0, owner_id="stalled")
    assert stalled is not None
    holder = store.claim(live, ttl=LONG_TTL, owner_id="holder")
    assert holder is not None
    wait_until_expired(store, stalled)

    counts = sweep_past_now(table, 0, 0)
    assert counts == {"results": 3, "leases": 2}, counts
    assert result_rows(sql.url, released) == []
    assert not lease_row_exists(sql.url, released)
    assert not lease_row_exists(sql.url, expired)
    assert lease_row_exists(sql.url, live), "a live lease is never swept"
    record = store.inspect(live)
    assert record is not None and record.live and record.owner_id == "holder"

    # The fences stayed: a new claim of a swept key gets a larger token than any before.
    assert fence_row(sql.url, released) == tokens[-1]
    assert store.fence_token(released) == tokens[-1]
    again = store.claim(released, ttl=LONG_TTL, owner_id="after-sweep")
    assert again is not None and again.token > max(tokens)
    nxt = store.claim(expired, ttl=LONG_TTL, owner_id="after-sweep")
    assert nxt is not None and nxt.token > stalled.token
    # The stalled owner stays fenced out after its row was swept.
    assert store.renew(stalled) is False
    with pytest.raises(StaleFencingToken):
        table.commit(stalled, "late")
    assert store.claim(live, ttl=LONG_TTL, owner_id="intruder") is None
    # Sweeping again finds nothing more, and still lowers nothing.
    assert sweep_past_now(table, None, 0) == {"results": 0, "leases": 0}
    assert store.fence_token(released) == again.token


def test_sweep_keeps_recent_results_and_rows_within_grace(sql: SQL) -> None:
    store, table = sql.store, sql.table
    old_key, new_key_ = new_key("old"), new_key("new")
    old = store.claim(old_key, ttl=LONG_TTL)
    assert old is not None
    old_at = table.commit(old, "old").accepted_at
    # Let the database clock move on (a poll with a deadline), then commit again.
    wait_for(lambda: store.time() > old_at + 0.4, 10, "0.4 s of database time")
    recent = store.claim(new_key_, ttl=LONG_TTL)
    assert recent is not None
    new_at = table.commit(recent, "new").accepted_at
    retention = store.time() - (old_at + new_at) / 2  # the old one is older, the new one not

    counts = table.sweep(result_expires=retention, lease_grace=3600)
    assert counts == {"results": 1, "leases": 0}, counts
    assert table.accepted(old_key) is None
    got = table.accepted(new_key_)
    assert got is not None and got.value == "new"
    # Released rows within the grace period stay (with their tokens).
    assert lease_row_exists(sql.url, old_key) and lease_row_exists(sql.url, new_key_)
    assert table.sweep(result_expires=None, lease_grace=3600) == {"results": 0, "leases": 0}
    assert table.accepted(new_key_) is not None


def test_sweep_restores_a_missing_or_lower_fence_from_the_lease_row(sql: SQL) -> None:
    """Where a lease row's token is not (or no longer fully) in its fence row,
    the sweep copies it there before deleting the row."""
    store, table = sql.store, sql.table
    missing, lower = new_key("missing"), new_key("lower")
    leases = {}
    for key in (missing, lower):
        for _ in range(2):
            lease = store.claim(key, ttl=LONG_TTL)
            assert lease is not None and store.release(lease)
            leases[key] = lease
    with database(sql.url).transaction() as conn:
        conn.execute(text("DELETE FROM celery_lease_fences WHERE resource = :k"), {"k": missing})
        conn.execute(
            text("UPDATE celery_lease_fences SET fencing_token = 1 WHERE resource = :k"),
            {"k": lower},
        )
    assert sweep_past_now(table, None, 0)["leases"] == 2
    for key, lease in leases.items():
        assert fence_row(sql.url, key) == lease.token
        assert not lease_row_exists(sql.url, key)
        nxt = store.claim(key, ttl=LONG_TTL)
        assert nxt is not None and nxt.token > lease.token


def test_sweeping_results_bounds_the_once_window(sql: SQL) -> None:
    """Documented: in once mode a swept result no longer blocks a duplicate."""
    store, table = sql.store, sql.table
    key = new_key("once")
    first = store.claim(key, ttl=LONG_TTL)
    assert first is not None
    table.commit(first, "first", mode="once")
    dup = store.claim(key, ttl=LONG_TTL)
    assert dup is not None
    with pytest.raises(DuplicateResult):
        table.commit(dup, "dup", mode="once")
    assert sweep_past_now(table, 0, 3600)["results"] == 1
    later = store.claim(key, ttl=LONG_TTL)
    assert later is not None and later.token > dup.token
    accepted = table.commit(later, "after retention", mode="once")
    assert accepted.token == later.token


def test_sweep_keeps_registered_fences_for_leases_elsewhere(
    redis_url: str, request: pytest.FixtureRequest
) -> None:
    """Leases in Redis, results in PostgreSQL: the results database's fence rows
    (registered at claim) survive the sweep, so an old owner stays refused."""
    from tests.results_helpers import migrated_pg_url

    pg = migrated_pg_url(request)
    store = LeaseStore.from_url(redis_url)
    table = ResultTable(pg, store)
    key = new_key("remote")
    a = store.claim(key, ttl=LONG_TTL, owner_id="A")
    assert a is not None
    table.register(a)
    assert store.release(a)  # A gives up without committing (or its lease lapsed)
    b = store.claim(key, ttl=LONG_TTL, owner_id="B")
    assert b is not None
    table.register(b)
    sweep_past_now(table, 0, 0)
    assert table.fence(key) == b.token
    with pytest.raises(StaleFencingToken):
        table.commit(a, "late")
    assert table.commit(b, "on time").token == b.token
    store.close()


def registrations(url: str, key: str) -> dict[str, int]:
    with database(url).single() as conn:
        rows = conn.execute(
            text(
                "SELECT task_id, fencing_token FROM celery_lease_registrations WHERE resource = :k"
            ),
            {"k": key},
        ).all()
    return {r.task_id: int(r.fencing_token) for r in rows}


@pytest.mark.parametrize("results", ["pg", "sqlite"])
def test_sweep_deletes_registrations_past_the_grace_and_no_token_falls(
    redis_url: str, request: pytest.FixtureRequest, tmp_path: Path, results: str
) -> None:
    """Leases in Redis: each task id's registration (the fenced backend's final
    states ask it) is kept within the lease grace, deleted past it; a copy of a
    swept task id then registers again, never below the fence row's token, and
    a stale registration records nothing."""
    from tests.results_helpers import migrated_pg_url

    if results == "pg":
        url = migrated_pg_url(request)
    else:
        url = f"sqlite:///{tmp_path / 'registrations.sqlite3'}"
        celery_lease.migrate(url)
    store = LeaseStore.from_url(redis_url)
    table = ResultTable(url, store)
    key = new_key("registered")
    a = store.claim(key, ttl=LONG_TTL, owner_id="A", meta={"task_id": "T"})
    assert a is not None
    table.register(a)
    assert store.release(a)
    b = store.claim(key, ttl=LONG_TTL, owner_id="B", meta={"task_id": "U"})
    assert b is not None
    table.register(b)
    with pytest.raises(StaleFencingToken):
        table.register(a)  # refused by the fence row: records nothing either
    assert registrations(url, key) == {"T": a.token, "U": b.token}
    table.sweep(result_expires=None, lease_grace=3600)
    assert registrations(url, key) == {"T": a.token, "U": b.token}
    sweep_past_now(table, None, 0)
    assert registrations(url, key) == {}
    assert table.fence(key) == b.token
    with pytest.raises(StaleFencingToken):
        table.register(a)
    assert registrations(url, key) == {}
    assert store.release(b)
    c = store.claim(key, ttl=LONG_TTL, owner_id="C", meta={"task_id": "T"})
    assert c is not None and c.token > b.token
    table.register(c)
    assert registrations(url, key) == {"T": c.token}
    store.close()


def test_sweep_deletes_a_deferral_markers_fence_and_keeps_a_real_keys(sql: SQL) -> None:
    """A deferral marker (``store.mark``) is not a lease: once its row is swept its
    fence row goes too (no row per deferral left forever), while an ordinary
    key's fence stays."""
    from celery_lease.task import DEFER_MARKER

    store, table = sql.store, sql.table
    marker = f"{DEFER_MARKER}{uuid.uuid4().hex}"
    real = new_key("real")
    assert store.mark(marker, "chain-1", ttl=1.0)
    assert store.marker(marker) == "chain-1"
    lease = store.claim(real, ttl=1.0, owner_id="w")
    assert lease is not None
    assert fence_row(sql.url, marker) is not None, "the SQL marker is kept as a lease row"
    wait_for(lambda: store.marker(marker) is None, 20, "the marker to expire")
    wait_until_expired(store, lease)

    counts = sweep_past_now(table, None, 0)
    assert counts["leases"] == 2, counts
    assert not lease_row_exists(sql.url, marker)
    assert fence_row(sql.url, marker) is None, "the marker's fence row outlived it"
    assert not lease_row_exists(sql.url, real)
    assert fence_row(sql.url, real) == lease.token, "a real key's fence is never swept"
    again = store.claim(real, ttl=LONG_TTL, owner_id="after")
    assert again is not None and again.token > lease.token
