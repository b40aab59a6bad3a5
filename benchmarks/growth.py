"""6. Growth: claim, prepare and commit latency with many live leases and accepted results."""

from __future__ import annotations

import itertools
import re
import sqlite3
import time
from typing import Any

from benchmarks.env import Env, log
from benchmarks.report import Section, Table, target_line
from benchmarks.stats import fmt_ratio, fmt_us, interleave, median, percentile

NAME = "growth"
TITLE = "6. Growth: latency with many live leases and accepted results"
TTL = 30.0
LIVE_TTL = 7200  # the loaded leases stay live for the whole run
FLAT = 1.25  # "flat": the largest level within this factor of the smallest, same run

PG_LOAD = [
    """
INSERT INTO celery_lease_leases (lease_key, owner_id, fencing_token, ttl, expires_at,
    acquired_at, renewed_at, task_id, task_name, root_id, tenant)
SELECT 'growth-' || i, 'bench-owner:' || (i % 97), 1, {ttl}, t.now + {ttl}, t.now, t.now,
    md5(i::text), 'bench.noop', NULL, NULL
FROM generate_series(1, {n}) AS i, (SELECT extract(epoch FROM clock_timestamp()) AS now) AS t
""",
    """
INSERT INTO celery_lease_fences (resource, fencing_token, updated_at)
SELECT 'growth-' || i, 1, extract(epoch FROM clock_timestamp()) FROM generate_series(1, {n}) AS i
""",
    """
INSERT INTO celery_lease_results (lease_key, fencing_token, task_id, task_name, owner_id,
    tenant, root_id, result, accepted_at)
SELECT 'growth-' || i, 1, md5(i::text), 'bench.noop', 'bench-owner:' || (i % 97), NULL, NULL,
    '{{"ok": true}}'::jsonb, t.now
FROM generate_series(1, {n}) AS i, (SELECT extract(epoch FROM clock_timestamp()) AS now) AS t
""",
]
SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
SQLITE_SERIES = "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {n}) "
SQLITE_LOAD = [
    SQLITE_SERIES
    + f"""
INSERT INTO celery_lease_leases (lease_key, owner_id, fencing_token, ttl, expires_at,
    acquired_at, renewed_at, task_id, task_name, root_id, tenant)
SELECT 'growth-' || i, 'bench-owner:' || (i % 97), 1, {{ttl}}, {SQLITE_NOW} + {{ttl}},
    {SQLITE_NOW}, {SQLITE_NOW}, hex(randomblob(16)), 'bench.noop', NULL, NULL FROM s
""",
    SQLITE_SERIES
    + f"""
INSERT INTO celery_lease_fences (resource, fencing_token, updated_at)
SELECT 'growth-' || i, 1, {SQLITE_NOW} FROM s
""",
    SQLITE_SERIES
    + f"""
INSERT INTO celery_lease_results (lease_key, fencing_token, task_id, task_name, owner_id,
    tenant, root_id, result, accepted_at)
SELECT 'growth-' || i, 1, hex(randomblob(16)), 'bench.noop', 'bench-owner:' || (i % 97),
    NULL, NULL, '{{{{"ok": true}}}}', {SQLITE_NOW} FROM s
""",
]

CONFIGS = {
    "redis-pg": "Redis store + PostgreSQL results",
    "pg-pg": "PostgreSQL store + PostgreSQL results",
    "sqlite": "SQLite store + SQLite results",
}


