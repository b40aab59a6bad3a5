"""Chains, groups and chords: a deferred or rejected member never leaves a chord waiting.

A deferred member is re-published with its chord header, so when it runs
after the holder its result completes the chord; a rejected member records
FAILURE through the backend with its request, so the chord resolves with an
error instead of waiting forever.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import chain, chord, group
from celery.exceptions import ChordError

import celery_lease
from tests.apps.leaseapp import build
from tests.workers import Worker, read_log


@pytest.fixture(scope="module")
def canvas(redis_server: Any, pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    celery_lease.migrate(pg_url)
    tmp = tmp_path_factory.mktemp("canvas")
    for db in (55, 56, 57):  # module-scoped, so not fresh_redis: emptied here instead
        redis_server.flushdb(db)
    env = {
        "CL_BROKER": redis_server.url(55),
        "CL_BACKEND": redis_server.url(56),
        "CL_STORE": redis_server.url(57),
        "CL_RESULTS": pg_url,
        "CL_TTL": "3",
        "CL_LOG": str(tmp / "exec.log"),
    }
    worker = Worker("canvas", env, tmp, concurrency=3).start()
    app, tasks = build(env)
    try:
        yield tasks, Path(env["CL_LOG"])
    finally:
        worker.kill()
        app.close()


def key() -> str:
    return f"canvas-{uuid.uuid4().hex}"


def test_chord_waits_for_a_deferred_member_then_completes(canvas: Any) -> None:
    tasks, log = canvas
    shared = key()
    # Two members on one key: one holds it, the other is deferred and runs after.
    result = chord(
        [tasks.work.s(shared, 1.0, "first"), tasks.work.s(shared, 0.0, "second")],
        tasks.collect.s(),
    ).apply_async()
    values = result.get(timeout=60)
    assert sorted(v["tag"] for v in values) == ["first", "second"]
    assert values[0]["token"] != values[1]["token"]
    starts = [r for r in read_log(log) if r["event"] == "start" and r["key"] == shared]
    assert len(starts) == 2  # each member's body ran once


def test_chord_with_a_rejected_member_resolves_with_an_error(canvas: Any) -> None:
    tasks, log = canvas
    busy = key()
    holder = tasks.work.delay(busy, 3.0, "holder")
    wait_started(log, holder.id)
    result = chord(
        [tasks.work.s(key(), 0.0, "free"), tasks.work_reject.s(busy, 0.0, "rejected")],
        tasks.collect.s(),
    ).apply_async()
    with pytest.raises((ChordError, celery_lease.LeaseNotAcquired)):
        result.get(timeout=60)
    assert holder.get(timeout=30)["tag"] == "holder"


def test_group_and_chain_of_leased_tasks(canvas: Any) -> None:
    tasks, _ = canvas
    shared = key()
    values = (
        group(tasks.work.s(shared, 0.3, str(i)) for i in range(3)).apply_async().get(timeout=60)
    )
    tokens = [v["token"] for v in values]
    assert len(set(tokens)) == 3  # one grant each, one at a time on the shared key
    done = chain(tasks.work.si(key(), 0.0, "a"), tasks.work.si(key(), 0.0, "b")).apply_async()
    assert done.get(timeout=30)["tag"] == "b"


def wait_started(log: Path, task_id: str) -> None:
    from tests.servers import wait_for

    wait_for(
        lambda: any(r["event"] == "start" and r["task_id"] == task_id for r in read_log(log)),
        30,
        f"{task_id} to start",
    )
