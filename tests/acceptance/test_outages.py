"""Store outages with real workers: the work is never run unprotected, never accepted stale.

Each test runs a real ``celery -A tests.apps.tenantapp worker`` (prefork,
``acks_late``) with its broker and result backend on a Redis server of their
own, the leases on a *private* Redis server and the fenced result table on a
*private* PostgreSQL cluster, and stops one of the two private servers at a
chosen moment:

(a) **at the claim** -- the lease store is down when the task arrives: the
    claim is retried for ``lease_store_retry``, then the task is deferred
    (``LEASE_DEFERRED`` in the worker log); no body starts while the store is
    down; after the restart the task runs once and its result is accepted;
(b) **during renewal** -- the lease store goes down while two bodies run and
    stays down longer than the TTL: each lease is declared lost when its local
    validity ends (``LEASE_LOST``; the body calling ``ensure()`` learns it then,
    not later); the one that finished its body meanwhile is ``FENCED``; both are
    re-queued and, after the restart, redone under newer tokens: no accepted
    result ever carries the old token;
(c) **at the commit** -- the result database goes down while the body runs, so
    the commit meets it: the commit is retried within the lease's validity and
    accepted once the database is back; with an outage longer than the
    validity, the task is ``FENCED`` and re-queued, then redone and accepted
    under a newer token, never under the old one;
(d) **at a process's first use** -- the embedded default's SQLite file (as the
    result table, or as the lease store too) cannot be opened when a pool
    child runs its first task: the task is deferred, not failed, and the
    worker starts; once the file can be opened the task runs once.

Every outage is proved from the test process first (a TCP connection to the
server's port is refused) before anything is asserted, and after each one the
same worker process, still alive, runs a later task normally. Waits poll
against deadlines.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import celery_lease
from tests.sec_cluster import Cluster, refused
from tests.servers import PostgresServer, RedisServer, wait_for

pytestmark = pytest.mark.timeout(150)


@pytest.fixture
def cluster(
    tmp_path: Path,
    make_redis_server: Callable[..., RedisServer],
    make_pg_server: Callable[..., PostgresServer],
) -> Iterator[Callable[..., tuple[Cluster, RedisServer, PostgresServer]]]:
    """``cluster(ttl=)`` -> (Cluster, the lease store's Redis, the results' PostgreSQL)."""
    made: list[Cluster] = []

    def make(ttl: float) -> tuple[Cluster, RedisServer, PostgresServer]:
        broker = make_redis_server(appendonly=False)
        store = make_redis_server(appendonly=True)
        pg = make_pg_server()
        results = pg.create_database("outages")
        celery_lease.migrate(results)
        c = Cluster(
            tmp_path,
            broker=broker.url(0),
            backend=broker.url(1),
            store_url=store.url(0),
            results_url=results,
            ttl=ttl,
            settings={"lease_store_retry": 1.0},
        )
        made.append(c)
        return c, store, pg

    yield make
    for c in made:
        c.close()


def _key(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _log_has(c: Cluster, *texts: str) -> Callable[[], bool]:
    return lambda: all(t in c.worker_logs() for t in texts)


def _later_task_runs_normally(c: Cluster) -> None:
    assert c.workers[0].alive(), "the worker process exited during the outage"
    key = _key("after")
    res = c.tasks.work.delay(key, tag="after")
    value = res.get(timeout=30)
    assert len(c.rows("start", res.id)) == 1
    accepted = c.table.accepted(key)
    assert accepted is not None and accepted.task_id == res.id
    assert accepted.token == value["token"]
    assert c.workers[0].alive()


def _ran_once_and_accepted(
    c: Cluster, task_id: str, key: str, value: dict[str, Any], *, after: float
) -> None:
    """The task's body ran once, after ``after``, and its result is the one accepted."""
    starts = c.rows("start", task_id)
    assert len(starts) == 1 and starts[0]["t"] > after, starts
    accepted = c.table.accepted(key)
    assert accepted is not None and accepted.task_id == task_id
    assert accepted.token == value["token"] == starts[0]["token"]


def _no_start_between(c: Cluster, since: float, until: float) -> None:
    during = [r for r in c.rows("start") if since <= r["t"] <= until]
    assert during == [], f"a body started while the store was down: {during}"


# --------------------------------------------------------------------------
# (a) at the claim
# --------------------------------------------------------------------------


