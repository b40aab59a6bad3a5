"""1. Lease primitives: claim + release pairs per second on one connection, distinct keys."""

from __future__ import annotations

import itertools
import pstats
import time

from benchmarks.counters import RedisMonitor, pg_reset_statements, pg_statements
from benchmarks.env import Env, log
from benchmarks.primitive_contenders import (
    Contender,
    ladder_variants,
    pg_contenders,
    redis_contenders,
    run_pairs,
    sqlite_contenders,
)
from benchmarks.profiles import profile_summary, profiled
from benchmarks.report import Section, Table, target_line
from benchmarks.stats import fmt_rate, fmt_ratio, fmt_us, interleave, median, paired_ratios

NAME = "primitives"
TITLE = "1. Lease primitives: claim + release pairs per second"

#: (group, baseline, target ratio or None)
GROUPS = {
    "Redis": ("raw SET NX PX + DEL", 0.9),
    "PostgreSQL": ("raw INSERT … ON CONFLICT DO UPDATE + UPDATE (psycopg, autocommit)", 0.8),
    "SQLite": ("raw INSERT … ON CONFLICT DO UPDATE + UPDATE (sqlite3, autocommit)", None),
}


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
    groups["Redis"], skipped, redis_db = redis_contenders(env)
    pg_url = None
    if env.has_pg:
        pg_url = env.pg_database("prim")
        groups["PostgreSQL"] = pg_contenders(env, pg_url)
    groups["SQLite"] = sqlite_contenders(env)

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
            run_pairs(c, 50)
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
    return interleave(list(byname), rounds, lambda name, _r: run_pairs(byname[name], n))


def _round_trips(
    env: Env, group: str, contenders: list[Contender], redis_db: int, pg_url: str | None
) -> dict[str, str]:
    n = 100
    out: dict[str, str] = {}
    if group == "Redis":
        with RedisMonitor(env.store_url(redis_db), redis_db) as mon:
            for c in contenders:
                before = mon.snapshot()
                run_pairs(c, n)
                after = mon.snapshot()
                cmds = {k: v - before[2].get(k, 0) for k, v in after[2].items()}
                detail = ", ".join(f"{k} {v / n:g}" for k, v in sorted(cmds.items()) if v)
                out[c.name] = f"{(after[0] - before[0]) / n:g} ({detail})"
    elif group == "PostgreSQL" and pg_url is not None and env.pg_stat_statements:
        for c in contenders:
            pg_reset_statements(env)
            run_pairs(c, n)
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
    variants = ladder_variants(env, group, redis_db, pg_url)
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
        run_pairs(byname[name], n)
        wall = (time.perf_counter() - t0) / n
        server[name].append(_server_spent(before, _server_us(env, group, redis_db, pg_url)) / n)
        return wall

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
        run_pairs(c, n)
    lines.append(profile_summary(pstats.Stats(prof), n, unit="pair"))
    return "\n".join(lines)


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
