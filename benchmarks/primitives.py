"""1. Lease primitives: claim + release pairs per second on one connection, distinct keys."""

from __future__ import annotations

import itertools
import pstats
import sqlite3
import time
from collections.abc import Callable
from datetime import timedelta

from benchmarks.common import (
    Env,
    RedisMonitor,
    Section,
    Table,
    fmt_rate,
    fmt_ratio,
    fmt_us,
    log,
    median,
    paired_ratios,
    pg_reset_statements,
    pg_statements,
    profile_summary,
    profiled,
    target_line,
)

NAME = "primitives"
TITLE = "1. Lease primitives: claim + release pairs per second"

TTL = 30.0
OWNER = "bench-owner:1:0123456789abcdef"

#: (group, baseline, target ratio or None)
GROUPS = {
    "Redis": ("raw SET NX PX + DEL", 0.9),
    "PostgreSQL": ("raw INSERT … ON CONFLICT DO UPDATE + UPDATE (psycopg, autocommit)", 0.8),
    "SQLite": ("raw INSERT … ON CONFLICT DO UPDATE + UPDATE (sqlite3, autocommit)", None),
}

PG_RAW_TABLE = """
CREATE TABLE IF NOT EXISTS bench_raw_leases (
    lease_key text PRIMARY KEY, owner_id text, fencing_token bigint NOT NULL,
    expires_at double precision NOT NULL)
"""
PG_RAW_CLAIM = """
INSERT INTO bench_raw_leases AS l (lease_key, owner_id, fencing_token, expires_at)
VALUES (%s, %s, 1, extract(epoch FROM clock_timestamp()) + %s)
ON CONFLICT (lease_key) DO UPDATE SET owner_id = excluded.owner_id,
    fencing_token = l.fencing_token + 1, expires_at = excluded.expires_at
WHERE l.expires_at <= extract(epoch FROM clock_timestamp())
RETURNING fencing_token
"""
PG_RAW_RELEASE = """
UPDATE bench_raw_leases SET expires_at = extract(epoch FROM clock_timestamp())
WHERE lease_key = %s AND owner_id = %s AND fencing_token = %s
"""
SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
SQLITE_RAW_TABLE = """
CREATE TABLE IF NOT EXISTS bench_raw_leases (
    lease_key text PRIMARY KEY, owner_id text, fencing_token integer NOT NULL,
    expires_at real NOT NULL)
"""
SQLITE_RAW_CLAIM = f"""
INSERT INTO bench_raw_leases AS l (lease_key, owner_id, fencing_token, expires_at)
VALUES (?, ?, 1, {SQLITE_NOW} + ?)
ON CONFLICT (lease_key) DO UPDATE SET owner_id = excluded.owner_id,
    fencing_token = l.fencing_token + 1, expires_at = excluded.expires_at
WHERE l.expires_at <= {SQLITE_NOW}
RETURNING fencing_token
"""
SQLITE_RAW_RELEASE = f"""
UPDATE bench_raw_leases SET expires_at = {SQLITE_NOW}
WHERE lease_key = ? AND owner_id = ? AND fencing_token = ?
"""

Pair = Callable[[str], None]


class Contender:
    def __init__(
        self, group: str, name: str, pair: Pair, *, baseline: bool = False, ours: bool = False
    ) -> None:
        self.group = group
        self.name = name
        self.pair = pair
        self.baseline = baseline
        self.ours = ours
        self.skipped: str | None = None
        #: profile ladder: the variant this one is compared with, and what it adds
        self.relative_to: str | None = None
        self.step = ""


