"""The regression tests' cell: the chaos app's workers on private servers.

A cell holds one private Redis (broker, result backend and lease store in
databases 0, 1 and 2, unless a test names another broker or store), the
fenced result table in PostgreSQL, and the bodies' history file; the tests
start prefork workers of :mod:`tests.chaos.app`, each on queues of its own,
so that a test decides which worker receives which message.
The fixtures ``cell`` and ``etcd_cell`` (leases in etcd) are in
``tests/chaos/conftest.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import create_engine, text

import celery_lease
from celery_lease import LeaseStore
from tests.chaos.app import PROTECTED_DDL, build
from tests.chaos.cluster import ChaosWorker
from tests.servers import RedisServer
from tests.workers import read_log

__all__ = [
    "TTL",
    "Cell",
    "holds_copy",
    "is_event",
    "late_copy_outcome",
    "lease_live",
    "message_of",
    "message_restored",
]

TTL = 2.0


class Cell:
    def __init__(
        self,
        tmp: Path,
        redis: RedisServer,
        pg_url: str,
        broker: str | None = None,
        store_url: str | None = None,
    ) -> None:
        celery_lease.migrate(pg_url)
        engine = create_engine(pg_url)
        with engine.begin() as conn:
            conn.execute(text(PROTECTED_DDL))
        engine.dispose()
        self.history = tmp / "history.jsonl"
        self.env = {
            "CHAOS_BROKER": broker or redis.url(0),
            "CHAOS_BACKEND": redis.url(1),
            "CHAOS_STORE": store_url or redis.url(2),
            "CHAOS_RESULTS": pg_url,
            "CHAOS_HISTORY": str(self.history),
            "CHAOS_TTL": str(TTL),
            "CHAOS_VT": "3600",
        }
        self.logdir = tmp
        self.app, self.tasks = build(self.env)
        self.store = LeaseStore.from_url(store_url or redis.url(2), key_prefix="celery-lease")
        self.workers: list[ChaosWorker] = []

    def restart_env(self, *, vt: float) -> None:
        """Change the visibility timeout (before any worker starts)."""
        assert not self.workers
        self.env["CHAOS_VT"] = str(vt)
        self.app, self.tasks = build(self.env)

    def worker(self, name: str, queues: str, skew: str | None = None) -> ChaosWorker:
        w = ChaosWorker(
            name, self.env, self.logdir, pool="prefork", concurrency=1, extra_args=("-Q", queues)
        )
        self.workers.append(w)
        w.launch(skew)
        w.wait_ready()
        return w

    def state(self, task_id: str) -> dict[str, Any]:
        meta: dict[str, Any] = self.app.backend.get_task_meta(task_id, cache=False)
        return meta

    def records(self, pred: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        return [r for r in read_log(self.history) if pred(r)]

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.store.close()


def is_event(
    event: str, task_id: str, pid_not: int | None = None
) -> Callable[[dict[str, Any]], bool]:
    return lambda r: r["ev"] == event and r["task_id"] == task_id and r["pid"] != pid_not


def lease_live(cell: Cell, key: str) -> bool:
    record = cell.store.inspect(key)
    return record is not None and record.live


def message_of(raw: bytes) -> dict[str, Any]:
    """The kombu message in a queue entry or in an ``unacked`` hash value."""
    payload = json.loads(raw)
    if isinstance(payload, list):  # the unacked hash keeps [message, exchange, routing key]
        payload = payload[0]
    return payload  # type: ignore[no-any-return]


def late_copy_outcome(cell: Cell, worker: ChaosWorker, task_id: str) -> str | None:
    if f"LEASE_REJECTED {task_id}" in worker.log_text():
        return "rejected"
    if len(cell.records(is_event("start", task_id))) > 1:
        return "ran again"
    return None


def holds_copy(cell: Cell, task_id: str) -> bool:
    """True while a deferred copy of ``task_id`` (it has a defer id) is unacked."""
    client = redis.Redis.from_url(cell.env["CHAOS_BROKER"])
    try:
        messages = [message_of(v) for v in client.hvals("unacked")]
    finally:
        client.close()
    return any(
        m["headers"].get("id") == task_id and m["headers"].get("lease_defer_id") for m in messages
    )


def message_restored(cell: Cell, task_id: str) -> bool:
    """True once the broker took ``task_id``'s message out of its unacked set.

    Only a restore does that while the worker holding the message is stopped
    (an ack would too, but a stopped worker acks nothing).
    """
    client = redis.Redis.from_url(cell.env["CHAOS_BROKER"])
    try:
        return not any(task_id.encode() in v for v in client.hvals("unacked"))
    finally:
        client.close()
