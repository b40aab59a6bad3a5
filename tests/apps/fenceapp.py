"""A Celery app with a lock-only task that writes through ``fencing.guard``
(``tests/acceptance/test_fencing_overlap.py``), configured from CL_* environment variables.

The body records its start (with its token) in an fsync'd execution log, waits
until the file named by its ``go`` argument exists (so the test decides when
each owner writes), then writes one row to ``overlap_writes`` in CL_GUARD_DB,
guarded with ``self.lease``, and records whether the guard accepted it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from celery import Celery
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

from celery_lease import LeasedTask, StaleFencingToken, fencing

CREATE_WRITES = (
    "CREATE TABLE IF NOT EXISTS overlap_writes "
    "(resource TEXT NOT NULL, token BIGINT NOT NULL, writer TEXT NOT NULL)"
)
INSERT_WRITE = "INSERT INTO overlap_writes (resource, token, writer) VALUES (:r, :t, :w)"

_engines: dict[int, Engine] = {}


def _engine(url: str) -> Engine:
    """This process's engine for the guarded table (a prefork child makes its own)."""
    engine = _engines.get(os.getpid())
    if engine is None:
        engine = _engines[os.getpid()] = create_engine(url, poolclass=NullPool)
    return engine


def build(environ: Mapping[str, str]) -> tuple[Celery, Any]:
    env = environ.get
    app = Celery("fenceapp", broker=env("CL_BROKER"), backend=env("CL_BACKEND"))
    app.conf.update(
        lease_store_url=env("CL_STORE"),
        lease_result_url=env("CL_RESULTS") or None,
        lease_ttl=float(env("CL_TTL", "2")),
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_track_started=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="fenceapp.guarded_write",
        lease_key="{key}",
        lease_commit=False,
    )
    def guarded_write(self: Any, key: str, tag: str, go: str) -> dict[str, Any]:
        lease = self.lease
        log = env("CL_LOG")
        record(log, "start", task_id=self.request.id, key=key, token=lease.token, tag=tag)
        deadline = time.monotonic() + 60.0
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            with _engine(env("CL_GUARD_DB", "")).begin() as conn:
                fencing.guard(conn, key, lease)
                conn.execute(text(INSERT_WRITE), {"r": key, "t": lease.token, "w": tag})
        except StaleFencingToken as e:
            record(log, "refused", task_id=self.request.id, token=lease.token, reason=str(e))
            raise
        record(log, "wrote", task_id=self.request.id, token=lease.token)
        return {"token": lease.token, "tag": tag}

    return app, guarded_write


def record(path: str | None, event: str, **fields: Any) -> None:
    if not path:
        return
    line = json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


app, guarded_write = build(os.environ)
