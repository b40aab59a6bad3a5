"""``result_backend = "lease+postgresql+psycopg://..."`` with a real prefork worker.

The backend's database is a PostgreSQL database of its own (not
``lease_result_url``'s), created empty and migrated by ``celery -A
tests.apps.leaseapp lease migrate``, as an operator would. Then, for a plain
task and for a LeasedTask: ``AsyncResult.get/state/info``, the
``result_extended`` fields, ``forget``, a group, and a chord of three header
tasks and a callback, each checked in ``celery_lease_task_meta`` too.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chord, group, states
from celery.result import AsyncResult
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from celery_lease.sql import database
from celery_lease.urls import redact_url
from tests.apps.leaseapp import build
from tests.servers import PostgresServer, RedisServer
from tests.workers import Worker, celery_cli

pytestmark = pytest.mark.timeout(180)


@dataclass
class Deployment:
    app: Celery
    tasks: Any
    backend_db: str  # the database after "lease+"
    worker: Worker


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private Redis for the module's worker: the broker (db 0) and the leases (db 1)."""
    server = RedisServer(tmp_path_factory.mktemp("broker"), appendonly=False)
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def deployment(
    broker: RedisServer,
    pg_server: PostgresServer,
    pg_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Deployment]:
    """One worker for the module (its start and the migration are most of the time)."""
    tmp_path = tmp_path_factory.mktemp("backend")
    name = f"backend_{uuid.uuid4().hex[:8]}"
    backend_db = pg_server.create_database(name)
    env = {
        "CL_BROKER": broker.url(0),
        "CL_BACKEND": f"lease+{backend_db}",
        "CL_STORE": broker.url(1),
        "CL_RESULTS": pg_url,
        "CL_TTL": "10",
        "CL_LOG": str(tmp_path / "exec.log"),
        "CL_SETTINGS": json.dumps({"result_extended": True}),
    }
    migrated = celery_cli(env, "lease", "migrate")
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    assert f"migrated {redact_url(backend_db)}" in migrated.stdout.splitlines()
    worker = Worker("backend", env, tmp_path, concurrency=3).start()
    app, tasks = build(env)
    try:
        yield Deployment(app, tasks, backend_db, worker)
    finally:
        worker.kill()
        app.close()
        database(backend_db).dispose()
        pg_server.drop_database(name)