def test_store_down_at_claim_defers_and_completes_after_restart(
    cluster: Callable[..., tuple[Cluster, RedisServer, PostgresServer]],
) -> None:
    c, store, _ = cluster(ttl=2.0)
    c.worker("claim").start()
    store.stop()
    down_at = time.time()
    assert refused(store.port), "the lease store still answers"

    key = _key("claim")
    res = c.tasks.work.delay(key, sleep=0.2, tag="claim")
    # The claim was tried against the stopped store, retried, then deferred.
    wait_for(_log_has(c, f"LEASE_DEFERRED {res.id}"), 30, "LEASE_DEFERRED in the worker log")
    assert refused(store.port), "the outage must still be on when the deferral is seen"
    assert c.rows("start", res.id) == [], "the body ran without a lease"
    assert c.backend_state(res.id)[0] in ("PENDING", "RECEIVED"), "no final state while deferred"

    # Taken before the restart: the store answers as soon as start() has it
    # listening, and a worker's claim can beat the line after start() returns.
    restarting_at = time.time()
    store.start()
    value = res.get(timeout=40)
    _no_start_between(c, down_at, restarting_at)
    _ran_once_and_accepted(c, res.id, key, value, after=restarting_at)
    _later_task_runs_normally(c)


# --------------------------------------------------------------------------
# (b) during renewal
# --------------------------------------------------------------------------


def test_store_down_past_the_ttl_during_the_body_loses_the_lease(
    cluster: Callable[..., tuple[Cluster, RedisServer, PostgresServer]],
) -> None:
    ttl = 2.0
    c, store, _ = cluster(ttl=ttl)
    c.worker("renew", concurrency=2).start()
    k_checked, k_work = _key("checked"), _key("work")
    # `checked` calls self.lease.ensure() every 50 ms; `work` only sleeps, then commits.
    checked = c.tasks.checked.delay(k_checked, sleep=8.0, tag="checked")
    work = c.tasks.work.delay(k_work, sleep=3.5, tag="work")
    first = {t.id: c.wait_row("start", t.id) for t in (checked, work)}

    stopping_at = time.time()
    store.stop()
    down_at = time.time()
    assert refused(store.port), "the lease store still answers"

    # `checked` learns of the loss when the local view runs out: within a TTL of the
    # last contact with the store (so within a TTL of the stop), not at its end.
    lost = c.wait_row("lost", checked.id, timeout=10)
    assert stopping_at < lost["t"] < down_at + ttl + 0.5, (stopping_at, down_at, lost)
    assert "no longer held" in lost["reason"]
    wait_for(_log_has(c, f"LEASE_LOST {checked.id}", f"LEASE_LOST {work.id}"), 10, "LEASE_LOST")
    # `work` finished its body after the loss; its commit meets the stopped store.
    end = c.wait_row("end", work.id, timeout=15)
    assert end["held"] is False, "the body's own view already says the lease is gone"
    wait_for(_log_has(c, f"FENCED {work.id}"), 15, "FENCED for the finished body")
    wait_for(_log_has(c, f"LEASE_DEFERRED {checked.id}"), 15, "the lost task re-queued")
    wait_for(lambda: time.time() > down_at + ttl + 0.5, ttl + 1, "outage longer than the TTL")
    assert refused(store.port), "the outage must still be on"
    for t, key in ((checked, k_checked), (work, k_work)):
        assert c.table.get(key, first[t.id]["token"]) is None, "accepted with the lost lease"

    restarting_at = time.time()  # before: a claim can beat the line after start()
    store.start()
    _no_start_between(c, down_at, restarting_at)
    for t, key in ((checked, k_checked), (work, k_work)):
        value = t.get(timeout=60)
        starts = c.rows("start", t.id)
        assert len(starts) == 2, starts  # the first run, and the redo after the restart
        assert starts[1]["t"] > restarting_at
        old, new = first[t.id]["token"], starts[1]["token"]
        assert new > old and value["token"] == new
        accepted = c.table.accepted(key)
        assert accepted is not None and accepted.token == new and accepted.task_id == t.id
        assert c.table.get(key, old) is None, "a result was accepted with the old token"
        assert [r.token for r in c.table.history(key)] == [new]
    _later_task_runs_normally(c)


# --------------------------------------------------------------------------
# (c) at the commit
# --------------------------------------------------------------------------


