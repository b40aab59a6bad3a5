"""``python -m benchmarks.sqlite_cache default|small N``: SQLite's page cache and RSS.

Section 7's SQLite soak grows in steps; this checks whether they are SQLite's
page cache. One process, the SQLite store and results on one file, N claim +
commit pairs on distinct keys, RSS at checkpoints: with SQLite's default
``cache_size`` (2 MiB per connection), and with ``small``, ``PRAGMA
cache_size=-64`` (64 KiB) on every connection. If the steps are the cache,
the small run stays flat.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

from sqlalchemy import event

import celery_lease.sql.driver as driver
from celery_lease import LeaseStore
from celery_lease.results import ResultTable

CHECKPOINTS = {1_000, 10_000, 50_000, 100_000, 200_000, 400_000}


def _small_cache() -> None:
    """Every SQLite connection made from here on gets a 64 KiB page cache."""
    original = driver._sqlite_listeners

    def listeners(engine: Any) -> None:
        original(engine)

        @event.listens_for(engine, "connect")
        def _cache(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA cache_size=-64")
            cursor.close()

    driver._sqlite_listeners = listeners


def _rss_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


def main(mode: str, n: int) -> None:
    if mode == "small":
        _small_cache()
    url = f"sqlite:///{tempfile.mkdtemp()}/lease.sqlite3"
    store = LeaseStore.from_url(url)
    table = ResultTable(url, store)
    for i in range(1, n + 1):
        lease = store.claim(f"k{i}", ttl=30)
        assert lease is not None
        table.commit(lease, {"i": i}, task_id=f"t{i}")
        if i in CHECKPOINTS:
            print(mode, i, _rss_kb(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