def stored(url: str, key: str) -> Any:
    """The JSON a key holds in ``celery_lease_task_meta`` (None: no row), read from the
    table itself."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            value = conn.execute(
                text("SELECT value FROM celery_lease_task_meta WHERE key = :k"), {"k": key}
            ).scalar()
    finally:
        engine.dispose()
    return None if value is None else json.loads(value)


def check_forget(d: Deployment, result: AsyncResult) -> None:
    key = f"celery-task-meta-{result.id}"
    assert stored(d.backend_db, key) is not None
    result.forget()
    assert AsyncResult(result.id, app=d.app).state == states.PENDING
    assert stored(d.backend_db, key) is None


def check_chord_counted(d: Deployment, result: AsyncResult) -> None:
    """The chord completed through Celery's counter (``incr`` on ``chord-unlock-<group
    id>``, removed once the callback is sent), never the ``celery.chord_unlock``
    polling task Celery falls back to for backends without one."""
    assert result.parent is not None
    assert stored(d.backend_db, f"chord-unlock-{result.parent.id}") is None
    log = d.worker.log_text()
    assert f"Task leaseapp.collect[{result.id}] received" in log  # the log names each task
    assert "celery.chord_unlock" not in log


@pytest.mark.redis
def test_a_plain_task_through_the_lease_backend(deployment: Deployment) -> None:
    d, add = deployment, deployment.tasks.add
    done = add.delay(2, 3)
    assert done.get(timeout=60) == 5
    assert (done.state, done.info) == (states.SUCCESS, 5)
    assert (done.name, done.args, done.kwargs) == ("leaseapp.add", [2, 3], {})
    meta = stored(d.backend_db, f"celery-task-meta-{done.id}")
    assert meta is not None
    assert (meta["status"], meta["result"], meta["name"], meta["args"]) == (
        states.SUCCESS,
        5,
        "leaseapp.add",
        [2, 3],
    )

    failed = add.delay(2, "x")
    with pytest.raises(TypeError):
        failed.get(timeout=60)
    assert failed.state == states.FAILURE and isinstance(failed.info, TypeError)

    check_forget(d, done)

    members = group(add.s(i, i) for i in range(3)).apply_async()
    assert members.get(timeout=60) == [0, 2, 4]

    joined = chord([add.s(i, 1) for i in range(3)], d.tasks.collect.s()).apply_async()
    assert joined.get(timeout=60) == [1, 2, 3]
    assert joined.state == states.SUCCESS
    check_chord_counted(d, joined)


@pytest.mark.redis
def test_a_leased_task_through_the_lease_backend(deployment: Deployment) -> None:
    d, work = deployment, deployment.tasks.work
    key = f"backend-{uuid.uuid4().hex}"
    done = work.delay(key, 0.0, "one")
    value = done.get(timeout=60)
    assert (value["key"], value["tag"]) == (key, "one")
    assert (done.state, done.info) == (states.SUCCESS, value)
    assert (done.name, done.args) == ("leaseapp.work", [key, 0.0, "one"])
    # The same value in the fenced result table, under the same task id and token.
    accepted = work.accepted(key=key)
    assert accepted is not None
    assert (accepted.task_id, accepted.token, accepted.value) == (done.id, value["token"], value)

    check_forget(d, done)

    keys = [f"backend-{uuid.uuid4().hex}" for _ in range(3)]
    members = group(work.s(k, 0.0, f"g{i}") for i, k in enumerate(keys)).apply_async()
    assert [v["key"] for v in members.get(timeout=60)] == keys

    keys = [f"backend-{uuid.uuid4().hex}" for _ in range(3)]
    header = [work.s(k, 0.2, f"c{i}") for i, k in enumerate(keys)]
    joined = chord(header, d.tasks.collect.s()).apply_async()
    values = joined.get(timeout=60)
    assert [(v["key"], v["tag"]) for v in values] == [(k, f"c{i}") for i, k in enumerate(keys)]
    assert joined.state == states.SUCCESS
    check_chord_counted(d, joined)


# -- what the worker refuses at start ---------------------------------------------------


def refusal_env(backend: str, tmp_path: Path, **settings: Any) -> dict[str, str]:
    store = f"sqlite:///{tmp_path / 'lease.sqlite3'}"
    return {
        "CL_BROKER": "memory://",
        "CL_BACKEND": backend,
        "CL_STORE": store,
        "CL_RESULTS": store,
        "CL_SETTINGS": json.dumps(settings),
    }


def refusal_line(worker: Worker) -> str:
    code, log = worker.run_to_exit(timeout=60)
    assert code == 1, log[-3000:]
    assert " ready." not in log and "Traceback" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if line.startswith("Error: celery-lease:")]
    assert len(lines) == 1, log[-3000:]
    return lines[0]


def test_a_worker_refuses_a_backend_database_lease_migrate_has_not_created(
    pg_server: PostgresServer, tmp_path: Path
) -> None:
    name = f"backend_bare_{uuid.uuid4().hex[:8]}"
    bare = pg_server.create_database(name)
    try:
        line = refusal_line(Worker("bare", refusal_env(f"lease+{bare}", tmp_path), tmp_path))
    finally:
        pg_server.drop_database(name)
    assert re.fullmatch(
        rf"Error: celery-lease: SchemaNotCurrent: the database {re.escape(bare)} has no "
        r"celery-lease tables or an older schema \(.+\): run celery -A tests\.apps\.leaseapp "
        r"lease migrate",
        line,
    ), line


def test_a_worker_refuses_a_result_serializer_other_than_json(tmp_path: Path) -> None:
    backend = f"lease+sqlite:///{tmp_path / 'backend.sqlite3'}"
    env = refusal_env(backend, tmp_path, result_serializer="pickle")
    line = refusal_line(Worker("pickle", env, tmp_path))
    assert line == (
        "Error: celery-lease: LeaseBackendConfigError: result_serializer must be 'json' for "
        "the lease result backend (it stores task metadata as JSON only), got 'pickle'"
    )
