"""The end mark (celery_lease/result_end.py) against every pairing of lease store
and result database, without Celery.

A FAILURE celery-lease decides for a task id after its result was refused is
recorded first, under the lock every commit of the key takes; from then on no
copy of that task id is accepted (the flip of docs/model.md's defects 2 and
4). Under the same lock the mark is refused where it would be wrong: a copy
of the task id was accepted, or holds the key, or (for a take-over) the
holder is gone or has ended itself. Leases lapse for real (1 s TTL, proven
with ``store.inspect``).
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from celery_lease import Lease, StaleFencingToken
from celery_lease.exceptions import TaskEnded
from celery_lease.result_end import ACCEPTED, ALREADY, COPY_HOLDS, HOLDER_GONE, MARKED, EndMark
from celery_lease.sql import database
from celery_lease.stores.redis import RedisLeaseStore
from tests.results_helpers import (
    Pairing,
    new_key,
    result_rows,
    wait_for,
    wait_until_expired,
)

TTL = 1.0
LONG_TTL = 30.0

pytestmark = pytest.mark.timeout(60)


def claim(p: Pairing, key: str, owner: str, task_id: str, ttl: float = LONG_TTL) -> Lease:
    """Claim for one copy of ``task_id`` and register, as a worker does before its body."""
    lease = p.store.claim(key, ttl=ttl, owner_id=owner, meta={"task_id": task_id})
    assert lease is not None, f"{owner} could not claim {key}: {p.store.inspect(key)}"
    p.table.register(lease)
    return lease


def lapsed(p: Pairing, key: str, owner: str, task_id: str) -> Lease:
    """A copy whose lease ran out in store time (its pause past the TTL)."""
    lease = claim(p, key, owner, task_id, ttl=TTL)
    wait_until_expired(p.store, lease)
    return lease


def ended(p: Pairing, task_id: str) -> bool:
    with database(p.result_url).read() as conn:
        sql = "SELECT 1 FROM celery_lease_ended WHERE task_id = :t"
        return conn.execute(sql, {"t": task_id}).first() is not None


def test_no_copy_of_an_ended_task_id_is_accepted(pairing: Pairing, mode: str) -> None:
    """Defect 4's shape: T0's copy A lost the key to T1 and ends T0; T0's other
    copy C (a first delivery held back, or a redelivery) runs later: its commit
    is refused, so the FAILURE A stores is never followed by a SUCCESS."""
    p, key = pairing, new_key("end")
    t0, t1 = new_key("T0"), new_key("T1")
    a = lapsed(p, key, "A", t0)
    b = claim(p, key, "B", t1)
    assert p.table.end(a, t0, take_over=True) == EndMark(MARKED)
    assert ended(p, t0)
    assert p.store.release(b)

    c = claim(p, key, "C", t0)
    with pytest.raises(TaskEnded) as refused:
        p.table.commit(c, {"by": "C"}, mode=mode, task_id=t0)
    assert isinstance(refused.value, StaleFencingToken)
    assert refused.value.task_id == t0
    assert refused.value.token == a.token, "it names the token that ended T0, not C's"
    assert p.table.for_task(t0) is None
    assert result_rows(p.result_url, key) == []
    # The refused copy finds the mark (and stores FAILURE only if none is stored).
    assert p.table.end(c, t0) == EndMark(ALREADY)

    # Another task id of the key is untouched by T0's end.
    d = claim(p, key, "D", t1)
    assert p.table.commit(d, {"by": "D"}, mode=mode, task_id=t1).token == d.token


def test_no_end_once_a_copy_of_the_task_id_was_accepted(pairing: Pairing) -> None:
    """Defect 2's shape: C, T0's newer copy, is accepted before stale A ends T0:
    A's end is refused, so its FAILURE is never stored over C's SUCCESS."""
    p, key, t0 = pairing, new_key("end"), new_key("T0")
    a = lapsed(p, key, "A", t0)
    c = claim(p, key, "C", t0)
    p.table.commit(c, {"by": "C"}, task_id=t0)
    assert p.table.end(a, t0, take_over=False) == EndMark(ACCEPTED)
    assert not ended(p, t0)
    found = p.table.for_task(t0)
    assert found is not None and found.token == c.token


def test_no_end_while_another_copy_of_the_task_id_holds_the_key(pairing: Pairing) -> None:
    p, key, t0 = pairing, new_key("end"), new_key("T0")
    a = lapsed(p, key, "A", t0)
    c = claim(p, key, "C", t0)
    mark = p.table.end(a, t0, take_over=True)
    assert mark.kind == COPY_HOLDS and 0 < mark.remaining <= LONG_TTL
    assert not ended(p, t0)
    assert p.table.commit(c, {"by": "C"}, task_id=t0).token == c.token


def test_a_take_over_ends_a_task_only_while_its_taker_will_do_the_work(pairing: Pairing) -> None:
    """Without this check two task ids could end each other and leave the key
    with no accepted result: T0 ends because T1 holds the key; T1's copy then
    lapses while T0's redelivered copy holds it, and must not end because of
    a copy that can never be accepted."""
    p, key = pairing, new_key("end")
    t0, t1 = new_key("T0"), new_key("T1")
    a = lapsed(p, key, "A", t0)
    # Nobody holds the key: a take-over has no taker to leave the work to.
    assert p.table.end(a, t0, take_over=True) == EndMark(HOLDER_GONE)
    # A newer result of another task id justifies the end by itself.
    assert p.table.end(a, new_key("T2"), take_over=False) == EndMark(MARKED)

    b = claim(p, key, "B", t1, ttl=TTL)
    assert p.table.end(a, t0, take_over=True) == EndMark(MARKED)
    wait_until_expired(p.store, b)
    c = claim(p, key, "C", t0)  # T0's redelivered copy: it will be refused
    assert p.table.end(b, t1, take_over=True) == EndMark(HOLDER_GONE)
    assert not ended(p, t1)
    assert p.store.release(c)
    d = claim(p, key, "D", t1)  # so T1 runs again, and is accepted
    assert p.table.commit(d, {"by": "D"}, task_id=t1).token == d.token


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _waiting_on_a_lock(url: str) -> bool:
    with psycopg.connect(_plain(url), autocommit=True) as conn:
        sql = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        row = conn.execute(sql).fetchone()
    return bool(row and row[0])


def test_the_end_waits_for_a_commit_that_holds_the_key(pairing: Pairing) -> None:
    """The mark and the commit take the same lock (the fence row; with leases in
    the database, the lease row), and the mark's checks run after it: a commit
    in flight when the mark starts is seen. PostgreSQL only: SQLite runs one
    writing transaction at a time."""
    if not pairing.result_url.startswith("postgresql"):
        pytest.skip("SQLite serializes every writing transaction")
    p, key, t0 = pairing, new_key("end"), new_key("T0")
    a = lapsed(p, key, "A", t0)
    c = claim(p, key, "C", t0)
    table, column = (
        ("celery_lease_leases", "lease_key")
        if p.table.colocated
        else ("celery_lease_fences", "resource")
    )
    answer: list[Any] = []
    with psycopg.connect(_plain(p.result_url)) as holder:
        holder.execute(f"SELECT 1 FROM {table} WHERE {column} = %s FOR UPDATE", (key,))
        worker = threading.Thread(target=lambda: answer.append(p.table.end(a, t0)))
        worker.start()
        wait_for(lambda: _waiting_on_a_lock(p.result_url), 20, "the end to wait for the lock")
        assert not answer, "the end did not wait for the key's lock"
        # What C's commit writes while it holds that lock.
        holder.execute(
            "INSERT INTO celery_lease_results (lease_key, fencing_token, task_id, owner_id,"
            " result, accepted_at) VALUES (%s, %s, %s, 'C', '{}', 0)",
            (key, c.token, t0),
        )
    worker.join(20)
    assert answer == [EndMark(ACCEPTED)]
    assert not ended(p, t0)


@pytest.mark.parametrize("record", ["deleted", "kept"])
def test_a_run_out_unreleased_copy_of_the_task_id_still_holds_it_with_leases_in_the_database(
    pairing: Pairing, record: str
) -> None:
    """docs/model.md, finding 5: with the leases in the result database the
    commit is one statement that judges its lease by the clock of its start,
    before it waits for the lease row; a copy whose lease ran out while that
    statement waited would still be accepted. So, there, a lease row that
    names another grant of the task id and was not released keeps the mark
    off, live or not. Elsewhere the commit checks the store after its lock:
    a run-out lease is no holder, whether the store has deleted its record
    yet or not. Redis decides expiry by the hash's ``expires`` field and
    deletes the hash up to a millisecond later; ``kept`` stretches that
    window (PERSIST) so the mark surely meets the run-out record."""
    p, key, t0 = pairing, new_key("end"), new_key("T0")
    if record == "deleted" and not isinstance(p.store, RedisLeaseStore):
        pytest.skip("a lease row stays when its lease runs out: only Redis deletes it")
    a = lapsed(p, key, "A", t0)
    c = claim(p, key, "C", t0, ttl=TTL)  # T0's other copy: its lease runs out, unreleased
    if isinstance(p.store, RedisLeaseStore):
        name = p.store.lease_name(key)
        if record == "kept":
            assert p.store.client.persist(name), "the hash had no expiry to remove"
        wait_until_expired(p.store, c)
        if record == "deleted":
            wait_for(lambda: not p.store.client.exists(name), 10, f"Redis to delete {name}")
    else:
        wait_until_expired(p.store, c)
    run_out = p.store.inspect(key)
    if record == "kept":  # the fault happened: the mark meets C's record, run out
        assert run_out is not None and run_out.owner_id == "C" and not run_out.live, run_out
    mark = p.table.end(a, t0, take_over=False)
    if p.table.colocated:
        assert mark == EndMark(COPY_HOLDS, 0.0)
        assert not ended(p, t0)
    else:
        assert mark == EndMark(MARKED)
        assert ended(p, t0)
