"""4. Renewal scaling: one process holding 10 … 10,000 leases, one renewal cycle."""

from __future__ import annotations

import pstats
import time
from typing import Any

from benchmarks.counters import RedisMonitor, pg_reset_statements, pg_statements
from benchmarks.env import Env, log
from benchmarks.profiles import profile_summary, profiled
from benchmarks.report import Section, Table, target_line
from benchmarks.stats import fmt_ms, fmt_ratio, interleave, median, paired_ratios

NAME = "renewal"
TITLE = "4. Renewal scaling: leases held by one process, one renewal cycle"
TTL = 30.0
INTERVAL = TTL / 3
OWNER = "bench-renewer:1:0123456789abcdef"


class Holder:
    """n leases of one store, held the way a worker holds them (HeldLease objects)."""

    def __init__(self, store: Any, n: int, prefix: str) -> None:
        from celery_lease.renewal import HeldLease

        self.store = store
        self.helds = []
        for i in range(n):
            lease = store.claim(f"{prefix}-{i}", ttl=TTL, owner_id=OWNER)
            if lease is None:
                raise AssertionError("a fresh key was refused")
            self.helds.append(HeldLease(store, lease))

    def cycle(self) -> float:
        """One renewal cycle through the product's Renewer; seconds."""
        from celery_lease.renewal import Renewer

        before = [h.renewals for h in self.helds]
        t0 = time.perf_counter()
        Renewer().renew_due(self.helds)
        took = time.perf_counter() - t0
        lost = sum(1 for h, b in zip(self.helds, before) if h.renewals != b + 1 or not h.held)
        if lost:
            raise AssertionError(f"{lost} of {len(self.helds)} leases were not renewed")
        return took


class RawRedis:
    """Baseline: n keys with a PX expiry, renewed by one pipeline of n PEXPIRE (no owner check)."""

    def __init__(self, url: str, n: int, prefix: str) -> None:
        import redis

        self.r = redis.Redis.from_url(url)
        self.keys = [f"{prefix}-{i}" for i in range(n)]
        pipe = self.r.pipeline(transaction=False)
        for k in self.keys:
            pipe.set(k, OWNER, px=int(TTL * 1000))
        pipe.execute()

    def cycle(self) -> float:
        t0 = time.perf_counter()
        pipe = self.r.pipeline(transaction=False)
        for k in self.keys:
            pipe.pexpire(k, int(TTL * 1000))
        out = pipe.execute()
        took = time.perf_counter() - t0
        if not all(out):
            raise AssertionError("raw PEXPIRE missed a key")
        return took


class RawPg:
    """Baseline: n rows renewed by one ``UPDATE … WHERE key = ANY(%s) AND owner = %s``."""

    def __init__(self, dsn: str, n: int, prefix: str) -> None:
        import psycopg

        self.conn = psycopg.connect(dsn, autocommit=True)
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_raw_renew (lease_key text PRIMARY KEY, "
            "owner_id text, expires_at double precision)"
        )
        self.keys = [f"{prefix}-{i}" for i in range(n)]
        self.conn.execute(
            "INSERT INTO bench_raw_renew SELECT k, %s, extract(epoch FROM clock_timestamp()) + %s "
            "FROM unnest(%s::text[]) AS k",
            (OWNER, TTL, self.keys),
        )

    def cycle(self) -> float:
        t0 = time.perf_counter()
        cur = self.conn.execute(
            "UPDATE bench_raw_renew SET expires_at = extract(epoch FROM clock_timestamp()) + %s "
            "WHERE lease_key = ANY(%s) AND owner_id = %s RETURNING lease_key, expires_at",
            (TTL, self.keys, OWNER),
        )
        rows = cur.fetchall()
        took = time.perf_counter() - t0
        if len(rows) != len(self.keys):
            raise AssertionError("raw UPDATE missed a row")
        return took


