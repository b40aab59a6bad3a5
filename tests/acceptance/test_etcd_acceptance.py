"""The canonical timeline and the crash scenario with leases in etcd.

1. Without Celery (the fenced result table's "leases elsewhere" path, with the
   result table in SQLite and in PostgreSQL): A claims, its lease lapses in
   etcd (proven with ``inspect``), B claims a larger token (an etcd revision),
   B commits, A's commit is refused with ``StaleFencingToken``; also with A
   committing while B still works. B's result is the only one.
2. With real workers (tests/workers.py, tests/apps/leaseapp.py with
   ``CL_STORE=etcd://...``, Redis broker and backend, results in PostgreSQL):
   the owner's whole worker SIGSTOPped past its TTL ends ``FENCED`` while the
   new owner's result stands; a SIGKILLed prefork child's work is redone with a
   newer token and exactly one result is accepted.

The helpers and the worker cluster are those of tests/acceptance/lease_cluster.py
(there with Redis and PostgreSQL lease stores).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import celery_lease
from celery_lease import DuplicateResult, Lease, LeaseStore, StaleFencingToken
from celery_lease.results import MODES, ResultTable
from tests.acceptance.lease_cluster import (
    Cluster,
    backend_state,
    gone,
    in_log,
    kill_child,
    lapsed,
)
from tests.etcd_cluster import etcd_cluster, etcd_url  # noqa: F401 - fixtures
from tests.results_helpers import result_rows
from tests.servers import RedisServer, wait_for
from tests.store_fixtures import new_key, wait_until_expired
from tests.workers import _state

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

#: TTL of the leases that lapse (seconds; etcd's TTLs are whole seconds)
TTL = 1.0
LONG_TTL = 30.0


# --------------------------------------------------------------------------
# 1. the timeline through the fenced result table, without Celery
# --------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def results(
    request: pytest.FixtureRequest,
    etcd_url: str,  # noqa: F811 - the imported fixture
    tmp_path: Path,
) -> Iterator[tuple[LeaseStore, ResultTable, str]]:
    """The etcd store and a fenced result table (SQLite file or PostgreSQL database)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'results.sqlite3'}"
    else:
        url = request.getfixturevalue("pg_url")
        celery_lease.migrate(url)
    store = LeaseStore.from_url(etcd_url)
    table = ResultTable(url, store)
    assert table.needs_registration, "leases in etcd take the register/lock path"
    yield store, table, url
    store.close()


def claim(store: LeaseStore, table: ResultTable, key: str, owner: str, ttl: float) -> Lease:
    """Claim and register the token, as a worker does before its body."""
    lease = store.claim(key, ttl=ttl, owner_id=owner)
    assert lease is not None, f"{owner} could not claim {key}: {store.inspect(key)}"
    table.register(lease)
    return lease


def a_lapses_b_takes_over(store: LeaseStore, table: ResultTable, key: str) -> tuple[Lease, Lease]:
    a = claim(store, table, key, "owner-A", TTL)
    assert store.claim(key, ttl=LONG_TTL, owner_id="intruder") is None, "A's lease is live"
    record = wait_until_expired(store, key, a.expires_at)
    assert record is not None and not record.live, f"A's lease did not lapse in etcd: {record}"
    b = claim(store, table, key, "owner-B", LONG_TTL)
    assert b.token > a.token
    record = store.inspect(key)
    assert (
        record is not None
        and record.live
        and (record.owner_id, record.token)
        == (
            "owner-B",
            b.token,
        )
    )
    return a, b


@pytest.mark.parametrize("mode", MODES)
def test_stale_owner_refused_after_the_new_owner_committed(
    results: tuple[LeaseStore, ResultTable, str], mode: str
) -> None:
    store, table, url = results
    key = new_key("timeline")
    a, b = a_lapses_b_takes_over(store, table, key)

    accepted = table.commit(b, {"by": "B"}, mode=mode, task_id="task-B")
    assert (accepted.key, accepted.token, accepted.owner_id) == (key, b.token, "owner-B")
    released = store.inspect(key)
    assert released is None or not released.live, "the commit released the lease"

    with pytest.raises(StaleFencingToken) as refused:
        table.commit(a, {"by": "A"}, mode=mode, task_id="task-A")
    assert not isinstance(refused.value, DuplicateResult)
    assert refused.value.token == a.token
    assert refused.value.current is not None and refused.value.current >= b.token

    assert [(token, owner) for _, token, owner in result_rows(url, key)] == [(b.token, "owner-B")]
    newest = table.accepted(key)
    assert newest is not None and (newest.token, newest.value) == (b.token, {"by": "B"})
    assert table.for_task("task-A") is None


def test_stale_owner_refused_while_the_new_owner_still_works(
    results: tuple[LeaseStore, ResultTable, str],
) -> None:
    store, table, url = results
    key = new_key("overlap")
    a, b = a_lapses_b_takes_over(store, table, key)

    with pytest.raises(StaleFencingToken) as refused:
        table.commit(a, {"by": "A"})
    assert refused.value.token == a.token
    assert result_rows(url, key) == [], "A's refused commit wrote nothing"
    with pytest.raises(StaleFencingToken):
        table.register(a)  # a late registration of the old token is refused too
    assert table.fence(key) == b.token

    record = store.inspect(key)
    assert record is not None and record.live and record.owner_id == "owner-B"
    accepted = table.commit(b, {"by": "B"})
    assert accepted.token == b.token
    assert [(token, owner) for _, token, owner in result_rows(url, key)] == [(b.token, "owner-B")]


