"""A real worker's log lines name the key, token, task id and reason in their text.

Celery's default log format shows only the message, not ``extra=``, so every
lease transition must say what it is about in the message itself. Driven with
a prefork worker (``tests/apps/leaseapp.py``): a lease evicted under its
running body (lease lost, then FENCED; re-queued, as no one else holds the
key, and accepted on its next run), and a deferral behind a live owner.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from celery_lease import LeaseStore
from tests.apps.leaseapp import build
from tests.servers import wait_for
from tests.workers import Worker, read_log

pytestmark = pytest.mark.timeout(150)


def _env(fresh_redis: Callable[[], str], tmp_path: Path) -> dict[str, str]:
    url = f"sqlite:///{tmp_path / 'lease.sqlite3'}"
    return {
        "CL_BROKER": fresh_redis(),
        "CL_BACKEND": fresh_redis(),
        "CL_STORE": url,
        "CL_RESULTS": url,
        "CL_TTL": "3",
        "CL_LOG": str(tmp_path / "exec.log"),
        "CL_SETTINGS": json.dumps({}),
    }


def _started(log: Path, task_id: str) -> dict[str, object] | None:
    return next(
        (r for r in read_log(log) if r["event"] == "start" and r["task_id"] == task_id), None
    )


def _line(worker: Worker, pattern: str) -> str:
    """The first log line matching ``pattern``, waited for."""
    rx = re.compile(pattern)
    return wait_for(
        lambda: next((ln for ln in worker.log_text().splitlines() if rx.search(ln)), None),
        30,
        f"a log line matching {pattern!r}",
    )


def _evicted_run(
    fresh_redis: Callable[[], str], tmp_path: Path
) -> tuple[Worker, str, str, int, int]:
    """A worker whose running body had its lease evicted (with no new owner, the
    task is re-queued and runs again); (worker, key, task id, evicted token,
    token of the accepted result)."""
    env = _env(fresh_redis, tmp_path)
    worker = Worker("logs", env, tmp_path, concurrency=2).start()
    _, tasks = build(env)
    key = f"log-{uuid.uuid4().hex[:8]}"
    result = tasks.work.delay(key, 4.0)
    start = wait_for(lambda: _started(Path(env["CL_LOG"]), result.id), 30, "the body to start")
    token = int(start["token"])  # type: ignore[call-overload]
    store = LeaseStore.from_url(env["CL_STORE"])
    assert store.evict(key) is not None  # the fault: the running body's lease is gone
    accepted = int(result.get(timeout=60)["token"])
    assert accepted > token
    return worker, key, result.id, token, accepted


def test_lease_lost_and_result_accepted_name_key_token_and_task(
    fresh_redis: Callable[[], str], tmp_path: Path
) -> None:
    worker, key, task_id, token, accepted_token = _evicted_run(fresh_redis, tmp_path)
    try:
        lost = _line(worker, rf"lease lost: key={key} ")
        assert f"lease lost: key={key} token={token} task={task_id} reason=" in lost, lost
        assert "renewal refused" in lost, lost
        accepted = _line(worker, rf"result accepted key={key} ")
        assert accepted.endswith(
            f"result accepted key={key} token={accepted_token} task={task_id}"
        ), accepted
    finally:
        worker.kill()


def test_task_transitions_name_key_token_task_and_reason(
    fresh_redis: Callable[[], str], tmp_path: Path
) -> None:
    worker, key, task_id, token, _ = _evicted_run(fresh_redis, tmp_path)
    try:
        granted = _line(worker, rf"lease granted key={key} token={token} ")
        assert granted.endswith(f"lease granted key={key} token={token} task={task_id}")
        lost = _line(worker, rf"LEASE_LOST {task_id} ")
        assert f"LEASE_LOST {task_id} key={key} token={token} reason=" in lost, lost
        fenced = _line(worker, rf"FENCED {task_id} ")
        assert f"FENCED {task_id} key={key} token={token} reason=" in fenced, fenced

        env = worker.env  # the same broker and store as the worker's
        _, tasks = build(env)
        first = tasks.work.delay(key, 2.0)
        wait_for(lambda: _started(Path(env["CL_LOG"]), first.id), 30, "the owner to start")
        second = tasks.work.delay(key, 0.0)
        deferred = _line(worker, rf"LEASE_DEFERRED {second.id} ")
        assert f"LEASE_DEFERRED {second.id} key={key} token=- reason=" in deferred, deferred
        assert "another owner holds the lease" in deferred
        first.get(timeout=30)
        second.get(timeout=30)
    finally:
        worker.kill()
