"""The worker cluster of the ``LeasedTask`` acceptance tests, and their helpers.

One cluster per test (or per module): a private Redis broker and result
backend, a lease store (Redis or PostgreSQL), the fenced result table in
PostgreSQL, and workers of ``tests/apps/leaseapp.py`` in subprocesses
(prefork, ``acks_late``, ``task_reject_on_worker_lost``). Task bodies write an
independent, fsync'd execution log (one ``start`` and one ``end`` line per
body, with task id, token, pid, hostname), so executions are counted without
trusting the plugin's own tables. The fixtures ``make_cluster`` and
``pg_results`` are in ``tests/acceptance/conftest.py``.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from celery_lease import (
    LeaseRecord,
    LeaseStore,
)
from celery_lease.results import ResultTable
from tests.apps.leaseapp import build
from tests.servers import wait_for
from tests.workers import Worker, _state, read_log

#: Lease TTL of the fault tests (seconds): short, so leases lapse quickly.
TTL = 2.0


class Cluster:
    """Broker + backend + lease store + result table + execution log + workers."""

    def __init__(
        self,
        logdir: Path,
        *,
        broker: str,
        backend: str,
        store_url: str,
        results_url: str,
        ttl: float,
        vt: float | None = None,
        store_options: dict[str, Any] | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.logdir = logdir
        self.store_url = store_url
        self.store_options = store_options or {}
        self.results_url = results_url
        self.ttl = ttl
        self.exec_log = logdir / f"exec-{uuid.uuid4().hex[:8]}.log"
        self.env = {
            "CL_BROKER": broker,
            "CL_BACKEND": backend,
            "CL_STORE": store_url,
            "CL_RESULTS": results_url,
            "CL_TTL": str(ttl),
            "CL_LOG": str(self.exec_log),
        }
        if vt is not None:
            self.env["CL_VT"] = str(vt)
        conf = dict(settings or {})
        if self.store_options:
            conf["lease_store_options"] = self.store_options
        if conf:
            self.env["CL_SETTINGS"] = json.dumps(conf)
        self.app, self.tasks = build(self.env)
        self.workers: list[Worker] = []
        self._store: LeaseStore | None = None
        self._table: ResultTable | None = None

    # -- workers ---------------------------------------------------------

    def worker(self, name: str, *, queue: str | None = None, concurrency: int = 1) -> Worker:
        extra = ("-Q", queue) if queue else ()
        w = Worker(name, self.env, self.logdir, concurrency=concurrency, extra_args=extra)
        self.workers.append(w)
        return w

    def start(self, *workers: Worker) -> None:
        """Start the workers side by side (each waits for its own "ready")."""
        with ThreadPoolExecutor(len(workers)) as pool:
            list(pool.map(lambda w: w.start(), workers))

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        # Drop the test's AsyncResults while the backend still answers: their
        # __del__ unsubscribes from it.
        gc.collect()
        self.app.close()

    # -- the lease store and the result table, as a client sees them -------

    @property
    def store(self) -> LeaseStore:
        if self._store is None:
            self._store = LeaseStore.from_url(self.store_url, **self.store_options)
        return self._store

    @property
    def table(self) -> ResultTable:
        if self._table is None:
            self._table = ResultTable(self.results_url)
        return self._table

    # -- the execution log ---------------------------------------------------

    def rows(self, event: str, task_id: str) -> list[dict[str, Any]]:
        return [
            r for r in read_log(self.exec_log) if r["event"] == event and r["task_id"] == task_id
        ]

    def starts(self, task_id: str) -> list[dict[str, Any]]:
        return self.rows("start", task_id)

    def ends(self, task_id: str) -> list[dict[str, Any]]:
        return self.rows("end", task_id)

    def wait_start(self, task_id: str, n: int = 1, timeout: float = 20.0) -> dict[str, Any]:
        """The ``n``-th body start of ``task_id`` (waits for it)."""
        rows = wait_for(
            lambda: (lambda s: s if len(s) >= n else None)(self.starts(task_id)),
            timeout,
            f"body start #{n} of {task_id}",
        )
        return rows[n - 1]

    def worker_logs(self) -> str:
        return "".join(w.log_text() for w in self.workers)


def new_key(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def lapsed(store: LeaseStore, key: str) -> LeaseRecord | None:
    """The key's record once no live lease holds it (expired in store time)."""
    rec = store.inspect(key)
    return rec if rec is not None and not rec.live else None


def gone(pid: int) -> bool:
    """True once ``pid`` exited and was reaped (no /proc entry) or is a zombie."""
    return _state(pid) in ("?", "Z")


def backend_state(c: Cluster, task_id: str) -> tuple[str, Any]:
    """State and result of ``task_id`` as the result backend holds it now (not cached)."""
    meta = c.app.backend.get_task_meta(task_id, cache=False)
    result = meta.get("result")
    if meta.get("status") == "FAILURE":
        result = c.app.backend.exception_to_python(result)
    return meta.get("status"), result


def in_log(worker: Worker, text: str) -> Callable[[], bool]:
    return lambda: text in worker.log_text()


def kill_child(worker: Worker, pid: int) -> float:
    """SIGKILL ``pid`` (a prefork child of ``worker``); returns when it is proven dead."""
    assert pid in worker.children(), f"{pid} is not a child of {worker.name}"
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: gone(pid) and pid not in worker.children(), 10, f"child {pid} to die")
    wait_for(in_log(worker, "signal 9 (SIGKILL)"), 10, f"{worker.name} to notice the lost child")
    return killed_at
