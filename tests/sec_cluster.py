"""A small cluster for the tenant, outage and bad-input worker tests.

Broker + result backend + lease store + fenced result table + an fsync'd
execution log + real ``celery -A tests.apps.tenantapp worker`` processes
(``tests/workers.py``). Not fixtures: each test module builds what it needs.
"""

from __future__ import annotations

import gc
import json
import socket
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from celery_lease import LeaseStore
from celery_lease.results import ResultTable
from tests.apps.tenantapp import build_tenant
from tests.servers import wait_for
from tests.workers import Worker, read_log

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.apps.tenantapp"


class Cluster:
    def __init__(
        self,
        logdir: Path,
        *,
        broker: str,
        backend: str,
        store_url: str,
        results_url: str,
        ttl: float,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        self.logdir = logdir
        self.store_url = store_url
        self.results_url = results_url
        self.exec_log = logdir / f"exec-{uuid.uuid4().hex[:8]}.log"
        self.env = {
            "CL_BROKER": broker,
            "CL_BACKEND": backend,
            "CL_STORE": store_url,
            "CL_RESULTS": results_url,
            "CL_TTL": str(ttl),
            "CL_LOG": str(self.exec_log),
            "CL_SETTINGS": json.dumps(dict(settings or {})),
        }
        self.app, self.tasks = build_tenant(self.env)
        self.workers: list[Worker] = []
        self._store: LeaseStore | None = None
        self._table: ResultTable | None = None

    def worker(self, name: str, *, concurrency: int = 1) -> Worker:
        w = Worker(name, self.env, self.logdir, concurrency=concurrency, app=APP)
        self.workers.append(w)
        return w

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        gc.collect()
        self.app.close()
        if self._store is not None:
            self._store.close()

    @property
    def store(self) -> LeaseStore:
        if self._store is None:
            self._store = LeaseStore.from_url(self.store_url)
        return self._store

    @property
    def table(self) -> ResultTable:
        if self._table is None:
            self._table = ResultTable(self.results_url)
        return self._table

    # -- the execution log ------------------------------------------------------

    def rows(self, event: str, task_id: str | None = None) -> list[dict[str, Any]]:
        return [
            r
            for r in read_log(self.exec_log)
            if r["event"] == event and (task_id is None or r["task_id"] == task_id)
        ]

    def wait_row(self, event: str, task_id: str, timeout: float = 30.0) -> dict[str, Any]:
        rows = wait_for(lambda: self.rows(event, task_id) or None, timeout, f"{event} of {task_id}")
        return rows[0]

    def backend_state(self, task_id: str) -> tuple[str, Any]:
        meta = self.app.backend.get_task_meta(task_id, cache=False)
        result = meta.get("result")
        if meta.get("status") == "FAILURE":
            result = self.app.backend.exception_to_python(result)
        return meta.get("status"), result

    def wait_state(self, task_id: str, states: tuple[str, ...], timeout: float = 40.0) -> Any:
        return wait_for(
            lambda: (lambda s: s if s[0] in states else None)(self.backend_state(task_id)),
            timeout,
            f"{task_id} in {states}",
        )

    def worker_logs(self) -> str:
        return "".join(w.log_text() for w in self.workers)

    # -- the CLI -------------------------------------------------------------------

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """``celery -A tests.apps.tenantapp lease ARGS...`` in a subprocess."""
        import os

        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", APP, "lease", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=timeout,
        )

    def cli_here(self, *args: str) -> tuple[int, str, str]:
        """The same command run in this process (click's runner): (exit code, stdout, stderr).

        Celery's own ``celery`` group parses ``-A``, exactly as in a subprocess, but
        without a second interpreter start (about 2 s each).
        """
        from celery.bin.celery import celery as main
        from click.testing import CliRunner

        global CLI_APP
        CLI_APP = self.app
        result = CliRunner().invoke(main, ["-A", "tests.sec_cluster:CLI_APP", "lease", *args])
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result.exit_code, result.stdout, result.stderr


#: The app ``celery -A tests.sec_cluster:CLI_APP`` finds (set by :meth:`Cluster.cli_here`).
CLI_APP: Any = None


def refused(port: int, host: str = "127.0.0.1") -> bool:
    """True if a TCP connection to ``port`` is refused right now (the server is down)."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False