def _redis_contenders(env: Env) -> tuple[list[Contender], list[tuple[str, str]], int]:
    import redis

    from celery_lease import LeaseStore

    db = env.redis_db()
    url = env.store_url(db)
    r = redis.Redis.from_url(url)
    out: list[Contender] = []
    skipped: list[tuple[str, str]] = []

    def raw(key: str) -> None:
        if not r.set(key, OWNER, nx=True, px=int(TTL * 1000)):
            raise AssertionError("raw SET NX refused a fresh key")
        r.delete(key)

    out.append(Contender("Redis", "raw SET NX PX + DEL (redis-py)", raw, baseline=True))

    store = LeaseStore.from_url(url)

    def ours(key: str) -> None:
        lease = store.claim(key, ttl=TTL, owner_id=OWNER)
        if lease is None:
            raise AssertionError("celery-lease refused a fresh key")
        store.release(lease)

    out.append(Contender("Redis", "celery-lease `RedisLeaseStore`", ours, ours=True))

    def pylock(key: str) -> None:
        lock = r.lock(key, timeout=TTL)
        if not lock.acquire(blocking=False):
            raise AssertionError("redis-py Lock refused a fresh key")
        lock.release()

    out.append(Contender("Redis", "redis-py `Lock`", pylock))

    try:
        import redis_lock

        def prl(key: str) -> None:
            lock = redis_lock.Lock(r, key, expire=int(TTL))
            if not lock.acquire(blocking=False):
                raise AssertionError("python-redis-lock refused a fresh key")
            lock.release()

        prl("bench-probe-prl")
        out.append(Contender("Redis", "python-redis-lock `Lock`", prl))
    except Exception as e:  # noqa: BLE001 - reported as a skipped contender
        skipped.append(("python-redis-lock `Lock`", f"{type(e).__name__}: {e}"))

    try:
        from fencekit import DistributedLock

        fk = DistributedLock(redis.Redis.from_url(url, decode_responses=True))
        fttl = timedelta(seconds=TTL)

        def fence(key: str) -> None:
            handle = fk.acquire(key, ttl=fttl, owner_id=OWNER)
            fk.release(handle)

        fence("bench-probe-fencekit")
        out.append(Contender("Redis", "fencekit `DistributedLock`", fence))
    except Exception as e:  # noqa: BLE001 - reported as a skipped contender
        skipped.append(("fencekit `DistributedLock`", f"{type(e).__name__}: {e}"))
    return out, skipped, db


def _pg_contenders(env: Env, url: str) -> list[Contender]:
    import psycopg

    from celery_lease import LeaseStore

    conn = psycopg.connect(env.pg_dsn(url.rsplit("/", 1)[1]), autocommit=True)
    conn.execute(PG_RAW_TABLE)

    def raw(key: str) -> None:
        row = conn.execute(PG_RAW_CLAIM, (key, OWNER, TTL)).fetchone()
        if row is None:
            raise AssertionError("raw INSERT ON CONFLICT refused a fresh key")
        conn.execute(PG_RAW_RELEASE, (key, OWNER, row[0]))

    store = LeaseStore.from_url(url)

    def ours(key: str) -> None:
        lease = store.claim(key, ttl=TTL, owner_id=OWNER)
        if lease is None:
            raise AssertionError("celery-lease refused a fresh key")
        store.release(lease)

    return [
        Contender("PostgreSQL", "raw INSERT ON CONFLICT + UPDATE (psycopg)", raw, baseline=True),
        Contender("PostgreSQL", "celery-lease `SQLLeaseStore` (PostgreSQL)", ours, ours=True),
    ]


