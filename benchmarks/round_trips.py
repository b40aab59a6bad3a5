"""3. Round trips per task, counted on the servers while a real worker drains tasks."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.counters import (
    RedisMonitor,
    pg_reset_statements,
    pg_statements,
    redis_commandstats,
    short_sql,
    sql_name,
)
from benchmarks.env import Env, log
from benchmarks.report import Section, Table, target_line
from benchmarks.workers import KINDS, Kind, Targets, WorkerRun

NAME = "round_trips"
TITLE = "3. Round trips per task, counted"


def _count(env: Env, targets: Targets, k: Kind, warm: int, n: int) -> dict[str, object]:
    sqlite = k.store == "sqlite"
    uses_sql = k.kind == "leased" and ("pg" in (k.store, k.results) or sqlite)
    extra = {"BENCH_SQL_TRACE": "1", "BENCH_SQL_WARM": str(warm)} if uses_sql else {}
    pg_dbs = []
    if k.kind == "leased" and "pg" in (k.store, k.results):
        pg_dbs = [targets.pg_redis_results if k.store == "redis" else targets.pg_both]
    out: dict[str, object] = {}
    store_url = env.store_url(targets.db)
    with RedisMonitor(store_url, targets.db) as mon:
        # publish side: enqueue to a queue no worker consumes
        idle = WorkerRun(targets, k, "solo", extra_env=extra)
        try:
            idle.enqueue(1)  # the publisher's connections
            p0 = mon.snapshot()
            idle.enqueue(n)
            p1 = mon.snapshot()
        finally:
            idle.cleanup()
        out["publish_redis"] = (p1[0] - p0[0]) / n
        # worker side: warm up, then count n tasks
        run = WorkerRun(targets, k, "solo", extra_env=extra)
        try:
            run.start()
            run.enqueue(warm)
            err = run.wait(warm, timeout=90)
            if err:
                raise RuntimeError(f"{k.key}: warm-up failed: {err}")
            cs0 = redis_commandstats(store_url)
            s0 = mon.snapshot()
            if pg_dbs and env.pg_stat_statements:
                pg_reset_statements(env)
            run.enqueue(n)
            err = run.wait(warm + n, timeout=max(90.0, n / 5))
            if err:
                raise RuntimeError(f"{k.key}: run failed: {err}")
            s1 = mon.snapshot()
            cs1 = redis_commandstats(store_url)
            pg = {}
            for db in pg_dbs:
                if env.pg_stat_statements:
                    for q, c in pg_statements(env, db).items():
                        pg[q] = pg.get(q, 0) + c
            times = run.times()
            warm_hist = _read_json(run.times_dir, "sqlhist-warm")
            last_hist = _read_json(run.times_dir, "sqlhist-last")
            warm_pg = _read_json(run.times_dir, "pgtraffic-warm")
            last_pg = _read_json(run.times_dir, "pgtraffic-last")
        finally:
            run.cleanup()
    # the publish side of these n tasks was inside the window too (counted above)
    top = (s1[0] - s0[0]) / n - out["publish_redis"]  # type: ignore[operator]
    out["worker_redis"] = top
    out["worker_redis_inner"] = (s1[1] - s0[1]) / n
    cmds = {c: v - s0[2].get(c, 0) for c, v in s1[2].items()}
    out["redis_by_command"] = {c: v / n for c, v in cmds.items() if v}
    # the harness's own: INFO, and the HELLO / CLIENT SETINFO of its connections
    cs = {
        c: v - cs0.get(c, 0)
        for c, v in cs1.items()
        if c not in ("info", "hello", "select") and not c.startswith("client")
    }
    cs["get"] = cs.get("get", 0) - 2  # the two MONITOR sync markers inside the window
    out["commandstats"] = sum(cs.values()) / n
    out["pg_statements"] = sum(pg.values()) / n if pg_dbs and env.pg_stat_statements else None
    out["pg_by_statement"] = {q: c / n for q, c in pg.items()}
    done = len(times) - warm
    out["pg"] = (
        (last_pg.get("round_trips", 0) - warm_pg.get("round_trips", 0)) / done
        if pg_dbs and done > 0
        else None
    )
    if sqlite and len(times) > warm:
        base = times[warm - 1][1]
        out["sqlite"] = (times[-1][1] - base) / (len(times) - warm)
        out["sqlite_by_statement"] = {
            q: (c - warm_hist.get(q, 0)) / (len(times) - warm) for q, c in last_hist.items()
        }
        by_stmt: dict[str, float] = out["sqlite_by_statement"]  # type: ignore[assignment]
        out["sqlite_transactions"] = sum(v for q, v in by_stmt.items() if q.startswith("BEGIN"))
    return out


def _read_json(directory: Path, prefix: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in directory.glob(f"{prefix}-*.json"):
        for q, c in json.loads(f.read_text()).items():
            out[q] = out.get(q, 0) + int(c)
    return out


def _attribution(c: dict[str, object]) -> str:
    """``Redis CLAIM 1 + ... + PostgreSQL BEGIN 1 + ...`` for one counted contender."""
    parts: list[str] = []
    by_cmd: dict[str, float] = c["redis_by_command"]  # type: ignore[assignment]
    for cmd, v in sorted(by_cmd.items()):
        if v >= 0.05:
            parts.append(f"Redis {cmd} {v:g}")
    for server, field in (("PostgreSQL", "pg_by_statement"), ("SQLite", "sqlite_by_statement")):
        by_stmt: dict[str, float] = c.get(field) or {}  # type: ignore[assignment]
        for q, v in sorted(by_stmt.items(), key=lambda kv: -kv[1]):
            if v >= 0.05:
                name = sql_name(q) or q.split()[0]
                parts.append(f"{server} {name} {v:g}")
    return " + ".join(parts) if parts else "nothing counted"


def run(env: Env) -> Section:
    warm, n = (20, 100) if env.quick else (50, 500)
    targets = Targets.make(env, "rt")
    section = Section(
        NAME,
        TITLE,
        intro=(
            f"A solo worker runs {warm} warm-up tasks (connections, script cache, SQLAlchemy "
            f"dialect set-up), then {n} no-op tasks with distinct keys; the counters are read "
            "on the servers around those. Redis: `MONITOR` on the lease-store Redis "
            "(separate from the broker) counts commands from clients, which are the round "
            "trips; commands a Lua script runs inside Redis are counted apart, and `INFO "
            "commandstats` (total calls, which includes the commands inside scripts) is "
            "shown as well. PostgreSQL: round trips counted where they are sent, in "
            "celery-lease's driver layer (`celery_lease.sql.PG_TRAFFIC`), because pipelining "
            "sends several statements per round trip; the statements the server ran "
            "(`pg_stat_statements` calls in the result/lease database, `BEGIN` and `COMMIT` "
            "included) are shown beside them. SQLite has no server: the store round trips "
            "column counts its transactions (each takes the write lock and syncs at "
            "`COMMIT`), and the statements SQLite ran (its trace callback, `BEGIN`/`COMMIT` "
            "included) are shown beside them. *Publish side* is counted while enqueueing to a "
            "queue no worker reads. The tasks are much shorter than the renewal interval "
            "(TTL 30 s → 10 s), so these runs contain no renewals; section 4 counts the "
            "round trips of a renewal cycle."
        ),
    )
    table = Table(
        ["contender", "publish side: Redis", "worker: Redis round trips",
         "worker: PostgreSQL round trips", "worker: SQLite",
         "store round trips per task", "Redis commandstats calls (incl. inside scripts)",
         "target"],
        align="lrrrrrrl",
    )  # fmt: skip
    detail: list[str] = []
    verdicts: list[str] = []
    breakdown: list[str] = []
    try:
        for k in KINDS:
            why = targets.available(k)
            if why:
                table.add(k.label, "skipped", "", "", "", "", "", f"could not run: {why}")
                continue
            log(f"{NAME}: {k.key}")
            try:
                c = _count(env, targets, k, warm, n)
            except Exception as e:  # noqa: BLE001 - one contender's failure is reported
                table.add(k.label, "failed", "", "", "", "", "", str(e)[:200])
                continue
            total = float(c["publish_redis"]) + float(c["worker_redis"])  # type: ignore[arg-type]
            pgc = c.get("pg")
            if pgc is not None:
                total += float(pgc)  # type: ignore[arg-type]
            sq = c.get("sqlite")
            if sq is not None:
                total += float(c["sqlite_transactions"])  # type: ignore[arg-type]
            tgt = ""
            if k.ours:
                met = total <= 2.0 + 1e-9
                tgt = f"2 + renewals: {'met' if met else '**missed**'}"
                verdicts.append(
                    target_line(met, f"{k.label}: 2 store round trips per task ({total:g})")
                )
                section.summary.append(f"Round trips per task, {k.label}: {total:g} (target 2)")
            table.add(
                k.label,
                f"{c['publish_redis']:g}",
                f"{c['worker_redis']:g}" + (f" (+{c['worker_redis_inner']:g} inside scripts)"
                                            if c["worker_redis_inner"] else ""),
                "n/a" if pgc is None else f"{pgc:g}" + (
                    f" ({c['pg_statements']:g} statements)" if c.get("pg_statements") else ""),
                "" if sq is None else (f"{c['sqlite_transactions']:g} transactions "
                                       f"({sq:g} statements, no network)"),
                f"{total:g}",
                f"{c['commandstats']:g}",
                tgt,
            )  # fmt: skip
            if k.ours:
                breakdown.append(f"{k.label}: {total:g} = " + _attribution(c))
            rows = []
            by_cmd: dict[str, float] = c["redis_by_command"]  # type: ignore[assignment]
            for cmd, v in sorted(by_cmd.items()):
                rows.append(f"| Redis | `{cmd}` | {v:g} |")
            for server, field in (
                ("PostgreSQL", "pg_by_statement"),
                ("SQLite", "sqlite_by_statement"),
            ):
                by_stmt: dict[str, float] = c.get(field) or {}  # type: ignore[assignment]
                for q, v in sorted(by_stmt.items(), key=lambda kv: -kv[1]):
                    if v >= 0.01:
                        named = sql_name(q)
                        label = f"`{named}`: " if named else ""
                        rows.append(f"| {server} | {label}`{short_sql(q, 80)}` | {v:g} |")
            if rows:
                detail.append(
                    f"**{k.label}**, worker and publish side (per task; statements named by "
                    "their name in `celery_lease/sql/`):\n\n"
                    "| server | command / statement | per task |\n|---|---|---:|\n"
                    + "\n".join(rows)
                )
    finally:
        targets.close()
    section.add(table.markdown())
    section.add("\n".join(f"- {v}" for v in verdicts))
    if breakdown:
        section.add(
            "Where the round trips go (per task; statements named by their name in "
            "`celery_lease/sql/`, Redis scripts by their name in "
            "`celery_lease/stores/redis.py`):\n\n" + "\n".join(f"- {b}" for b in breakdown)
        )
    if detail:
        section.add("<details><summary>What the round trips are</summary>\n\n"
                    + "\n\n".join(detail) + "\n\n</details>")  # fmt: skip
    return section
