"""Where a fenced task's database time goes, outside any worker: celery-lease's
claim and commit for one key in a loop, against the floors' statements, on the
same servers (part of the per-task section's explanation)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from benchmarks.counters import short_sql, sql_name
from benchmarks.env import Env, log
from benchmarks.report import Table
from benchmarks.stats import interleave, median

#: the floors' statements (benchmarks/benchapp.py's ``_Floor``)
FLOOR_SELECT = "SELECT result FROM bench_floor_results WHERE task_id = {m}"
FLOOR_INSERT = (
    "INSERT INTO bench_floor_results (task_id, result) VALUES ({m}, {m}) ON CONFLICT DO NOTHING"
)


def _lease_pair(url: str) -> Callable[[str], None]:
    """celery-lease's own calls for one key: claim (with its look-ups) and commit
    (with its release), as ``LeasedTask`` makes them."""
    from celery_lease.results import ResultTable
    from celery_lease.stores.sql import SQLLeaseStore

    table = ResultTable(url, SQLLeaseStore(url))

    def one(task_id: str) -> None:
        lease, _ = table.claim_prepared(
            f"stmt-{task_id}",
            ttl=30.0,
            owner_id=task_id,
            meta={"task_id": task_id, "task_name": "bench.noop", "root_id": task_id},
            task_id=task_id,
            once=False,
        )
        assert lease is not None
        table.commit(lease, None, task_id=task_id)

    return one


def _loop(contenders: dict[str, Callable[[str], None]], n: int, rounds: int) -> dict[str, float]:
    """Median µs per call of each contender, interleaved rounds of n calls."""
    counter = iter(range(10**9))
    for f in contenders.values():  # warm-up: connections, prepared statements, plans
        for _ in range(max(50, n // 10)):
            f(f"w{next(counter)}")

    def measure(key: str, _r: int) -> float:
        f = contenders[key]
        t0 = time.perf_counter()
        for _ in range(n):
            f(str(next(counter)))
        return n / (time.perf_counter() - t0)

    rates = interleave(list(contenders), rounds, measure)
    return {k: 1e6 / median(v) for k, v in rates.items()}


def _pg(env: Env, n: int, rounds: int) -> str:
    import psycopg

    from benchmarks import benchapp

    url = env.pg_database("stmtcost")
    with psycopg.connect(env.pg_dsn(url.rsplit("/", 1)[1]), autocommit=True) as conn:
        conn.execute(benchapp.FLOOR_TABLE_PG)
        cur = conn.cursor()

        def floor(task_id: str) -> None:
            cur.execute(FLOOR_SELECT.format(m="%s"), (task_id,))
            cur.fetchone()
            cur.execute(FLOOR_INSERT.format(m="%s"), (task_id, "null"))

        per_call = _loop({"celery-lease": _lease_pair(url), "floor": floor}, n, rounds)
    rows: list[Any] = []
    if env.pg_stat_statements:  # the extension lives in the admin database
        with env.pg_admin() as admin:
            rows = admin.execute(
                "SELECT s.query, sum(s.calls), sum(s.total_exec_time) / sum(s.calls) "
                "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
                "WHERE d.datname = %s AND s.toplevel GROUP BY s.query "
                "HAVING sum(s.calls) >= %s ORDER BY 3 DESC",
                (url.rsplit("/", 1)[1], n),
            ).fetchall()
    table = Table(["statement (top level)", "calls", "server execution µs per call"], align="lrr")
    for query, calls, mean_ms in rows:
        table.add(
            sql_name(str(query)) or f"`{short_sql(str(query))}`",
            f"{int(calls):,}",
            f"{float(mean_ms) * 1000:.1f}",
        )
    return (
        f"PostgreSQL, one connection, {rounds} interleaved rounds of {n:,}: celery-lease's "
        f"claim (with its look-ups) and commit (with its release) for one key "
        f"**{per_call['celery-lease']:.0f} µs** per task against the two-round-trip floor's "
        f"`SELECT` + `INSERT` **{per_call['floor']:.0f} µs** (client-observed; "
        f"{per_call['celery-lease'] - per_call['floor']:+.0f} µs). The server's execution time "
        "per statement (`pg_stat_statements`, this database, whole loop):\n\n"
        + (table.markdown() if rows else "_pg_stat_statements unavailable._")
    )


def _wal_frames(path: str) -> int:
    """Frames in a WAL file that is never checkpointed (header 32 bytes, frame 24 + page)."""
    with contextlib.suppress(OSError):
        return max(0, (os.path.getsize(path + "-wal") - 32) // (24 + 4096))
    return 0


def _sqlite(env: Env, n: int, rounds: int, plain_prefork: float) -> str:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from benchmarks import benchapp
    from celery_lease.sql import driver as q

    url = env.sqlite_url("stmtcost")
    ours_path = url.removeprefix("sqlite:///")
    floor_path = str(env.tmpdir / f"stmtcost-floor-{os.getpid()}.sqlite3")

    # WAL frames are counted from the WAL file's size: no checkpoint in these two files
    def _no_checkpoint(dbapi_connection: Any, _record: Any) -> None:
        if isinstance(dbapi_connection, sqlite3.Connection):
            dbapi_connection.execute("PRAGMA wal_autocheckpoint=0")

    event.listen(Engine, "connect", _no_checkpoint)
    try:
        import celery_lease

        celery_lease.migrate(url)
        ours = _lease_pair(url)
        conn = benchapp.floor_sqlite_connect(floor_path)
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute(benchapp.FLOOR_TABLE_SQLITE)
        insert = FLOOR_INSERT.format(m="?")

        def floor(task_id: str) -> None:
            conn.execute(insert, (f"claim-{task_id}", "null"))
            conn.execute(insert, (task_id, "null"))

        frames0 = {"ours": _wal_frames(ours_path), "floor": _wal_frames(floor_path)}
        per_call = _loop({"celery-lease": ours, "floor": floor}, n, rounds)
        calls = max(50, n // 10) + n * rounds
        frames = {
            "ours": (_wal_frames(ours_path) - frames0["ours"]) / calls,
            "floor": (_wal_frames(floor_path) - frames0["floor"]) / calls,
        }
        ours_us, floor_us = per_call["celery-lease"], per_call["floor"]
        conn.close()
    finally:
        event.remove(Engine, "connect", _no_checkpoint)
        with contextlib.suppress(KeyError):
            q._databases.pop(q.normalize_sql_url(url)).dispose()
    return (
        f"SQLite (celery-lease's settings: WAL, `synchronous` FULL), {rounds} interleaved rounds "
        f"of {n:,}: celery-lease's claim and commit for one key (two `BEGIN IMMEDIATE` "
        f"transactions, each ending in a synced commit, the write lock held throughout) "
        f"**{per_call['celery-lease']:.0f} µs** per task, writing **{frames['ours']:.1f} WAL "
        f"pages** per task (lease row, fence row, result row and the release, with their "
        f"indexes); the floor's two committed single-row `INSERT`s **{per_call['floor']:.0f} "
        f"µs**, **{frames['floor']:.1f} pages**. SQLite has one writer at a time: every "
        f"microsecond of these is write-lock time that a second pool process waits out, "
        f"asleep in SQLite's busy handler (which sleeps 1, 2, 5, 10 … ms between attempts)."
        + (
            f" At 0.8\u00d7 of plain's prefork drain rate in this run ({0.8 * plain_prefork:,.0f} "
            f"tasks/s), the write lock would be held up to "
            f"{0.8 * plain_prefork * ours_us / 1e6:.0%} "
            f"of every second by celery-lease's transactions, against "
            f"{0.8 * plain_prefork * floor_us / 1e6:.0%} by the floor's."
            if plain_prefork == plain_prefork
            else ""
        )
    )


def run(env: Env, n: int, rounds: int, plain_prefork: float = float("nan")) -> str:
    log("per_task: statement costs outside the worker")
    parts = ["**Where the database time goes, outside the worker.**"]
    if env.has_pg:
        parts.append(_pg(env, n, rounds))
    parts.append(_sqlite(env, n, rounds, plain_prefork))
    return "\n\n".join(parts)
