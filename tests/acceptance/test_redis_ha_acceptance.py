"""The canonical timeline and the crash scenario with leases on Redis Sentinel and Cluster.

The shared deployments of tests/conftest.py (``sentinel_url``: master, two
replicas, three sentinels; ``cluster_url``: three masters, three replicas):

1. Without Celery, through the fenced result table (results in SQLite): A
   claims, its lease lapses in store time (proven with ``inspect``), B claims
   a larger token and commits, A's commit is refused with StaleFencingToken.
2. With real workers (tests/workers.py, tests/apps/leaseapp.py with
   ``CL_STORE`` the deployment's URL and ``lease_store_options`` from
   ``CL_SETTINGS``; Redis broker and backend, results in PostgreSQL): the
   owner's whole worker SIGSTOPped past its TTL ends FENCED while the new
   owner's result stands; a SIGKILLed prefork child's work is redone with a
   newer token and exactly one result is accepted.

The helpers and the worker cluster are those of
tests/acceptance/test_task_acceptance.py (there with a single Redis). The
worker tests are slow (run with ``--slow``): the default suite keeps to its
time budget with the timeline alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from celery_lease import StaleFencingToken
from celery_lease.results import ResultTable
from tests.acceptance.lease_cluster import (
    Cluster,
    backend_state,
    gone,
    in_log,
    kill_child,
    lapsed,
)
from tests.results_helpers import result_rows
from tests.servers import RedisServer, wait_for
from tests.store_fixtures import new_key, open_store, store_options, wait_until_expired
from tests.workers import _state

pytestmark = pytest.mark.timeout(120)

KINDS = ("sentinel", "cluster")
TTL = 0.5
LONG_TTL = 30.0
#: TTL of the worker tests: renewals every 2/3 s.
WORKER_TTL = 2.0


@pytest.fixture(params=KINDS)
def ha_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


# --------------------------------------------------------------------------
# 1. the timeline through the fenced result table, without Celery
# --------------------------------------------------------------------------


def test_stale_owner_is_refused_after_the_new_owner_committed(ha_url: str, tmp_path: Path) -> None:
    store = open_store(ha_url)
    table = ResultTable(f"sqlite:///{tmp_path / 'results.sqlite3'}", store)
    key = new_key("timeline")
    a = store.claim(key, ttl=TTL, owner_id="owner-A")
    assert a is not None
    table.register(a)
    assert store.claim(key, ttl=LONG_TTL, owner_id="intruder") is None, "A's lease is live"
    record = wait_until_expired(store, key, a.expires_at)
    assert record is None or not record.live, f"A's lease did not lapse: {record}"

    b = store.claim(key, ttl=LONG_TTL, owner_id="owner-B")
    assert b is not None and b.token > a.token
    table.register(b)
    with pytest.raises(StaleFencingToken):
        table.commit(a, {"by": "A"})  # B still works: A is refused already
    accepted = table.commit(b, {"by": "B"})
    assert (accepted.token, accepted.owner_id) == (b.token, "owner-B")
    with pytest.raises(StaleFencingToken) as refused:
        table.commit(a, {"by": "A"})
    assert refused.value.token == a.token
    assert [(t, owner) for _, t, owner in result_rows(table.url, key)] == [(b.token, "owner-B")]
    store.close()


# --------------------------------------------------------------------------
# 2. real workers: SIGSTOP past the TTL, SIGKILL of the child
# --------------------------------------------------------------------------


@pytest.fixture
def make_cluster(
    tmp_path: Path,
    make_redis_server: Callable[..., RedisServer],
    pg_results: str,
    ha_url: str,
) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(ttl: float = WORKER_TTL) -> Cluster:
        broker = make_redis_server(appendonly=False)
        cluster = Cluster(
            tmp_path,
            broker=broker.url(0),
            backend=broker.url(1),
            store_url=ha_url,
            results_url=pg_results,
            ttl=ttl,
            store_options=store_options(ha_url),
        )
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


@pytest.mark.slow  # 6-9 s each with real workers: the default suite keeps its budget
def test_paused_owner_is_fenced_and_the_new_owners_result_stands(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster()
    a, b = c.worker("a", queue="qa"), c.worker("b", queue="qb")
    c.start(a, b)
    key = new_key("payment-security")

    t1 = c.tasks.work.apply_async((key,), {"sleep": 3.0, "tag": "A"}, queue="qa")
    s1 = c.wait_start(t1.id)
    held = c.store.inspect(key)
    assert held is not None and held.live and held.token == s1["token"] and held.task_id == t1.id

    a.stop_group()
    wait_for(lambda: _state(s1["pid"]) == "T", 10, "A's child stopped")
    expired = wait_for(lambda: lapsed(c.store, key), c.ttl + 5, "A's lease to lapse")
    assert expired.token == s1["token"]

    t2 = c.tasks.work.apply_async((key,), {"sleep": 1.0, "tag": "B"}, queue="qb")
    s2 = c.wait_start(t2.id)
    assert s2["hostname"] == b.hostname and s2["token"] > s1["token"]
    v2 = t2.get(timeout=20)
    assert _state(a.pid) == "T", "B committed while A was still paused"

    a.cont_group()
    with pytest.raises(StaleFencingToken):
        t1.get(timeout=20)
    assert backend_state(c, t1.id)[0] == "FAILURE"
    wait_for(in_log(a, f"FENCED {t1.id}"), 10, "A's worker to log FENCED")
    assert v2["token"] == s2["token"] and v2["tag"] == "B"
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [(s2["token"], t2.id)]
    assert c.table.for_task(t1.id) is None
    assert backend_state(c, t2.id) == ("SUCCESS", v2)


@pytest.mark.slow
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

    s2 = c.wait_start(t1.id, n=2, timeout=c.ttl + 15)
    assert s2["token"] > s1["token"] and s2["pid"] != s1["pid"]
    value = t1.get(timeout=20)
    assert value["token"] == s2["token"] and value["pid"] == s2["pid"]
    history = c.table.history(key)
    assert [(r.token, r.task_id, r.value) for r in history] == [(s2["token"], t1.id, value)]
    assert len(c.starts(t1.id)) == 2 and len(c.ends(t1.id)) == 1
    record = c.store.inspect(key)
    assert record is None or not record.live, "the commit released the lease"