class Level:
    """The stores of one size: n live leases (and n accepted results, n fence rows)."""

    def __init__(self, env: Env, n: int) -> None:
        self.n = n
        self.env = env
        self.redis_db = env.redis_db()
        self.pg_url = env.pg_database(f"growth_{n}") if env.has_pg else None
        self.sqlite_url = env.sqlite_url(f"growth-{n}")
        self.load_seconds: dict[str, float] = {}

    def load(self) -> None:
        import celery_lease

        if self.pg_url:
            t0 = time.monotonic()
            import psycopg

            with psycopg.connect(self.env.pg_dsn(self.pg_url.rsplit("/", 1)[1]),
                                 autocommit=True) as conn:  # fmt: skip
                for sql in PG_LOAD:
                    conn.execute(sql.format(n=self.n, ttl=LIVE_TTL))  # type: ignore[arg-type]
                conn.execute("VACUUM ANALYZE")
            self.load_seconds["PostgreSQL"] = time.monotonic() - t0
        t0 = time.monotonic()
        celery_lease.migrate(self.sqlite_url)
        conn = sqlite3.connect(self.sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("BEGIN")
        for sql in SQLITE_LOAD:
            conn.execute(sql.format(n=self.n, ttl=LIVE_TTL))
        conn.execute("COMMIT")
        conn.execute("ANALYZE")
        conn.close()
        self.load_seconds["SQLite"] = time.monotonic() - t0
        t0 = time.monotonic()
        self._load_redis()
        self.load_seconds["Redis"] = time.monotonic() - t0

    def _load_redis(self) -> None:
        """n live leases through the store's own claim script, pipelined."""
        from celery_lease import LeaseStore
        from celery_lease.stores.base import META_FIELDS

        store: Any = LeaseStore.from_url(self.env.store_url(self.redis_db))
        script = store._claim  # the product's CLAIM script (a redis-py Script)
        batch = 5000
        for start in range(0, self.n, batch):
            pipe = store.client.pipeline(transaction=False)
            for i in range(start, min(self.n, start + batch)):
                key = f"growth-{i + 1}"
                script(
                    keys=[store.lease_name(key), store.fence_name(key)],
                    args=[f"bench-owner:{i % 97}", LIVE_TTL * 1000,
                          *(["x"] * len(META_FIELDS))],
                    client=pipe,
                )  # fmt: skip
            replies = pipe.execute()
            if not all(int(r[0]) == 1 for r in replies):
                raise AssertionError("loading Redis: a claim was refused")
        store.close()

    def urls(self, config: str) -> tuple[str, str]:
        if config == "redis-pg":
            assert self.pg_url
            return self.env.store_url(self.redis_db), self.pg_url
        if config == "pg-pg":
            assert self.pg_url
            return self.pg_url, self.pg_url
        return self.sqlite_url, self.sqlite_url

    def close(self) -> None:
        import redis

        if self.pg_url:
            self.env.pg_drop(self.pg_url)
        redis.Redis.from_url(self.env.store_url(self.redis_db)).flushdb()


class Path3:
    """claim -> prepare -> commit (with release), the per-task store path, timed per step."""

    _ids = itertools.count()

    def __init__(self, store_url: str, result_url: str) -> None:
        from celery_lease import LeaseStore
        from celery_lease.results import ResultTable

        self.store = LeaseStore.from_url(store_url)
        self.results = ResultTable(result_url, self.store)

    def batch(self, k: int) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"claim": [], "prepare": [], "commit": [], "total": []}
        perf = time.perf_counter
        for _ in range(k):
            i = next(self._ids)
            key = f"fresh-{i}"
            task_id = f"bench-task-{i}"
            t0 = perf()
            lease = self.store.claim(key, ttl=TTL, owner_id="bench-owner:growth",
                                     meta={"task_id": task_id})  # fmt: skip
            t1 = perf()
            if lease is None:
                raise AssertionError("a fresh key was refused")
            self.results.prepare(lease, task_id, once=False)
            t2 = perf()
            self.results.commit(lease, {"ok": True}, task_id=task_id, task_name="bench.noop")
            t3 = perf()
            out["claim"].append(t1 - t0)
            out["prepare"].append(t2 - t1)
            out["commit"].append(t3 - t2)
            out["total"].append(t3 - t0)
        return out


