"""Before the body: the look-up that stops a late copy of an accepted task.

``ResultTable.prepare`` (leases elsewhere: register the token, then look up)
and ``ResultTable.claim_prepared`` (leases in the result database: claim,
then look up) answer two questions before a task's body runs: was this task
id's result accepted already (a late redelivery), and, in ``once`` mode, does
the key have an accepted result (a duplicate)?

On PostgreSQL, for one key, the two statements run in one server-side call
(migration 0002's PL/pgSQL functions: one round trip). What must survive
that: the look-up runs only after the claim or registration returned, in a
snapshot of its own, so a commit that was still in progress when the copy claimed (its
transaction holding the lock the claim or registration waits for) is seen.
The race tests hold such a commit open in a real transaction, prove the
copy is waiting on its lock (``pg_stat_activity``), end the commit, and
assert the copy saw the accepted row.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from celery_lease.results import Prepared
from celery_lease.sql import database
from celery_lease.sql import queries as q
from tests.results_helpers import Pairing, make_pairing, new_key, wait_for

pytestmark = pytest.mark.timeout(120)


def claim_and_prepare(p: Pairing, key: str, owner: str, task_id: str, once: bool) -> Any:
    """The path LeasedTask takes: one call when colocated, claim + prepare otherwise."""
    if p.table.colocated:
        return p.table.claim_prepared(
            key, ttl=30, owner_id=owner, meta={"task_id": task_id}, task_id=task_id, once=once
        )
    lease = p.store.claim(key, ttl=30, owner_id=owner, meta={"task_id": task_id})
    if lease is None:
        return None, None
    return lease, p.table.prepare(lease, task_id, once=once)


@pytest.mark.parametrize("once", [False, True], ids=["exclusive", "once"])
def test_the_look_up_finds_an_accepted_task_and_a_duplicate_key(
    pairing: Pairing, once: bool
) -> None:
    key, T, T2 = new_key(), new_key("task"), new_key("task")
    lease, prepared = claim_and_prepare(pairing, key, "owner-a", T, once)
    assert lease is not None and prepared == Prepared(None, None)
    assert claim_and_prepare(pairing, key, "owner-b", T, once) == (None, None)  # held
    mode = "once" if once else "exclusive"
    pairing.table.commit(lease, {"n": 1}, mode=mode, task_id=T)

    # A late copy of the same task id: its accepted token is found.
    copy, prepared = claim_and_prepare(pairing, key, "owner-c", T, once)
    assert copy is not None and copy.token > lease.token
    assert prepared.task_token == lease.token
    assert prepared.duplicate_token == (lease.token if once else None)
    assert pairing.store.release(copy)

    # Another task on the key: a duplicate in once mode, nothing in exclusive mode.
    other, prepared = claim_and_prepare(pairing, key, "owner-d", T2, once)
    assert other is not None and prepared.task_token is None
    assert prepared.duplicate_token == (lease.token if once else None)


def waiting_on_a_lock(url: str) -> bool:
    with database(url).single() as conn:
        n = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND datname = current_database()"
        ).scalar_one()
    return int(n) > 0


@pytest.mark.parametrize("kind", ["pg+pg", "redis+pg"])
def test_a_copy_claiming_during_the_commit_sees_the_accepted_row(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """The commit releases the lease before its transaction ends; a copy of
    the same task id claims in that window. Its look-up must wait for that
    commit and see the accepted row, or the task would run twice."""
    p = make_pairing(request, kind)
    key, T = new_key(), new_key("task")
    lease, _ = claim_and_prepare(p, key, "owner-a", T, once=False)
    assert lease is not None
    db = p.table.db
    row = {
        "key": lease.key,
        "token": lease.token,
        "task_id": T,
        "task_name": "t",
        "owner_id": lease.owner_id,
        "tenant": None,
        "root_id": None,
        "result": json.dumps({"n": 1}),
    }
    outcome: dict[str, Any] = {}

    def copy() -> None:
        try:
            outcome["value"] = claim_and_prepare(p, key, "owner-b", T, once=False)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = e

    thread = threading.Thread(target=copy)
    # The owner's commit, held open: the same statements as ResultTable.commit.
    with db.transaction() as conn:
        if kind == "pg+pg":
            sql = q.PG_COMMIT_COLOCATED[True, False, True]  # release, not once, one key
            out = conn.execute(sql, row).one()
            assert out.owned == 1 and out.accepted_at is not None
        else:
            fence = conn.execute(db.sql.lock_fence, {"key": lease.key}).scalar()
            assert fence == lease.token  # registered at the claim
            assert p.store.release(lease)  # the key is free in the store now...
            sql = db.sql.result_insert[False]
            assert conn.execute(sql, row).scalar() is not None
        thread.start()
        # ...and the copy is stuck on this transaction's lock, not finished.
        wait_for(lambda: waiting_on_a_lock(p.result_url), 10, "the copy to wait on the lock")
        assert thread.is_alive() and not outcome
    thread.join(10)
    assert not thread.is_alive()
    if "error" in outcome:
        raise outcome["error"]
    copy_lease, prepared = outcome["value"]
    assert copy_lease is not None and copy_lease.token > lease.token
    assert prepared.task_token == lease.token, "the copy missed the accepted result"
    p.close()