def test_results_db_down_at_commit_is_retried_or_requeued_never_stale(
    cluster: Callable[..., tuple[Cluster, RedisServer, PostgresServer]],
) -> None:
    ttl = 6.0
    c, _, pg = cluster(ttl=ttl)
    c.worker("commit").start()

    # 1. a short outage: the commit is retried within the lease's validity, then accepted
    key = _key("commit-short")
    res = c.tasks.work.delay(key, sleep=2.0, tag="short")
    start = c.wait_row("start", res.id)
    pg.stop()
    assert refused(pg.port), "the result database still answers"
    end = c.wait_row("end", res.id, timeout=10)
    assert end["held"] is True
    # the body is over and its commit is being tried against the stopped database
    wait_for(lambda: time.time() > end["t"] + 0.5, 2, "the commit to meet the outage")
    assert refused(pg.port)
    assert c.backend_state(res.id)[0] not in ("SUCCESS", "FAILURE")
    restart_at = time.time()
    pg.start()
    c.table.db.dispose()  # the test's own pooled connections died with the server
    value = res.get(timeout=30)
    assert len(c.rows("start", res.id)) == 1, "accepted by the retried commit, not redone"
    accepted = c.table.accepted(key)
    assert accepted is not None and accepted.token == start["token"] == value["token"]
    # The body ended (and its commit was first tried) while the database was down; the
    # commit that landed was written after the restart (database clock, same host).
    assert end["t"] < restart_at < accepted.accepted_at
    assert f"FENCED {res.id}" not in c.worker_logs()
    assert f"LEASE_DEFERRED {res.id}" not in c.worker_logs()

    # 2. an outage longer than the lease's validity: FENCED and re-queued, redone, accepted
    key = _key("commit-long")
    res = c.tasks.work.delay(key, sleep=1.0, tag="long")
    start = c.wait_row("start", res.id)
    pg.stop()
    assert refused(pg.port), "the result database still answers"
    wait_for(_log_has(c, f"FENCED {res.id}"), ttl + 10, "FENCED once the validity ran out")
    assert refused(pg.port), "the outage must still be on"
    assert c.backend_state(res.id)[0] not in ("SUCCESS", "FAILURE")
    pg.start()
    c.table.db.dispose()
    value = res.get(timeout=60)
    starts = c.rows("start", res.id)
    assert len(starts) == 2, starts
    old, new = start["token"], starts[1]["token"]
    assert new > old and value["token"] == new
    accepted = c.table.accepted(key)
    assert accepted is not None and accepted.token == new
    assert c.table.get(key, old) is None, "the first run's result was accepted with its old token"
    assert [r.token for r in c.table.history(key)] == [new]
    _later_task_runs_normally(c)


# --------------------------------------------------------------------------
# (d) at a process's first use
# --------------------------------------------------------------------------


@pytest.mark.parametrize("unusable", ["results", "store and results"])
def test_an_sqlite_file_unusable_at_a_childs_first_task_defers_it(
    unusable: str, tmp_path: Path, make_redis_server: Callable[..., RedisServer]
) -> None:
    """The embedded default sets its SQLite file up on first use, in the pool
    child that runs a task first. A file that cannot be opened then (a volume
    not mounted yet; here a directory in its place) is an outage like any
    other: the task is deferred, not failed, and runs once the file can be
    opened."""
    broker = make_redis_server(appendonly=False)
    path = tmp_path / "lease.sqlite3"
    url = f"sqlite:///{path}"
    c = Cluster(
        tmp_path,
        broker=broker.url(0),
        backend=broker.url(1),
        store_url=url if unusable == "store and results" else make_redis_server().url(0),
        results_url=url,
        ttl=2.0,
        settings={"lease_store_retry": 1.0},
    )
    try:
        path.mkdir()
        with pytest.raises(sqlite3.OperationalError, match="unable to open"):
            sqlite3.connect(path).execute("SELECT 1")  # the fault is in place
        c.worker("first-use").start()

        key = _key("first-use")
        res = c.tasks.work.delay(key, sleep=0.2, tag="first-use")
        wait_for(_log_has(c, f"LEASE_DEFERRED {res.id}"), 30, "LEASE_DEFERRED in the worker log")
        assert path.is_dir(), "the fault must still be on when the deferral is seen"
        assert c.rows("start", res.id) == [], "the body ran without its database"
        assert c.backend_state(res.id)[0] in ("PENDING", "RECEIVED"), (
            "no final state while deferred"
        )

        usable_at = time.time()
        path.rmdir()
        value = res.get(timeout=40)
        _ran_once_and_accepted(c, res.id, key, value, after=usable_at)
        _later_task_runs_normally(c)
    finally:
        c.close()