def run(env: Env) -> Section:
    sizes = [1000, 10000] if env.quick else [1000, 100000, 1000000]
    k = 40 if env.quick else 300
    rounds = 2 if env.quick else 5
    section = Section(
        NAME,
        TITLE,
        intro=(
            "Each size gets its own stores, loaded with that many live leases (TTL 2 h), "
            "fence rows and accepted results (PostgreSQL and SQLite: bulk `INSERT … SELECT`, "
            "then `ANALYZE`; Redis: the store's own claim script, pipelined). Then one "
            "process runs the per-task store path on fresh keys: `store.claim` → "
            "`ResultTable.prepare` → `ResultTable.commit` (which releases). Sizes interleave "
            f"within each configuration, {rounds} rounds of {k} operations; latencies are "
            "medians/percentiles over all operations; the ratios are medians over rounds "
            f"of (p50 at this size ÷ p50 at {sizes[0]:,} in the same round), so a round "
            "disturbed by the shared machine moves the all-operations p50 more than the "
            "ratio. "
            + ("The quick pass stops at 10,000; the full run goes to 1,000,000."
               if env.quick else "")
        ),
    )  # fmt: skip
    levels = [Level(env, n) for n in sizes]
    try:
        for lv in levels:
            log(f"{NAME}: loading {lv.n:,}")
            lv.load()
        loads = Table(["size", *sorted(levels[0].load_seconds)])
        for lv in levels:
            loads.add(
                f"{lv.n:,}", *[f"{lv.load_seconds[s]:.1f} s" for s in sorted(lv.load_seconds)]
            )
        configs = [c for c in CONFIGS if env.has_pg or c == "sqlite"]
        table = Table(
            ["configuration", "live leases + results", "claim p50", "claim p99", "prepare p50",
             "commit p50", "commit p99", "total p50", f"claim p50 ratio to {sizes[0]:,}",
             f"total p50 ratio to {sizes[0]:,}", "target"],
            align="lrrrrrrrrrl",
        )  # fmt: skip
        verdicts: list[str] = []
        for config in configs:
            log(f"{NAME}: {CONFIGS[config]}")
            paths = {lv.n: Path3(*lv.urls(config)) for lv in levels}
            for p in paths.values():
                p.batch(10)  # warm up
            runs: dict[int, list[dict[str, list[float]]]] = {n: [] for n in sizes}

            def measure(name: str, _r: int, paths: dict[int, Path3] = paths,
                        runs: dict[int, list[dict[str, list[float]]]] = runs) -> float:  # fmt: skip
                res = paths[int(name)].batch(k)
                runs[int(name)].append(res)
                return median(res["total"])

            interleave([str(n) for n in sizes], rounds, measure)

            def paired(
                n: int, step: str, runs: dict[int, list[dict[str, list[float]]]] = runs
            ) -> float:
                """Median over rounds of (p50 at n / p50 at the smallest size), same round."""
                return median([
                    median(a[step]) / median(b[step])
                    for a, b in zip(runs[n], runs[sizes[0]])
                ])  # fmt: skip

            for n in sizes:
                allops = {m: [x for r in runs[n] for x in r[m]] for m in runs[n][0]}
                claim_ratio, total_ratio = paired(n, "claim"), paired(n, "total")
                tgt = ""
                if n == sizes[-1]:
                    met = claim_ratio <= FLAT
                    tgt = f"claim flat (≤ {FLAT}\u00d7): {'met' if met else '**missed**'}"
                    verdicts.append(
                        target_line(
                            met,
                            f"{CONFIGS[config]}: claim latency flat from {sizes[0]:,} to "
                            f"{n:,} ({fmt_ratio(claim_ratio)}; the whole per-task store path "
                            f"{fmt_ratio(total_ratio)})",
                        )
                    )
                    section.summary.append(
                        f"Growth, {CONFIGS[config]}: at {n:,} live leases and results, claim "
                        f"latency {fmt_ratio(claim_ratio)} and the per-task store path "
                        f"{fmt_ratio(total_ratio)} of their latency at {sizes[0]:,}"
                    )
                first = n == sizes[0]
                table.add(
                    CONFIGS[config], f"{n:,}",
                    fmt_us(median(allops["claim"])), fmt_us(percentile(allops["claim"], 99)),
                    fmt_us(median(allops["prepare"])),
                    fmt_us(median(allops["commit"])), fmt_us(percentile(allops["commit"], 99)),
                    fmt_us(median(allops["total"])),
                    "1.00\u00d7" if first else fmt_ratio(claim_ratio),
                    "1.00\u00d7" if first else fmt_ratio(total_ratio), tgt,
                )  # fmt: skip
            for p in paths.values():
                p.store.close()
        section.add(table.markdown())
        section.add("\n".join(f"- {v}" for v in verdicts))
        section.add("Loading time (not part of the measurement):\n\n" + loads.markdown())
        if env.has_pg:
            section.add(explain(levels[-1]))
    finally:
        for lv in levels:
            lv.close()
    return section


