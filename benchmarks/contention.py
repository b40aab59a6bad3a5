"""5. Contention: 32 processes claiming one key."""

from __future__ import annotations

import array
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

from benchmarks.env import Env, log
from benchmarks.primitive_contenders import pg_raw_statements
from benchmarks.report import Section, Table
from benchmarks.stats import (
    fmt_rate,
    fmt_ratio,
    fmt_us,
    interleave,
    median,
    paired_ratios,
    percentile,
)

NAME = "contention"
TITLE = "5. Contention: 32 processes on one key"
PROCS = 32
TTL = 30.0

PG_RAW_TABLE, PG_RAW_CLAIM, PG_RAW_RELEASE = pg_raw_statements("bench_raw_contention")

#: contender -> (store, baseline?)
CONTENDERS = {
    "raw Redis `SET NX PX` + `DEL`": ("Redis", True),
    "celery-lease Redis": ("Redis", False),
    "raw PostgreSQL `INSERT … ON CONFLICT` + `UPDATE`": ("PostgreSQL", True),
    "celery-lease PostgreSQL": ("PostgreSQL", False),
}


def _make(name: str, url: str, owner: str) -> tuple[Callable[[str], bool], Callable[[], None]]:
    """(try_claim_and_release(key) -> granted, close) for one contender, in this process."""
    if name.startswith("raw Redis"):
        import redis

        r = redis.Redis.from_url(url)

        def raw_redis(key: str) -> bool:
            if r.set(key, owner, nx=True, px=int(TTL * 1000)):
                r.delete(key)
                return True
            return False

        return raw_redis, r.close
    if name.startswith("raw PostgreSQL"):
        import psycopg

        conn = psycopg.connect(url, autocommit=True)

        def raw_pg(key: str) -> bool:
            row = conn.execute(PG_RAW_CLAIM, (key, owner, TTL)).fetchone()
            if row is None:
                return False
            conn.execute(PG_RAW_RELEASE, (key, owner, row[0]))
            return True

        return raw_pg, conn.close
    from celery_lease import LeaseStore

    store = LeaseStore.from_url(url)

    def ours(key: str) -> bool:
        lease = store.claim(key, ttl=TTL, owner_id=owner)
        if lease is None:
            return False
        store.release(lease)
        return True

    return ours, store.close


def _child(name: str, url: str, key: str, start_at: float, end_at: float, out: Any) -> None:
    owner = f"bench-contender:{os.getpid()}"
    try:
        attempt, close = _make(name, url, owner)
        lat = array.array("d")
        grants = 0
        now = time.monotonic()
        if start_at > now:
            time.sleep(start_at - now)
        perf = time.perf_counter
        while time.monotonic() < end_at:
            t0 = perf()
            ok = attempt(key)
            lat.append(perf() - t0)
            grants += ok
        close()
        out.send((grants, lat.tobytes(), None))
    except Exception as e:  # noqa: BLE001 - handed to the parent
        out.send((0, b"", f"{type(e).__name__}: {e}"))
    finally:
        out.close()


def _round(name: str, url: str, key: str, seconds: float) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    start_at = time.monotonic() + 1.0  # time to fork and connect 32 processes
    end_at = start_at + seconds
    pipes, procs = [], []
    for _ in range(PROCS):
        rx, tx = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(name, url, key, start_at, end_at, tx), daemon=True)
        p.start()
        tx.close()
        pipes.append(rx)
        procs.append(p)
    grants = 0
    lat = array.array("d")
    errors = []
    for rx in pipes:
        g, raw, err = rx.recv()
        grants += g
        lat.frombytes(raw)
        if err:
            errors.append(err)
    for p in procs:
        p.join(10)
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} processes failed, e.g. {errors[0]}")
    xs = lat.tolist()
    return {
        "grants": grants / seconds,
        "attempts": len(xs) / seconds,
        "p50": percentile(xs, 50),
        "p99": percentile(xs, 99),
    }


