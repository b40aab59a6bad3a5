"""What section 1 races: the claim + release pairs of each store, its raw baseline
and peers, and the ladder of variants between a baseline and the product's store."""

from __future__ import annotations

import itertools
import sqlite3
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from benchmarks.env import Env

if TYPE_CHECKING:
    from celery_lease import LeaseStore

TTL = 30.0
OWNER = "bench-owner:1:0123456789abcdef"


def pg_raw_statements(table: str) -> tuple[str, str, str]:
    """The raw PostgreSQL baseline on ``table``: its CREATE, claim and release."""
    create = f"""
CREATE TABLE IF NOT EXISTS {table} (
    lease_key text PRIMARY KEY, owner_id text, fencing_token bigint NOT NULL,
    expires_at double precision NOT NULL)
"""
    claim = f"""
INSERT INTO {table} AS l (lease_key, owner_id, fencing_token, expires_at)
VALUES (%s, %s, 1, extract(epoch FROM clock_timestamp()) + %s)
ON CONFLICT (lease_key) DO UPDATE SET owner_id = excluded.owner_id,
    fencing_token = l.fencing_token + 1, expires_at = excluded.expires_at
WHERE l.expires_at <= extract(epoch FROM clock_timestamp())
RETURNING fencing_token
"""
    release = f"""
UPDATE {table} SET expires_at = extract(epoch FROM clock_timestamp())
WHERE lease_key = %s AND owner_id = %s AND fencing_token = %s
"""
    return create, claim, release


PG_RAW_TABLE, PG_RAW_CLAIM, PG_RAW_RELEASE = pg_raw_statements("bench_raw_leases")

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


def _store_pair(store: LeaseStore) -> Pair:
    """celery-lease's claim + release on ``store``."""

    def ours(key: str) -> None:
        lease = store.claim(key, ttl=TTL, owner_id=OWNER)
        if lease is None:
            raise AssertionError("celery-lease refused a fresh key")
        store.release(lease)

    return ours


def redis_contenders(env: Env) -> tuple[list[Contender], list[tuple[str, str]], int]:
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

    ours = _store_pair(store)

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


def pg_contenders(env: Env, url: str) -> list[Contender]:
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

    ours = _store_pair(store)

    return [
        Contender("PostgreSQL", "raw INSERT ON CONFLICT + UPDATE (psycopg)", raw, baseline=True),
        Contender("PostgreSQL", "celery-lease `SQLLeaseStore` (PostgreSQL)", ours, ours=True),
    ]


def sqlite_contenders(env: Env) -> list[Contender]:
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

    ours = _store_pair(store)

    return [
        Contender("SQLite", "raw INSERT ON CONFLICT + UPDATE (sqlite3)", raw, baseline=True),
        Contender("SQLite", "celery-lease `SQLLeaseStore` (SQLite)", ours, ours=True),
    ]


_keys = itertools.count()


def run_pairs(c: Contender, n: int) -> float:
    """Run n claim+release pairs on fresh keys; pairs per second."""
    prefix = f"bench-prim-{next(_keys)}"
    pair = c.pair
    t0 = time.perf_counter()
    for i in range(n):
        pair(f"{prefix}-{i}")
    return n / (time.perf_counter() - t0)


def ladder_variants(env: Env, group: str, redis_db: int, pg_url: str | None) -> list[Contender]:
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
