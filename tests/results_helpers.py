"""Helpers for the fenced-result, fencing and sweep suites.

Not fixtures themselves (conftest.py belongs to the server infrastructure):
each module builds its own fixtures with :func:`make_pairing`.

A *pairing* is where the leases live and where the results live:

* ``redis+pg``      -- leases in Redis, results in PostgreSQL (register/lock path)
* ``pg+pg``         -- leases and results in one PostgreSQL database (one-transaction path)
* ``sqlite+sqlite`` -- leases and results in one SQLite file (one-transaction path)
* ``redis+sqlite``  -- leases in Redis, results in SQLite (register/lock path, BEGIN IMMEDIATE)
* ``sqlite+pg``     -- leases in a SQLite file, results in PostgreSQL (register/lock
  path with a SQL lease store: a lease row stays when its lease runs out)
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import pytest
from celery import Celery
from sqlalchemy import text

import celery_lease
from celery_lease import Lease, LeaseRecord, LeaseStore
from celery_lease.backend import LeaseBackend
from celery_lease.results import ResultTable
from celery_lease.sql import database
from tests.servers import wait_for

__all__ = [
    "PAIRINGS",
    "Pairing",
    "make_pairing",
    "migrated_pg_url",
    "new_key",
    "result_rows",
    "wait_for",
    "wait_until_expired",
]

PAIRINGS = ("redis+pg", "pg+pg", "sqlite+sqlite", "redis+sqlite", "sqlite+pg")

_migrated: set[str] = set()


def migrated_pg_url(request: pytest.FixtureRequest) -> str:
    """The module's PostgreSQL database, with celery-lease's tables."""
    url: str = request.getfixturevalue("pg_url")
    if url not in _migrated:
        celery_lease.migrate(url)
        _migrated.add(url)
    return url


@dataclass
class Pairing:
    kind: str
    store_url: str
    result_url: str
    store: LeaseStore
    table: ResultTable

    def close(self) -> None:
        self.store.close()


def make_pairing(request: pytest.FixtureRequest, kind: str, **table_options: object) -> Pairing:
    """Build the store and result table of ``kind`` on the session's private servers."""
    if kind == "redis+pg":
        store_url: str = request.getfixturevalue("redis_url")
        result_url = migrated_pg_url(request)
    elif kind == "pg+pg":
        store_url = result_url = migrated_pg_url(request)
    elif kind == "redis+sqlite":
        store_url = request.getfixturevalue("redis_url")
        result_url = request.getfixturevalue("sqlite_url")
        celery_lease.migrate(result_url)
    elif kind == "sqlite+sqlite":
        store_url = result_url = request.getfixturevalue("sqlite_url")
        celery_lease.migrate(store_url)
    elif kind == "sqlite+pg":
        store_url = request.getfixturevalue("sqlite_url")
        celery_lease.migrate(store_url)
        result_url = migrated_pg_url(request)
    else:  # pragma: no cover - a typo in a parametrization
        raise ValueError(kind)
    store = LeaseStore.from_url(store_url)
    table = ResultTable(result_url, store, **table_options)  # type: ignore[arg-type]
    # The pairing is what the test is about: make sure the intended commit path runs.
    leases, results = kind.split("+")
    assert table.colocated is (leases == results), (kind, table.colocated)
    return Pairing(kind, store_url, result_url, store, table)


def new_key(prefix: str = "k") -> str:
    """A key no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def wait_until_expired(
    store: LeaseStore, lease: Lease, timeout: float = 10.0
) -> LeaseRecord | None:
    """Let ``lease`` lapse in *store* time and prove it did with ``store.inspect``.

    Sleeps the remaining store time (the one place a sleep is the point), then
    polls until the store's clock is past ``expires_at`` and the store no
    longer reports the lease as held by its owner.
    """
    remaining = lease.expires_at - store.time()
    if remaining > 0:
        time.sleep(remaining)

    def lapsed() -> bool:
        if store.time() <= lease.expires_at:
            return False
        record = store.inspect(lease.key)
        return record is None or not (record.live and record.owner_id == lease.owner_id)

    wait_for(lapsed, timeout, f"lease {lease.key} token {lease.token} to lapse")
    record = store.inspect(lease.key)
    assert record is None or not record.live, record
    assert store.renew(lease) is False, "an expired lease must not be renewable"
    return record


def sweep_past_now(
    table: ResultTable, result_expires: float | None, lease_grace: float
) -> dict[str, int]:
    """``table.sweep(result_expires, lease_grace)`` once the results database's
    clock has stepped past its reading at this call, so that a cutoff of 0
    counts every row written before the call.

    The sweep deletes what is strictly older than its cutoff, and SQLite's
    clock steps by milliseconds: a fast machine writes a row and sweeps within
    one step, and the row is (rightly) not yet past a zero grace. Every
    zero-cutoff sweep in the tests calls this, also one that expects nothing
    gone: that proves more once the clock has moved
    (``tests/unit/test_suite_zero_cutoff_sweeps.py`` holds the suite to it).
    """
    read = table.db.now()
    wait_for(lambda: table.db.now() > read, 10, "the database clock to step past the writes")
    return table.sweep(result_expires, lease_grace)


def result_rows(url: str, key: str) -> list[tuple[int, int, str | None]]:
    """``(id, fencing_token, owner_id)`` of every result row for ``key``, in insert order."""
    db = database(url)
    with db.single() as conn:
        rows = conn.execute(
            text(
                "SELECT id, fencing_token, owner_id FROM celery_lease_results "
                "WHERE lease_key = :key ORDER BY id"
            ),
            {"key": key},
        ).all()
    return [(int(r[0]), int(r[1]), r[2]) for r in rows]


def backend_of(app: Celery) -> LeaseBackend:
    backend = app.backend
    assert isinstance(backend, LeaseBackend)
    return backend
