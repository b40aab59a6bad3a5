"""``LeasedTask`` basics end to end: one module-wide cluster of
:mod:`tests.acceptance.lease_cluster` (one worker, two prefork children, a
Redis lease store, results in PostgreSQL).

The conflict policies (defer, reject), ``once`` duplicates (reject, return),
a late redelivery of an accepted task id, ``lease_commit=False``, a non-JSON
return value, ``self.retry()``.

Backend states are read uncached (``get_task_meta(cache=False)``): a client's
``AsyncResult`` keeps the first final state it saw.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_lease import (
    DuplicateResult,
    LeaseNotAcquired,
    ResultNotSerializable,
)
from tests.acceptance.lease_cluster import (
    TTL,
    Cluster,
    backend_state,
    in_log,
    new_key,
)
from tests.servers import RedisServer, wait_for
from tests.workers import Worker

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------
# 4. basics: one worker (2 children) shared by the module, Redis store, PG results
# --------------------------------------------------------------------------

#: databases of the session's Redis used by the basics cluster (broker, backend, store)
BASICS_DBS = (61, 62, 63)


@pytest.fixture(scope="module")
def basics(
    redis_server: RedisServer, pg_results: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Cluster, Worker]]:
    redis_server.ensure_running()
    for db in BASICS_DBS:
        redis_server.flushdb(db)
    broker, backend, store = (redis_server.url(db) for db in BASICS_DBS)
    c = Cluster(
        tmp_path_factory.mktemp("basics"),
        broker=broker,
        backend=backend,
        store_url=store,
        results_url=pg_results,
        ttl=TTL,
    )
    w = c.worker("basics", concurrency=2)
    try:
        c.start(w)
        yield c, w
    finally:
        c.close()


def test_conflict_defer_runs_after_the_holder_with_a_larger_token(
    basics: tuple[Cluster, Worker],
) -> None:
    c, w = basics
    key = new_key("defer")
    t1 = c.tasks.work.apply_async((key,), {"sleep": 1.5, "tag": "first"})
    c.wait_start(t1.id)
    t2 = c.tasks.work.apply_async((key,), {"tag": "second"})
    wait_for(in_log(w, f"LEASE_DEFERRED {t2.id}"), 10, "the second submission to be deferred")
    v1 = t1.get(timeout=20)
    v2 = t2.get(timeout=20)
    assert v2["token"] > v1["token"] and v2["tag"] == "second"
    (s2,) = c.starts(t2.id)
    (e1,) = c.ends(t1.id)
    assert s2["t"] > e1["t"], "the deferred task ran after the holder's body"
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [
        (v2["token"], t2.id),
        (v1["token"], t1.id),
    ]


def test_conflict_reject_raises_lease_not_acquired(basics: tuple[Cluster, Worker]) -> None:
    c, w = basics
    key = new_key("reject")
    t1 = c.tasks.work_reject.apply_async((key,), {"sleep": 1.5, "tag": "holder"})
    s1 = c.wait_start(t1.id)
    t2 = c.tasks.work_reject.apply_async((key,), {"tag": "late"})
    with pytest.raises(LeaseNotAcquired) as info:
        t2.get(timeout=20)
    assert type(info.value).__name__ == "LeaseNotAcquired" and key in str(info.value)
    assert backend_state(c, t2.id)[0] == "FAILURE"
    wait_for(in_log(w, f"LEASE_REJECTED {t2.id}"), 10, "the conflict to be logged")
    assert t1.get(timeout=20)["token"] == s1["token"]
    assert not c.starts(t2.id)
    assert [r.task_id for r in c.table.history(key)] == [t1.id]


@pytest.mark.parametrize("policy", ["reject", "return"])
def test_once_mode_duplicate(basics: tuple[Cluster, Worker], policy: str) -> None:
    c, w = basics
    task = c.tasks.work_once if policy == "reject" else c.tasks.work_once_return
    key = new_key(f"once-{policy}")
    t1 = task.apply_async((key,), {"tag": "first"})
    v1 = t1.get(timeout=20)
    t2 = task.apply_async((key,), {"tag": "second"})
    if policy == "reject":
        with pytest.raises(DuplicateResult) as info:
            t2.get(timeout=20)
        assert type(info.value).__name__ == "DuplicateResult"
        assert key in str(info.value) and str(v1["token"]) in str(info.value)
        assert backend_state(c, t2.id)[0] == "FAILURE"
    else:
        assert t2.get(timeout=20) == v1
        assert backend_state(c, t2.id) == ("SUCCESS", v1)
    wait_for(in_log(w, f"LEASE_REJECTED {t2.id}"), 10, "the duplicate to be rejected")
    assert not c.starts(t2.id), "a duplicate never runs its body"
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [(v1["token"], t1.id)]


def test_late_redelivery_of_an_accepted_task_id_is_not_executed(
    basics: tuple[Cluster, Worker],
) -> None:
    c, w = basics
    key = new_key("late")
    t1 = c.tasks.work.apply_async((key,), {"tag": "x"})
    v1 = t1.get(timeout=20)
    assert w.log_text().count(f"[{t1.id}] received") == 1

    # The same message again (same task id, same lease header), after the commit.
    c.app.send_task(
        "leaseapp.work",
        args=(key,),
        kwargs={"tag": "x"},
        task_id=t1.id,
        headers={"lease_keys": [key], "lease_tenant": None},
    )
    wait_for(
        lambda: w.log_text().count(f"[{t1.id}] received") == 2,
        10,
        "the worker to receive the late copy",
    )
    wait_for(in_log(w, f"LEASE_REJECTED {t1.id}"), 10, "the late copy to be rejected")
    assert backend_state(c, t1.id) == ("SUCCESS", v1)
    assert len(c.starts(t1.id)) == 1
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [(v1["token"], t1.id)]


def test_lock_only_returns_without_writing_a_result(basics: tuple[Cluster, Worker]) -> None:
    c, _ = basics
    key = new_key("lock-only")
    t = c.tasks.lock_only.apply_async((key,), {"tag": "lock"})
    value = t.get(timeout=20)
    (s,) = c.starts(t.id)
    assert value["token"] == s["token"]
    assert c.table.accepted(key) is None and c.table.for_task(t.id) is None
    rec = c.store.inspect(key)
    assert rec is not None and not rec.live and rec.token == s["token"], "released after the body"


def test_non_json_return_value_fails_naming_the_type_and_commits_nothing(
    basics: tuple[Cluster, Worker],
) -> None:
    c, _ = basics
    key = new_key("not-json")
    t = c.tasks.bad_return.apply_async((key,), {"tag": "bad"})
    with pytest.raises(ResultNotSerializable) as info:
        t.get(timeout=20)
    message = str(info.value)
    assert "set" in message and "leaseapp.bad_return" in message and "JSON" in message, message
    assert backend_state(c, t.id)[0] == "FAILURE"
    assert len(c.starts(t.id)) == 1 and len(c.ends(t.id)) == 1, "the body ran once"
    assert c.table.accepted(key) is None and c.table.for_task(t.id) is None
    rec = c.store.inspect(key)
    assert rec is not None and not rec.live, "the lease is released"


def test_retry_claims_again_with_a_newer_token(basics: tuple[Cluster, Worker]) -> None:
    c, w = basics
    key = new_key("retry")
    t = c.tasks.retry_once.apply_async((key,), {"tag": "r"})
    value = t.get(timeout=20)
    first, second = c.starts(t.id)
    assert second["token"] > first["token"]
    assert value["token"] == second["token"]
    assert f"leaseapp.retry_once[{t.id}] retry" in w.log_text()
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [(second["token"], t.id)]