#: statements of the per-task path, by their name in celery_lease/sql (those that exist)
EXPLAINED = [
    ("PG_CLAIM_ONE", "claim, PostgreSQL store (one statement)", "fresh"),
    ("release_in", "release, PostgreSQL store", "live"),
    ("register_fence", "prepare: register the token (leases elsewhere)", "fresh"),
    ("PREPARE_LOOKUP", "prepare: redelivery / duplicate look-ups", "live"),
    (
        "PG_COMMIT_COLOCATED[release=True, once=False, one_key=True]",
        "commit (same database, one statement): own + release the lease row, insert the result",
        "live",
    ),
    ("lock_fence", "commit (leases elsewhere): lock the fence row", "live"),
    ("RESULT_DUPLICATE", "commit, once mode: an accepted result for the key?", "live"),
    ("result_insert[once=False]", "commit: insert the accepted result", "fresh"),
    ("RESULT_ACCEPTED", "`accepted()`: newest result of a key", "live"),
]


def explain(level: Level) -> str:
    """EXPLAIN ANALYZE of the per-task statements at the largest size (rolled back)."""
    from sqlalchemy import create_engine, text

    from celery_lease.sql.dialects import rendered

    assert level.pg_url
    engine = create_engine(level.pg_url)
    statements = dict(rendered("postgresql"))
    live = "growth-500"
    parts = [
        f"<details><summary>EXPLAIN ANALYZE of the per-task statements on PostgreSQL with "
        f"{level.n:,} live leases, fence rows and accepted results (run in a transaction, "
        "rolled back)</summary>\n"
    ]
    summary = Table(["statement (celery_lease/sql)", "step", "indexes used", "sequential scans"],
                    align="llll")  # fmt: skip
    any_seq = False
    for name, what, which in EXPLAINED:
        statement = statements.get(name)
        if statement is None:
            continue
        key = live if which == "live" else "fresh-explain-key"
        params: dict[str, Any] = {
            "key": key, "k0": key, "ttl": TTL, "token": 1,
            "owner_id": "bench-owner:15" if which == "live" else "bench-owner:1",  # growth-500's
            "task_id": "0123456789abcdef", "task_name": "bench.noop", "root_id": None,
            "tenant": None, "once": True, "register": True, "now": time.time(),
            "result": '{"ok": true}', "keys": [key], "n": 1,
        }  # fmt: skip
        needed = set(re.findall(r"(?<!:):(\w+)", statement))
        try:
            with engine.connect() as conn:
                trans = conn.begin()
                rows = conn.execute(
                    text("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) " + statement),
                    {p: v for p, v in params.items() if p in needed},
                ).all()
                trans.rollback()
            plan = "\n".join(r[0] for r in rows)
        except Exception as e:  # noqa: BLE001 - shown instead of the plan
            plan = f"EXPLAIN failed: {type(e).__name__}: {e}"
        indexes = sorted(set(re.findall(r"(?:using|Indexes:) (\w+)", plan)))
        seq = sorted(set(re.findall(r"Seq Scan on (\w+)", plan)))
        used = ", ".join(indexes) or ("— (an insert; it maintains the indexes)"
                                      if name.endswith("INSERT") else "—")  # fmt: skip
        summary.add(f"`{name}`", what, used, ", ".join(seq) or "none")
        any_seq = any_seq or bool(seq)
        parts.append(f"`{name}` ({what}):\n\n```\n{plan}\n```\n")
    engine.dispose()
    parts.append("</details>")
    return (
        f"Plans at {level.n:,} of the statements the per-task path can use (section 3 shows "
        "which ones a task runs); "
        + ("every lookup is an index scan" if not any_seq else "**some use sequential scans**")
        + ":\n\n"
        + summary.markdown()
        + "\n\n"
        + "\n".join(parts)
    )