# --------------------------------------------------------------------------
# 2. real workers: SIGSTOP past the TTL, SIGKILL of the child
# --------------------------------------------------------------------------

#: TTL of the worker tests: renewals every 2/3 s; a stopped owner's etcd lease
#: runs out at most 2 s after its last renewal (plus the revocation loop).
WORKER_TTL = 2.0


@pytest.fixture
def make_cluster(
    tmp_path: Path,
    make_redis_server: Callable[..., RedisServer],
    pg_results: str,
    etcd_url: str,  # noqa: F811 - the imported fixture
) -> Iterator[Callable[..., Cluster]]:
    """Workers with leases in etcd (``CL_STORE=etcd://...``), Redis broker/backend,
    results in PostgreSQL."""
    made: list[Cluster] = []

    def make(ttl: float = WORKER_TTL) -> Cluster:
        redis = make_redis_server(appendonly=False)
        cluster = Cluster(
            tmp_path,
            broker=redis.url(0),
            backend=redis.url(1),
            store_url=etcd_url,
            results_url=pg_results,
            ttl=ttl,
        )
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


def test_paused_owner_is_fenced_and_the_new_owners_result_stands(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster()
    assert c.env["CL_STORE"].startswith("etcd://")
    a, b = c.worker("a", queue="qa"), c.worker("b", queue="qb")
    c.start(a, b)
    key = new_key("payment-security")

    t1 = c.tasks.work.apply_async((key,), {"sleep": 3.0, "tag": "A"}, queue="qa")
    s1 = c.wait_start(t1.id)
    assert s1["hostname"] == a.hostname and s1["pid"] in a.children()
    held = c.store.inspect(key)
    assert held is not None and held.live and held.token == s1["token"] and held.task_id == t1.id

    # A pauses (its whole process group: state T), and its lease lapses in etcd.
    a.stop_group()
    wait_for(lambda: _state(s1["pid"]) == "T", 10, "A's child stopped")
    expired = wait_for(lambda: lapsed(c.store, key), c.ttl + 5, "A's lease to lapse in etcd")
    assert expired.token == s1["token"]
    assert _state(a.pid) == "T" and _state(s1["pid"]) == "T"

    # B takes the key over with a larger token (an etcd revision) and commits.
    t2 = c.tasks.work.apply_async((key,), {"sleep": 1.0, "tag": "B"}, queue="qb")
    s2 = c.wait_start(t2.id)
    assert s2["hostname"] == b.hostname and s2["token"] > s1["token"]
    v2 = t2.get(timeout=20)
    assert _state(a.pid) == "T", "B committed while A was still paused"

    # A resumes: its commit is refused (FAILURE StaleFencingToken, Flower: FENCED).
    a.cont_group()
    with pytest.raises(StaleFencingToken) as info:
        t1.get(timeout=20)
    assert str(s1["token"]) in str(info.value)
    assert backend_state(c, t1.id)[0] == "FAILURE"
    wait_for(in_log(a, f"FENCED {t1.id}"), 10, "A's worker to log FENCED")
    (a_end,) = c.ends(t1.id)
    assert a_end["held"] is False and a_end["token"] == s1["token"]

    # B's result is the accepted one, and the only one.
    assert v2["token"] == s2["token"] and v2["tag"] == "B"
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [(s2["token"], t2.id)]
    assert c.table.for_task(t1.id) is None
    assert backend_state(c, t2.id) == ("SUCCESS", v2)
    assert len(c.starts(t1.id)) == 1 and len(c.starts(t2.id)) == 1


def test_sigkill_of_the_child_redoes_the_work_with_a_newer_token(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster()
    a = c.worker("a")
    c.start(a)
    key = new_key("killed")
    t1 = c.tasks.work.apply_async((key,), {"sleep": 4.0, "tag": "x"})
    s1 = c.wait_start(t1.id)
    kill_child(a, s1["pid"])
    assert gone(s1["pid"]) and not c.ends(t1.id), "the child died mid-body"

    # The requeued message meets the dead child's lease (deferred) or arrives
    # after etcd revoked it; the work is redone with a newer token.
    s2 = c.wait_start(t1.id, n=2, timeout=c.ttl + 15)
    assert s2["token"] > s1["token"] and s2["pid"] != s1["pid"]
    value = t1.get(timeout=20)
    assert value["token"] == s2["token"] and value["pid"] == s2["pid"]
    history = c.table.history(key)
    assert [(r.token, r.task_id, r.value) for r in history] == [(s2["token"], t1.id, value)]
    assert len(c.starts(t1.id)) == 2 and len(c.ends(t1.id)) == 1
    record = c.store.inspect(key)
    assert record is None or not record.live, "the commit released the lease in etcd"
