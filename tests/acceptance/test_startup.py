"""What a real ``celery worker`` says and does at start (``celery_lease.startup``).

* one banner line: the store and results URLs (passwords masked), whether
  each answered, the key prefix and the TTL;
* a lease store unreachable at start: one WARNING naming the URL and the
  error, and the worker starts all the same;
* a PostgreSQL results database without celery-lease's tables: the worker
  refuses to start with one line naming the database and ``lease migrate``;
* a bad setting: one ``Error:`` line, no traceback.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import celery_lease
from celery_lease.urls import redact_url
from tests.servers import PostgresServer, free_port
from tests.workers import Worker

pytestmark = pytest.mark.timeout(120)


def _env(store: str, results: str, settings: dict[str, Any] | None = None) -> dict[str, str]:
    return {
        "CL_BROKER": "memory://",
        "CL_BACKEND": "cache+memory://",
        "CL_STORE": store,
        "CL_RESULTS": results,
        "CL_SETTINGS": json.dumps(settings or {}),
    }


def _with_password(url: str, password: str) -> str:
    """``url`` with a password (the test cluster trusts local connections, so it is unused)."""
    return url.replace("postgres@", f"postgres:{password}@", 1)


def _lines(log: str, text: str) -> list[str]:
    return [line for line in log.splitlines() if text in line]


def test_the_banner_is_one_line_naming_store_results_prefix_and_ttl(
    fresh_redis: Callable[[], str], pg_server: PostgresServer, tmp_path: Path
) -> None:
    results = _with_password(pg_server.create_database(f"banner_{uuid.uuid4().hex[:8]}"), "s3cret")
    celery_lease.migrate(results)
    store = fresh_redis()
    worker = Worker("banner", _env(store, results, {"lease_key_prefix": "acme"}), tmp_path)
    try:
        log = worker.start().log_text()
    finally:
        worker.kill()
    banner = _lines(log, "celery-lease: store ")
    assert len(banner) == 1, log[-3000:]
    assert banner[0].endswith(
        f"celery-lease: store {store} (reachable), results {redact_url(results)} "
        "(schema at head), key prefix 'acme', TTL 3s"
    ), banner
    assert "INFO/MainProcess" in banner[0]
    assert "s3cret" not in log
    assert "postgres:***@" in banner[0]


def test_an_unreachable_store_at_start_warns_and_the_worker_starts(tmp_path: Path) -> None:
    store = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    worker = Worker("nostore", _env(store, f"sqlite:///{tmp_path / 'r.sqlite3'}"), tmp_path)
    try:
        log = worker.start().log_text()  # " ready.": it started
    finally:
        worker.kill()
    warning = _lines(log, f"the lease store {store} is unreachable at start")
    assert len(warning) == 1, log[-3000:]
    assert "WARNING/MainProcess" in warning[0]
    assert "Connection refused" in warning[0]  # the error itself, proving the fault
    assert "their work waits, it is not lost" in warning[0]
    assert f"celery-lease: store {store} (UNREACHABLE)" in log


def test_missing_tables_refuse_to_start_in_one_line(
    fresh_redis: Callable[[], str], pg_server: PostgresServer, tmp_path: Path
) -> None:
    results = pg_server.create_database(f"bare_{uuid.uuid4().hex[:8]}")  # never migrated
    worker = Worker("bare", _env(fresh_redis(), results), tmp_path)
    code, log = worker.run_to_exit(timeout=60)
    assert code == 1, log[-3000:]
    assert " ready." not in log
    assert "Traceback" not in log, log[-3000:]
    refusal = _lines(log, "Error: celery-lease:")
    assert len(refusal) == 1, log[-3000:]
    assert re.fullmatch(
        rf"Error: celery-lease: SchemaNotCurrent: the database {re.escape(results)} has no "
        r"celery-lease tables or an older schema \(.+\): run celery -A tests\.apps\.leaseapp "
        r"lease migrate",
        refusal[0],
    ), refusal[0]


def test_a_bad_setting_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lease.sqlite3'}"
    worker = Worker("badttl", _env(url, url, {"lease_ttl": -1}), tmp_path)
    code, log = worker.run_to_exit(timeout=60)
    assert code == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert _lines(log, "lease_ttl") == [
        "Error: celery-lease: LeaseConfigError: lease_ttl must be greater than 0, got -1"
    ], log[-3000:]
