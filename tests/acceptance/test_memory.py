"""A long-running worker keeps nothing per task of celery-lease's.

One prefork child (``-c 1``, so every task runs in the same process) drains
leased tasks; a census task (tests/census.py) counts, in that child, the live
objects of celery-lease's types and, with ``tracemalloc`` tracing, the bytes
still allocated from celery-lease's files. Counted after a warm-up and after
each of two equal stretches of tasks, nothing may grow with the number of
tasks: a per-task leak of one object shows as +``STRETCH``, of a few bytes as
kilobytes. With the child's automatic cycle collector off during each stretch,
the census also counts celery-lease's objects left in reference cycles: a
task that leaves one (freed only by a collection, late: the heap grows
meanwhile) shows as ``STRETCH`` of them. This is a count, not a timing; RSS
over 200k tasks is measured in the memory benchmark (BENCHMARKS.md, section 7).
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery.result import ResultSet

import celery_lease
from tests.apps.leaseapp import build
from tests.census import growth
from tests.servers import PostgresServer
from tests.workers import Worker

pytestmark = pytest.mark.timeout(300)

WARM_UP = 150
STRETCH = 600
#: bytes a stretch may add to celery-lease's traced allocations: far below one
#: byte per task, well above the few free-list blocks a run leaves behind
TRACED_SLACK = 1_024
#: live objects of one celery-lease type a stretch may add: caches that fill
#: once (the key binders, one per task name) and objects in flight at the census
OBJECT_SLACK = 3


def _drain(app: Any, task: Any, n: int, tag: str) -> None:
    results = ResultSet([task.delay(f"mem-{tag}-{i}") for i in range(n)])
    values = results.join(timeout=240, propagate=True)
    assert len(values) == n


@pytest.mark.slow  # a soak, about 30 s a case: .ci/run's long runs (-m ci)
@pytest.mark.ci
@pytest.mark.parametrize(
    "config", ["redis+postgresql", "redis lock-only", "sqlite"], ids=lambda c: c.replace(" ", "-")
)
def test_a_worker_child_keeps_nothing_per_task(
    config: str, fresh_redis: Callable[[], str], pg_server: PostgresServer, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    if config == "sqlite":
        store = results = f"sqlite:///{tmp_path / 'leases.sqlite3'}"
    else:
        store = fresh_redis()
        results = pg_server.create_database(f"mem_{tag}")
        celery_lease.migrate(results)
    env = {
        "CL_BROKER": fresh_redis(),
        "CL_BACKEND": fresh_redis(),
        "CL_STORE": store,
        "CL_RESULTS": results,
        "CL_TTL": "30",
        "CL_TRACEMALLOC": "1",
        "CL_SETTINGS": json.dumps({"task_track_started": False}),
    }
    app, tasks = build(env)
    task = tasks.lock_only if config == "redis lock-only" else tasks.work
    worker = Worker(f"mem-{tag}", env, tmp_path, concurrency=1)
    try:
        worker.start()
        _drain(app, task, WARM_UP, f"{tag}-w")
        censuses = [tasks.census.delay(hold_cycles=True).get(timeout=60)]
        for stretch in range(2):
            _drain(app, task, STRETCH, f"{tag}-{stretch}")
            censuses.append(tasks.census.delay(hold_cycles=True).get(timeout=60))
    finally:
        worker.stop()
        app.close()
    # one process ran every task and every census, and it ran celery-lease's code
    assert len({c["pid"] for c in censuses}) == 1, [c["pid"] for c in censuses]
    first = censuses[0]
    assert any(name.startswith("celery_lease.") for name in first["types"]), first["types"]
    assert first["traced"], "tracemalloc traced nothing of celery-lease's: the census is blind"
    for after in censuses[1:]:
        # every cycle a stretch's tasks left is still there (collector off)
        assert sum(after["cycles"].values()) <= OBJECT_SLACK, after["cycles"]
    for before, after in itertools.pairwise(censuses):
        objects = growth(before, after, "types")
        assert all(n <= OBJECT_SLACK for n in objects.values()), objects
        traced = growth(before, after, "traced")
        print(f"{config}: grew over {STRETCH} tasks: objects {objects}, traced {traced}")
        assert sum(traced.values()) <= TRACED_SLACK, sorted(traced.items(), key=lambda kv: -kv[1])


@pytest.mark.parametrize(
    ("config", "loaded", "absent"),
    [
        ("redis+sqlite", {"redis", "sqlalchemy"}, {"psycopg", "alembic", "etcd3gw"}),
        ("redis+postgresql", {"redis", "sqlalchemy", "psycopg"}, {"alembic", "etcd3gw"}),
    ],
)
def test_a_worker_loads_only_the_drivers_its_stores_need(
    config: str,
    loaded: set[str],
    absent: set[str],
    fresh_redis: Callable[[], str],
    pg_server: PostgresServer,
    tmp_path: Path,
) -> None:
    """A pool child, after a leased task ran (store and results connected), has
    imported the drivers of its configured stores and nothing else of the
    optional ones: no PostgreSQL driver without PostgreSQL, and no Alembic at
    all (a worker reads the schema's revision, it never migrates PostgreSQL,
    and an embedded SQLite database at head is not migrated again)."""
    tag = uuid.uuid4().hex[:8]
    if config == "redis+sqlite":
        results = f"sqlite:///{tmp_path / 'results.sqlite3'}"
        celery_lease.migrate(results)  # at head already: the worker must not load Alembic
    else:
        results = pg_server.create_database(f"drv_{tag}")
        celery_lease.migrate(results)
    env = {
        "CL_BROKER": fresh_redis(),
        "CL_BACKEND": fresh_redis(),
        "CL_STORE": fresh_redis(),
        "CL_RESULTS": results,
    }
    app, tasks = build(env)
    worker = Worker(f"drv-{tag}", env, tmp_path, concurrency=1)
    try:
        worker.start()
        assert tasks.work.delay(f"drv-{tag}").get(timeout=60)["token"] > 0
        packages = set(tasks.census.delay().get(timeout=60)["packages"])
    finally:
        worker.stop()
        app.close()
    assert loaded <= packages, loaded - packages
    assert not absent & packages, absent & packages