def run(env: Env) -> Section:
    seconds = 0.5 if env.quick else 3.0
    rounds = 1 if env.quick else 5
    section = Section(
        NAME,
        TITLE,
        intro=(
            f"{PROCS} processes (forked, one connection each) loop for {seconds:g} s on the "
            "same key: try to claim it (TTL 30 s) and, when granted, release it at once. "
            "*Grants/s* counts successful claims; *claim latency* is every attempt's time "
            "(granted or refused) as the client sees it. Contenders of a store run "
            f"interleaved, {rounds} rounds; ratios are celery-lease ÷ the raw baseline in the "
            "same round (for latency, > 1\u00d7 means slower). 32 processes share "
            f"{os.cpu_count()} CPUs here, so much of the latency is waiting for a CPU, and "
            "the client's CPU time per attempt weighs heavily."
        ),
    )
    db = env.redis_db()
    urls = {"Redis": env.store_url(db)}
    pg_url = None
    if env.has_pg:
        pg_url = env.pg_database("contention")
        urls["PostgreSQL"] = pg_url
        import psycopg

        with psycopg.connect(env.pg_dsn(pg_url.rsplit("/", 1)[1]), autocommit=True) as c:
            c.execute(PG_RAW_TABLE)
    table = Table(
        ["store", "contender", "grants/s", "attempts/s", "claim p50", "claim p99",
         "grants ratio", "p50 ratio", "p99 ratio"],
        align="llrrrrrrr",
    )  # fmt: skip
    for store in ("Redis", "PostgreSQL"):
        if store not in urls:
            table.add(store, "all", "skipped (no PostgreSQL)", "", "", "", "", "", "")
            continue
        names = [n for n, (s, _) in CONTENDERS.items() if s == store]
        url = urls[store]
        if store == "PostgreSQL":
            url_for = {n: (env.pg_dsn(url.rsplit("/", 1)[1]) if CONTENDERS[n][1] else url)
                       for n in names}  # fmt: skip
        else:
            url_for = {n: url for n in names}
        results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}

        def measure(name: str, r: int, url_for: dict[str, str] = url_for,
                    results: dict[str, list[dict[str, Any]]] = results,
                    names: list[str] = names) -> float:  # fmt: skip
            key = f"contended-{r}-{os.getpid()}-{names.index(name)}"
            res = _round(name, url_for[name], key, seconds)
            results[name].append(res)
            log(f"{NAME}: {name}: {fmt_rate(res['grants'])} grants/s, p50 {fmt_us(res['p50'])}")
            return float(res["grants"])

        interleave(names, rounds, measure)
        base = next(n for n in names if CONTENDERS[n][1])
        metric = {m: {n: [x[m] for x in results[n]] for n in names}
                  for m in ("grants", "attempts", "p50", "p99")}  # fmt: skip
        ratios = {m: paired_ratios(metric[m], base) for m in metric}
        for n in names:
            is_base = n == base
            table.add(
                store,
                n + (" (baseline)" if is_base else ""),
                fmt_rate(median(metric["grants"][n])),
                fmt_rate(median(metric["attempts"][n])),
                fmt_us(median(metric["p50"][n])),
                fmt_us(median(metric["p99"][n])),
                "1.00\u00d7" if is_base else fmt_ratio(ratios["grants"][n]),
                "1.00\u00d7" if is_base else fmt_ratio(ratios["p50"][n]),
                "1.00\u00d7" if is_base else fmt_ratio(ratios["p99"][n]),
            )
            if not is_base:
                section.summary.append(
                    f"Contention ({PROCS} processes, one key), {n}: "
                    f"{fmt_ratio(ratios['grants'][n])} the grants/s of {base}, p99 claim "
                    f"latency {fmt_ratio(ratios['p99'][n])}"
                )
    section.add(table.markdown())
    if pg_url:
        env.pg_drop(pg_url)
    return section