def _sqlite_contenders(env: Env) -> list[Contender]:
    from celery_lease import LeaseStore

    raw_path = env.sqlite_url("raw").removeprefix("sqlite:///")
    conn = sqlite3.connect(raw_path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA busy_timeout=30000")
    conn.execute(SQLITE_RAW_TABLE)

    def raw(key: str) -> None:
        row = conn.execute(SQLITE_RAW_CLAIM, (key, OWNER, TTL)).fetchone()
        if row is None:
            raise AssertionError("raw INSERT ON CONFLICT refused a fresh key")
        conn.execute(SQLITE_RAW_RELEASE, (key, OWNER, row[0]))

    store = LeaseStore.from_url(env.sqlite_url("store"))

    def ours(key: str) -> None:
        lease = store.claim(key, ttl=TTL, owner_id=OWNER)
        if lease is None:
            raise AssertionError("celery-lease refused a fresh key")
        store.release(lease)

    return [
        Contender("SQLite", "raw INSERT ON CONFLICT + UPDATE (sqlite3)", raw, baseline=True),
        Contender("SQLite", "celery-lease `SQLLeaseStore` (SQLite)", ours, ours=True),
    ]


_keys = itertools.count()


def _batch(c: Contender, n: int) -> float:
    """Run n claim+release pairs on fresh keys; pairs per second."""
    prefix = f"bench-prim-{next(_keys)}"
    pair = c.pair
    t0 = time.perf_counter()
    for i in range(n):
        pair(f"{prefix}-{i}")
    return n / (time.perf_counter() - t0)


def run(env: Env) -> Section:
    quick = env.quick
    rounds = 3 if quick else 9
    batch = {"Redis": 400, "PostgreSQL": 250, "SQLite": 150}
    if not quick:
        batch = {"Redis": 3000, "PostgreSQL": 1500, "SQLite": 600}
    section = Section(
        NAME,
        TITLE,
        intro=(
            "One process, one connection, a fresh key for every pair, TTL 30 s. Each sample "
            f"is a batch of pairs (Redis {batch['Redis']:,}, PostgreSQL "
            f"{batch['PostgreSQL']:,}, SQLite {batch['SQLite']:,}); within a group the "
            f"contenders run interleaved, {rounds} rounds, the order rotating each round. "
            "*Ratio* is the median over rounds of contender ÷ baseline in the same round. "
            "*Round trips* are counted on the server (Redis `MONITOR`, commands from "
            "clients; PostgreSQL `pg_stat_statements` calls, BEGIN/COMMIT included) over "
            "a separate pass of 100 pairs."
        ),
    )
    groups: dict[str, list[Contender]] = {}
    skipped: list[tuple[str, str]] = []
    redis_contenders, skipped, redis_db = _redis_contenders(env)
    groups["Redis"] = redis_contenders
    pg_url = None
    if env.has_pg:
        pg_url = env.pg_database("prim")
        groups["PostgreSQL"] = _pg_contenders(env, pg_url)
    groups["SQLite"] = _sqlite_contenders(env)

    table = Table(
        ["store", "contender", "pairs/s (median)", "µs per pair", "ratio to baseline",
         "round trips per pair", "target"],
        align="llrrrrl",
    )  # fmt: skip
    verdicts: list[str] = []
    misses: list[tuple[str, Contender, float]] = []
    for group, contenders in groups.items():
        log(f"{NAME}: {group}: {', '.join(c.name for c in contenders)}")
        byname = {c.name: c for c in contenders}
        for c in contenders:  # warm up: connections, scripts, prepared statements
            _batch(c, 50)
        samples = interleaved(byname, rounds, batch[group])
        base = next(c.name for c in contenders if c.baseline)
        ratios = paired_ratios(samples, base)
        rts = _round_trips(env, group, contenders, redis_db, pg_url)
        _baseline_text, target = GROUPS[group]
        for c in contenders:
            rate = median(samples[c.name])
            tgt = ""
            if c.ours and target is not None:
                met = ratios[c.name] >= target
                tgt = f"≥ {target}\u00d7 raw: {'met' if met else '**missed**'}"
                verdicts.append(
                    target_line(
                        met, f"{c.name} ≥ {target}\u00d7 {base} ({fmt_ratio(ratios[c.name])})"
                    )
                )
                if not met:
                    misses.append((group, c, ratios[c.name]))
                section.summary.append(
                    f"Primitives, {group}: {c.name} {fmt_ratio(ratios[c.name])} the claim+release "
                    f"pairs/s of {base} (target {target}\u00d7)"
                )
            elif c.ours:
                section.summary.append(
                    f"Primitives, {group}: {c.name} {fmt_ratio(ratios[c.name])} the claim+release "
                    f"pairs/s of {base}"
                )
            table.add(
                group,
                c.name + (" (baseline)" if c.baseline else ""),
                fmt_rate(rate),
                fmt_us(1 / rate) if rate == rate and rate else "n/a",
                "1.00\u00d7 (baseline)" if c.baseline else fmt_ratio(ratios[c.name]),
                rts.get(c.name, "n/a"),
                tgt,
            )
    for name, why in skipped:
        table.add("Redis", name, "skipped", "", "", "", f"could not run: {why}")
    if not env.has_pg:
        table.add("PostgreSQL", "all", "skipped", "", "", "", "no PostgreSQL (--pg-url)")
    section.add(table.markdown())
    section.add("\n".join(f"- {v}" for v in verdicts))
    for group, c, ratio in misses:
        section.add(
            _profile_miss(
                env,
                group,
                c,
                groups[group],
                ratio,
                redis_db,
                pg_url,
                batch[group],
                min(rounds, 5),
            )
        )
    for c in itertools.chain.from_iterable(groups.values()):
        if getattr(c.pair, "close", None):
            c.pair.close()  # type: ignore[attr-defined]
    if pg_url is not None:
        env.pg_drop(pg_url)
    return section


def interleaved(byname: dict[str, Contender], rounds: int, n: int) -> dict[str, list[float]]:
    from benchmarks.common import interleave

    return interleave(list(byname), rounds, lambda name, _r: _batch(byname[name], n))


def _round_trips(
    env: Env, group: str, contenders: list[Contender], redis_db: int, pg_url: str | None
) -> dict[str, str]:
    n = 100
    out: dict[str, str] = {}
    if group == "Redis":
        with RedisMonitor(env.store_url(redis_db), redis_db) as mon:
            for c in contenders:
                before = mon.snapshot()
                _batch(c, n)
                after = mon.snapshot()
                cmds = {k: v - before[2].get(k, 0) for k, v in after[2].items()}
                detail = ", ".join(f"{k} {v / n:g}" for k, v in sorted(cmds.items()) if v)
                out[c.name] = f"{(after[0] - before[0]) / n:g} ({detail})"
    elif group == "PostgreSQL" and pg_url is not None and env.pg_stat_statements:
        for c in contenders:
            pg_reset_statements(env)
            _batch(c, n)
            calls = sum(pg_statements(env, pg_url).values())
            out[c.name] = f"{calls / n:g}"
    elif group == "SQLite":
        for c in contenders:
            out[c.name] = "embedded (no server)"
    return out


def _profile_miss(
    env: Env,
    group: str,
    c: Contender,
    contenders: list[Contender],
    ratio: float,
    redis_db: int,
    pg_url: str | None,
    n: int,
    rounds: int,
) -> str:
    """Where the time of a contender that missed its target goes.

    A ladder of variants, interleaved like the contenders, each adding one layer
    between the raw baseline and the product's store, with the server's own time
    (Redis ``commandstats`` usec, PostgreSQL ``pg_stat_statements`` exec time);
    then a cProfile of the product's store by package.
    """
    base = next(x for x in contenders if x.baseline)
    variants = _ladder(env, group, redis_db, pg_url)
    ladder = [base, *variants, c]
    if group == "Redis":
        c.step = ("celery-lease's Python around those scripts (`LeaseStore.claim`/`release`, "
                  "`RedisLeaseStore._run`)")  # fmt: skip
    else:
        c.step = (
            "celery-lease's store path around its own statements (`LeaseStore.claim`/"
            "`release`, `Database.pg_first`/`pg_count`: a driver connection and its cursor "
            "from the store's free list, statements converted to psycopg placeholders once, "
            "plain tuple rows, `Lease`)"
        )
        c.relative_to = variants[-1].name if variants else None  # fmt: skip
    lines = [
        f"**Profile: {c.name} ({fmt_ratio(ratio)} of the baseline).** Each step adds one "
        f"layer; interleaved, {rounds} rounds of {n:,} pairs, medians:",
        "",
    ]
    table = Table(["variant", "µs per pair", "server µs per pair", "client µs per pair"])
    byname = {x.name: x for x in ladder}
    server: dict[str, list[float]] = {x.name: [] for x in ladder}

    def measure(name: str, _r: int) -> float:
        before = _server_us(env, group, redis_db, pg_url)
        t0 = time.perf_counter()
        _batch(byname[name], n)
        wall = (time.perf_counter() - t0) / n
        server[name].append(_server_spent(before, _server_us(env, group, redis_db, pg_url)) / n)
        return wall

    from benchmarks.common import interleave

    walls = interleave(list(byname), rounds, measure)
    for x in ladder:
        w = median(walls[x.name]) * 1e6
        sv = median(server[x.name])
        table.add(x.name, f"{w:,.0f}", f"{sv:,.1f}", f"{w - sv:,.0f}")
    lines.append(table.markdown())
    lines.append("")
    gap = (median(walls[c.name]) - median(walls[base.name])) * 1e6
    c.relative_to = c.relative_to or ladder[-2].name
    steps = []
    for x in ladder[1:]:
        ref = x.relative_to or base.name
        dw = (median(walls[x.name]) - median(walls[ref])) * 1e6
        ds = median(server[x.name]) - median(server[ref])
        steps.append(
            f"{x.step or x.name}: {dw:+,.0f} µs per pair ({ds:+,.1f} µs of it on the server)"
        )
    lines.append(
        f"Where the time goes (the store takes {gap:,.0f} µs per pair more than the baseline): "
        + "; ".join(steps)
        + ". (Steps are measured against different references, so they need not add up; "
        "the machine is shared, so read them as sizes, not exact sums.)"
    )
    lines.append("")
    with profiled() as prof:
        _batch(c, n)
    lines.append(profile_summary(pstats.Stats(prof), n, unit="pair"))
    return "\n".join(lines)


def _ladder(env: Env, group: str, redis_db: int, pg_url: str | None) -> list[Contender]:
    """The variants between the baseline and the product's store."""
    out: list[Contender] = []
    if group == "Redis":
        import redis

        from celery_lease.stores.redis import CLAIM, RELEASE, RedisLeaseStore

        url = env.store_url(redis_db)
        r = redis.Redis.from_url(url)
        set_nx = r.register_script(
            "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])"
        )
        delete = r.register_script("return redis.call('DEL', KEYS[1])")

        def lua_min(key: str) -> None:
            set_nx(keys=[key], args=[OWNER, int(TTL * 1000)])
            delete(keys=[key])

        v = Contender(group, "raw SET NX PX + DEL, each inside a minimal Lua script (EVALSHA)",
                      lua_min)  # fmt: skip
        v.step = "running the two commands as Lua scripts (EVALSHA) instead of plain commands"
        out.append(v)
        claim = r.register_script(CLAIM)
        release = r.register_script(RELEASE)
        names = RedisLeaseStore(url)

        def scripts(key: str) -> None:
            lease_name, fence_name = names.lease_name(key), names.fence_name(key)
            reply = claim(keys=[lease_name, fence_name], args=[OWNER, 30000])
            release(keys=[lease_name], args=[OWNER, reply[1]])

        v = Contender(group, "celery-lease's CLAIM + RELEASE scripts called straight through "
                      "redis-py", scripts)  # fmt: skip
        v.relative_to = out[-1].name
        v.step = ("the bodies of celery-lease's CLAIM and RELEASE scripts instead of minimal "
                  "ones")  # fmt: skip
        out.append(v)
        # RedisLeaseStore keeps connections checked out of the pool between calls and
        # sends EVALSHA on them itself; this variant does the same with the same
        # scripts, so the store's last step below is its own Python alone.
        conn = r.connection_pool.get_connection()
        claim_sha, release_sha = r.script_load(CLAIM), r.script_load(RELEASE)

        def held(key: str) -> None:
            lease_name, fence_name = names.lease_name(key), names.fence_name(key)
            conn.send_command("EVALSHA", claim_sha, 2, lease_name, fence_name, OWNER, 30000)
            reply = conn.read_response()
            conn.send_command("EVALSHA", release_sha, 1, lease_name, OWNER, reply[1])
            conn.read_response()

        v = Contender(group, "the same scripts sent on a connection held across calls "
                      "(`send_command` + `read_response`, as `RedisLeaseStore` does)",
                      held)  # fmt: skip
        v.relative_to = out[-1].name
        v.step = ("sending them on a held connection instead of through redis-py's "
                  "`Script`/`execute_command` (pool checkout, retry and observability "
                  "wrappers per command)")  # fmt: skip
        out.append(v)
    elif group == "PostgreSQL" and pg_url is not None:
        import psycopg
        from sqlalchemy import create_engine, text

        from celery_lease.sql import queries as q
        from celery_lease.sql.dialects import PG_RELEASE_ONE_PY

        dsn = env.pg_dsn(pg_url.rsplit("/", 1)[1])
        conn = psycopg.connect(dsn, autocommit=True)
        claim_sql = q.PG_CLAIM_ONE_PY
        release_sql = PG_RELEASE_ONE_PY
        meta = {"task_id": None, "task_name": None, "root_id": None, "tenant": None}

        def product_sql(key: str) -> None:
            row = conn.execute(claim_sql, {"key": key, "owner_id": OWNER, "ttl": TTL, **meta})
            token = row.fetchone()[0]  # type: ignore[index]
            conn.execute(release_sql, {"key": key, "owner_id": OWNER, "token": token}).fetchall()

        engine = create_engine(pg_url).execution_options(isolation_level="AUTOCOMMIT")
        raw_claim = text(PG_RAW_CLAIM.replace("%s", ":p").replace(":p", ":k", 1)
                         .replace(":p", ":o", 1).replace(":p", ":ttl", 1))  # fmt: skip
        raw_release = text(PG_RAW_RELEASE.replace("%s", ":k", 1).replace("%s", ":o", 1)
                           .replace("%s", ":t", 1))  # fmt: skip

        def sqla_raw(key: str) -> None:
            with engine.begin() as c:
                token = c.execute(raw_claim, {"k": key, "o": OWNER, "ttl": TTL}).scalar_one()
            with engine.begin() as c:
                c.execute(raw_release, {"k": key, "o": OWNER, "t": token})

        v = Contender(group, "the raw statements through SQLAlchemy Core (`text()`, pooled "
                      "autocommit connection)", sqla_raw)  # fmt: skip
        v.step = (
            "SQLAlchemy Core instead of plain psycopg, for the same raw statements (the "
            "store's own path until it moved to the driver: this rung shows why)"
        )
        out.append(v)
        v = Contender(group, "celery-lease's PG_CLAIM_ONE + RELEASE_IN statements straight "
                      "through psycopg", product_sql)  # fmt: skip
        v.step = "celery-lease's own statements instead of the raw ones, both on plain psycopg"
        out.append(v)
    return out


def _pyformat(sql: str) -> str:
    """SQLAlchemy ``:name`` parameters as psycopg ``%(name)s``."""
    import re

    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", sql.replace("%", "%%"))


def _server_us(env: Env, group: str, redis_db: int, pg_url: str | None) -> dict[str, float]:
    """Cumulative server time (µs) so far: Redis commandstats, pg_stat_statements."""
    if group == "Redis":
        return _usec(env.store_url(redis_db))
    return {"total": _pg_server_us(env, group, pg_url)}


#: Redis commands that run a script; its time includes the commands the script runs.
_SCRIPT_COMMANDS = {"cmdstat_eval", "cmdstat_evalsha", "cmdstat_eval_ro", "cmdstat_evalsha_ro",
                    "cmdstat_fcall", "cmdstat_fcall_ro"}  # fmt: skip


def _server_spent(before: dict[str, float], after: dict[str, float]) -> float:
    """Server µs between two :func:`_server_us` snapshots.

    Redis also counts every command a script runs in that command's own
    ``commandstats``, while the script's EVALSHA time already includes it: summing
    all of them counts the scripts' commands twice. Each measured window runs one
    variant, which sends either scripts or plain commands, so a window with
    script time is the scripts' time alone.
    """
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    scripts = sum(v for k, v in delta.items() if k in _SCRIPT_COMMANDS)
    return scripts if scripts > 0 else sum(delta.values())


def _pg_server_us(env: Env, group: str, pg_url: str | None) -> float:
    if group == "PostgreSQL" and pg_url is not None and env.pg_stat_statements:
        name = pg_url.rsplit("/", 1)[1]
        with env.pg_admin() as conn:
            row = conn.execute(
                "SELECT coalesce(sum(total_exec_time), 0) FROM pg_stat_statements s "
                "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s",
                (name,),
            ).fetchone()
        return float(row[0]) * 1000 if row else 0.0
    return 0.0


def _usec(url: str) -> dict[str, float]:
    import redis

    info = redis.Redis.from_url(url).info("commandstats")
    return {k: float(v["usec"]) for k, v in info.items() if k != "cmdstat_info"}