def run(env: Env) -> Section:
    from celery_lease import LeaseStore

    levels = [10, 100, 1000] if env.quick else [10, 100, 1000, 10000]
    rounds = 3 if env.quick else 7
    section = Section(
        NAME,
        TITLE,
        intro=(
            "One process claims n leases (TTL 30 s, so the renewal interval is 10 s), wraps "
            "each in the `HeldLease` a worker uses, and runs renewal cycles through the "
            "product's own `celery_lease.renewal.Renewer().renew_due(held_leases)` (which "
            "groups them by store and calls `store.renew_many`); every lease is checked to "
            "be renewed after each cycle. Baselines renew the same number of keys without "
            "owner or token checks: Redis, one pipeline of n `PEXPIRE`; PostgreSQL, one "
            "`UPDATE … WHERE lease_key = ANY($1)` (psycopg, autocommit). Contenders "
            f"interleave at each size, {rounds} rounds. *Ratio* is baseline time ÷ "
            "celery-lease time in the same round (1.00\u00d7 = as fast as the baseline). Round "
            "trips are counted on the server during one extra cycle (Redis `MONITOR`, "
            "commands from clients; PostgreSQL `pg_stat_statements` calls)."
        ),
    )
    db = env.redis_db()
    redis_url = env.store_url(db)
    pg_url = env.pg_database("renew") if env.has_pg else None
    table = Table(
        ["leases", "store", "round trips per cycle", "wall per cycle (median)",
         "µs per lease", "share of the 10 s interval", "ratio to baseline", "target"],
        align="rlrrrrrl",
    )  # fmt: skip
    verdicts: list[str] = []
    rts: dict[str, dict[int, float]] = {"Redis": {}, "PostgreSQL": {}}
    worst: dict[str, tuple[int, float]] = {}
    stores: dict[str, Any] = {"Redis": LeaseStore.from_url(redis_url)}
    if pg_url:
        stores["PostgreSQL"] = LeaseStore.from_url(pg_url)
    holders_at_max: dict[str, Holder] = {}
    for n in levels:
        log(f"{NAME}: {n} leases")
        contenders: dict[str, Any] = {}
        contenders["Redis"] = Holder(stores["Redis"], n, f"renew-{n}")
        contenders["raw Redis"] = RawRedis(redis_url, n, f"raw-renew-{n}")
        if pg_url:
            contenders["PostgreSQL"] = Holder(stores["PostgreSQL"], n, f"renew-{n}")
            contenders["raw PostgreSQL"] = RawPg(env.pg_dsn(pg_url.rsplit("/", 1)[1]), n,
                                                 f"raw-renew-{n}")  # fmt: skip
        for c in contenders.values():
            c.cycle()  # warm up
        samples = interleave(
            list(contenders), rounds, lambda name, _r, cs=contenders: cs[name].cycle()
        )
        # counted cycles
        with RedisMonitor(redis_url, db) as mon:
            s0 = mon.snapshot()
            contenders["Redis"].cycle()
            s1 = mon.snapshot()
        rts["Redis"][n] = s1[0] - s0[0]
        if pg_url and env.pg_stat_statements:
            pg_reset_statements(env)
            contenders["PostgreSQL"].cycle()
            rts["PostgreSQL"][n] = sum(pg_statements(env, pg_url).values())
        for store in ("Redis", "PostgreSQL"):
            if store not in contenders:
                continue
            inverse = {k: [1 / x for x in v] for k, v in samples.items()}
            ratio = paired_ratios(inverse, f"raw {store}")[store]
            wall = median(samples[store])
            raw_wall = median(samples[f"raw {store}"])
            tgt = ""
            if n == levels[-1]:
                worst[store] = (n, wall)
                if n >= 10000:
                    met = wall < INTERVAL / 10
                    tgt = f"< 1 s at 10,000: {'met' if met else '**missed**'}"
            table.add(
                f"{n:,}", store, f"{rts[store].get(n, float('nan')):g}", fmt_ms(wall),
                f"{wall / n * 1e6:,.1f}", f"{wall / INTERVAL:.3%}", fmt_ratio(ratio), tgt,
            )  # fmt: skip
            table.add(
                f"{n:,}", f"raw {store} (baseline)",
                "1 (one pipeline)" if store == "Redis" else "1", fmt_ms(raw_wall),
                f"{raw_wall / n * 1e6:,.1f}", f"{raw_wall / INTERVAL:.3%}", "1.00\u00d7", "",
            )  # fmt: skip
        if n == levels[-1]:
            holders_at_max = {s: contenders[s] for s in ("Redis", "PostgreSQL") if s in contenders}
    section.add(table.markdown())
    for store, per_level in rts.items():
        if not per_level:
            continue
        constant = len(set(per_level.values())) == 1
        verdicts.append(
            target_line(
                constant,
                f"{store}: a constant number of round trips per cycle "
                f"({', '.join(f'{v:g} at {k:,}' for k, v in per_level.items())})",
            )
        )
    for store, (n, wall) in worst.items():
        if n >= 10000:
            met = wall < INTERVAL / 10
            verdicts.append(
                target_line(met, f"{store}: {n:,} leases renewed in under 1 s ({fmt_ms(wall)})")
            )
            section.summary.append(
                f"Renewal, {store}: {n:,} leases in {fmt_ms(wall)} per cycle, "
                f"{', '.join(f'{v:g}' for v in rts[store].values())} round trip(s) per cycle"
            )
            if not met:
                h = holders_at_max[store]
                with profiled() as prof:
                    h.cycle()
                section.add(
                    f"**Profile: {store}, one cycle of {n:,} leases.**\n\n"
                    + profile_summary(pstats.Stats(prof), n, unit="lease")
                )
        elif env.quick:
            verdicts.append(
                f"Target: 10,000 leases renewed in under 1 s: n/a in the quick pass "
                f"({store}: {n:,} leases in {fmt_ms(wall)})."
            )
    section.add("\n".join(f"- {v}" for v in verdicts))
    for s in stores.values():
        s.close()
    if pg_url:
        env.pg_drop(pg_url)
    return section
