"""2. Per task through a real worker: drain rate of pre-enqueued no-op tasks."""

from __future__ import annotations

import pstats

from benchmarks import statements
from benchmarks.drains import CPU_GROUPS, Tally, cpu_table
from benchmarks.env import Env, log
from benchmarks.profiles import by_package, cumulative, profile_compare, top_functions
from benchmarks.report import Section, Table, mark, target_line
from benchmarks.stats import fmt_rate, fmt_ratio, interleave, median, median_interval, paired_ratios
from benchmarks.workers import FLOORS, KINDS, Kind, Targets, WorkerRun, drain

NAME = "per_task"
TITLE = "2. Per task through a real worker: drain rate"
POOLS = ["solo", "prefork"]


def run(env: Env) -> Section:
    n = 150 if env.quick else 2000
    rounds = env.rounds or (1 if env.quick else 3)
    targets = Targets.make(env, "pertask")
    section = Section(
        NAME,
        TITLE,
        intro=(
            f"{n:,} no-op tasks (distinct arguments, so a distinct lease key per task) are "
            "enqueued on a Redis broker first; then a `celery worker` starts (`-P solo`, or "
            "`-P prefork -c 2`; `-l WARNING`, no mingle/gossip/heartbeat; `task_acks_late`, "
            "prefetch multiplier 4, no result backend, the same settings for every contender) "
            "and drains the queue. The rate is (N - 1) ÷ (last - first completion), from "
            "timestamps a `task_postrun` handler writes (after the contender's own "
            "bookkeeping: commit, unlock, …), so worker start-up is not counted. Peers keep "
            "their locks in the same Redis as the Redis lease store (not the broker). "
            f"Contenders interleave within each pool, {rounds} round(s), rotating order; "
            "*ratio* is the median over rounds of contender ÷ plain in the same round. "
            "celery-once and celery-singleton take their lock when the task is *published*; "
            "that cost is in the enqueue column, not in the drain rate. fencekit has a "
            "Celery helper, `fencekit.celery.idempotent_task`, used as documented "
            "(IdempotencyGuard + DistributedLock, result memoized). `LeasedTask` runs with "
            "its defaults (exclusive mode, result committed through the fenced table)."
        ),
    )
    #: the floors (a durable result per task, no lease) run in the full run only
    contenders = KINDS if env.quick else [*KINDS, *FLOORS]
    if env.contenders:  # a head-to-head: these and the baseline only
        contenders = [k for k in contenders if k.key in {"plain", *env.contenders}]
    kinds = {k.key: k for k in contenders}
    skipped: dict[str, str] = {}
    for k in contenders:
        why = targets.available(k)
        if why:
            skipped[k.key] = why
    runnable = [k for k in kinds if k not in skipped]
    #: the quick pass runs prefork for plain and one LeasedTask configuration only
    quick_prefork = ["plain", "leased-redis-pg"]
    results: dict[str, dict[str, list[float]]] = {}
    tally = Tally(NAME, n)
    try:
        for pool in POOLS:
            these = [k for k in runnable if not (env.quick and pool == "prefork")
                     or k in quick_prefork]  # fmt: skip

            def measure(key: str, r: int, pool: str = pool) -> float | None:
                return tally.record(pool, key, r, drain(targets, kinds[key], pool, n))

            results[pool] = interleave(these, rounds, measure)

        table = Table(
            ["pool", "contender", "tasks/s (median)", "ms per task", "ratio to plain",
             "enqueue tasks/s", "target"],
            align="llrrrrl",
        )  # fmt: skip
        verdicts: list[str] = []
        misses: list[Kind] = []
        floor_lines: list[str] = []
        for pool in POOLS:
            samples = results[pool]
            ratios = paired_ratios(samples, "plain")
            peers = [k for k in samples if kinds[k].peer]
            missed_here: list[str] = []
            for key in samples:
                k = kinds[key]
                rate = median(samples[key])
                tgt = ""
                if k.ours:
                    behind = [
                        kinds[p].label.split(" ")[0] for p in peers if not ratios[key] > ratios[p]
                    ]
                    met_ratio = ratios[key] >= 0.8
                    met = met_ratio and not behind
                    tgt = f"≥ 0.8\u00d7 plain: {'met' if met_ratio else '**missed**'}; " + (
                        "ahead of every peer" if not behind else f"**behind {', '.join(behind)}**"
                    )
                    verdicts.append(
                        target_line(
                            met,
                            f"{pool}, {k.label} ≥ 0.8\u00d7 plain and ahead of every peer "
                            f"({fmt_ratio(ratios[key])}"
                            + (f"; behind {', '.join(behind)}" if behind else "")
                            + ")",
                        )
                    )
                    section.summary.append(
                        f"Per task ({pool}): {k.label}: {fmt_ratio(ratios[key])} of plain"
                        + (f", behind {', '.join(behind)}" if behind else ", ahead of every peer")
                    )
                    if not met and pool == "solo" and k not in misses:
                        misses.append(k)
                    if not met:
                        missed_here.append(key)
                elif k.kind == "leased":
                    section.summary.append(
                        f"Per task ({pool}): {k.label}: {fmt_ratio(ratios[key])} of plain"
                    )
                elif k.kind == "floor":
                    tgt = "reference (the floor), not a target"
                table.add(
                    pool,
                    k.label + (" (baseline)" if key == "plain" else ""),
                    fmt_rate(rate),
                    f"{1000 / rate:.2f}" if rate == rate and rate else "n/a",
                    "1.00\u00d7" if key == "plain" else fmt_ratio(ratios[key]),
                    fmt_rate(median(tally.enqueue[pool][key])),
                    tgt,
                )
            for key, why in skipped.items():
                table.add(pool, kinds[key].label, "skipped", "", "", "", f"could not run: {why}")
            for key in runnable:
                if key not in samples:
                    table.add(pool, kinds[key].label, "not run", "", "", "", "quick pass")
            if any(kinds[key].kind == "floor" for key in samples):
                floor_lines += _floors(pool, kinds, samples, ratios, missed_here)
                section.summary.append(_floor_summary(pool, ratios))
            for text, pair_met in _pair_targets(samples):
                verdicts.append(target_line(pair_met, f"{pool}, {text}"))
                section.summary.append(f"Per task ({pool}): {text}: {mark(pair_met)}")
            verdicts += [f"{pool}, {text}" for text in _pair_cpu(tally.cpu.get(pool, {}))]
        section.add(table.markdown())
        section.add("\n".join(f"- {v}" for v in verdicts))
        if floor_lines:
            fsync = _pg_fsync(env, targets)
            section.add(
                "**The floor on this machine.** The peers record no result; a fenced "
                "`LeasedTask` durably writes one result row per task (plus its lease claim "
                "and release). The *floor* rows are plain tasks whose body writes its result "
                "row with one raw driver statement, no lease, no fencing: psycopg "
                "`INSERT … ON CONFLICT DO NOTHING` in autocommit on a connection opened once "
                "per worker process, into a table with a primary key on the task id and a "
                "`jsonb` result, in the same PostgreSQL database as the Redis-store "
                "`LeasedTask`'s results (*2 round trips*: a `SELECT` by task id first, the "
                "least a lease's claim or look-up needs; *five round trips*: Redis `SET NX PX`, "
                "two `SELECT`s, Redis `DEL`, the `INSERT`, the order of the commit protocol "
                "for Redis leases with PostgreSQL results: claim; register and look up; at "
                "the commit, lock the fence row, check the lease in Redis while holding it, "
                "write); and Python's `sqlite3` `INSERT`, "
                "committed per task, with celery-lease's SQLite settings (WAL, "
                "`busy_timeout` 30 s, `synchronous` at its default, FULL; *two committed "
                "INSERTs*: the two transactions a lease claimed before the body and "
                "committed after it needs). Any design that records a result durably pays "
                "at least this. *celery-lease's own two statements sent raw* is not a "
                "design floor but a split of `LeasedTask`'s cost: the PostgreSQL "
                "claim-and-look-up call and the commit-and-release statement it sends for "
                "one key, sent from the body with raw psycopg, no celery-lease code; its "
                "distance to *two round trips* is what the fenced protocol's writes (lease "
                "row, fence row, result row and their indexes) cost the server, and "
                "`LeasedTask`'s distance to it is celery-lease's own Python. "
                + (
                    "The benchmark's PostgreSQL runs with `fsync` off, so a PostgreSQL commit "
                    "here costs a round trip and a WAL write, not a disk flush, for the floor "
                    "and `LeasedTask` alike; SQLite syncs its WAL at every commit. "
                    if fsync == "off"
                    else ""
                )
                + "*Extra* is the time per task "
                "above plain, (1 ÷ ratio - 1) \u00d7 plain's median ms per task.\n\n"
                + "\n".join(f"- {line}" for line in floor_lines)
            )
        section.add(cpu_table(tally.cpu, kinds))
        if not env.quick and not env.contenders:
            plain_prefork = median(results.get("prefork", {}).get("plain", []))
            section.add(statements.run(env, n=2000, rounds=3, plain_prefork=plain_prefork))
        left_out = tally.left_out()
        if left_out:
            section.add(left_out)
        if misses and not env.quick and not env.contenders:
            section.add(_profile(targets, misses, n=min(n, 1000)))
        elif misses:
            section.add("_Profiles of the misses are taken in the full run only._")
    finally:
        targets.close()
    return section


#: The module whose Execution methods are the task path's steps (claim, prepare,
#: commit, release); a step that did not run (or is no longer defined there)
#: reads "not run", never 0.
EXECUTOR = "celery_lease/execution.py"


def _profile(targets: Targets, misses: list[Kind], n: int) -> str:
    """cProfile the solo worker's main thread (it runs the tasks) for plain and the misses."""
    kinds = {k.key: k for k in KINDS}
    profiles: dict[str, tuple[pstats.Stats, int]] = {}
    skip = min(100, n // 5)  # warm-up tasks (first-use imports, connections) not profiled
    extra = [kinds["leased-redis-nocommit"]] if "leased-redis-nocommit" in kinds else []
    profiled_kinds = [kinds["plain"], *extra, *misses]
    for k in profiled_kinds:
        path = targets.env.tmpdir / f"profile-{k.key}.pstats"
        run = WorkerRun(
            targets,
            k,
            "solo",
            extra_env={
                "BENCH_PROFILE": str(path),
                "BENCH_PROFILE_SKIP": str(skip),
                "BENCH_PROFILE_UNTIL": str(n),
            },
        )
        try:
            run.enqueue(n)
            run.start()
            err = run.wait(n, timeout=max(120.0, n / 10))
            run.stop(warm=True)
        finally:
            run.cleanup()
        if err or not path.exists():
            log(f"{NAME}: profile of {k.key} failed: {err}")
            continue
        profiles[k.key] = (pstats.Stats(str(path)), n - skip)
    if not profiles:
        return "_Profiling failed._"
    parts = [
        f"**Profile (solo worker, cProfile over {n - skip:,} tasks after {skip} warm-up "
        "tasks, the worker's main thread, which runs the tasks and the broker loop; "
        "cProfile inflates Python-heavy code, so read shares, not absolute times).**",
        "",
        profile_compare(profiles),
    ]
    plain = by_package(*profiles["plain"]) if "plain" in profiles else {}
    for k in profiled_kinds[1:]:
        if k.key not in profiles:
            continue
        stats, per = profiles[k.key]
        mine = by_package(stats, per)
        more = sum(mine.values()) - sum(plain.values())
        deltas = sorted(((c, mine.get(c, 0.0) - plain.get(c, 0.0)) for c in mine),
                        key=lambda kv: -kv[1])  # fmt: skip
        shown = [f"{c} {d * 1e6:+,.0f} µs" for c, d in deltas if abs(d) * 1e6 >= 50]
        steps = [
            (what, cumulative(stats, per, EXECUTOR, what))
            for what in ("claim", "prepare", "commit", "release")
        ]
        parts += [
            "",
            f"Where the time goes, {k.label}: {more * 1e6:,.0f} µs per task more than plain "
            f"under cProfile: {', '.join(shown)}. Of the task path, "
            + ", ".join(
                f"{what} {t * 1e6:,.0f} µs" if t is not None else f"{what} not run"
                for what, t in steps
            )
            + f" (cumulative, `{EXECUTOR}`).",
            "",
            f"{k.label}: heaviest celery-lease functions:",
            "",
            top_functions(stats, per, "celery_lease"),
        ]
    return "\n".join(parts)


def _pg_fsync(env: Env, targets: Targets) -> str | None:
    """The PostgreSQL server's ``fsync`` setting (None if unknown)."""
    if not targets.pg_redis_results:
        return None
    import psycopg

    try:
        dsn = env.pg_dsn(targets.pg_redis_results.rsplit("/", 1)[1])
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SHOW fsync").fetchone()
    except psycopg.Error:  # the sentence is left out
        return None
    return str(row[0]) if row else None


#: the floor each result store is measured against: (floor key, what it is)
_PG_FLOORS = [
    ("floor-pg", "one PostgreSQL INSERT"),
    ("floor-pg-2rt", "two PostgreSQL round trips"),
]
#: Each LeasedTask configuration's floors, cheapest first.
_FLOOR_OF = {
    "leased-redis-pg": [
        *_PG_FLOORS,
        ("floor-redis-pg-5rt", "the five round trips of the Redis + PostgreSQL commit order"),
    ],
    "leased-pg-pg": [
        *_PG_FLOORS,
        ("floor-pg-protocol", "celery-lease's own two statements sent raw"),
    ],
    "leased-sqlite": [
        ("floor-sqlite", "one SQLite INSERT"),
        ("floor-sqlite-2tx", "two committed SQLite INSERTs"),
    ],
}


#: the least a lease claimed before the body and committed after it needs, by store
_DESIGN_FLOOR = {
    "leased-redis-pg": (
        "floor-redis-pg-5rt",
        "five round trips (Redis, PostgreSQL, PostgreSQL, Redis, PostgreSQL)",
    ),
    "leased-pg-pg": ("floor-pg-2rt", "two PostgreSQL round trips"),
    "leased-sqlite": ("floor-sqlite-2tx", "two committed SQLite INSERTs"),
}


def _extra_ms(ratio: float, plain_ms: float) -> float:
    """Time per task above plain implied by a ratio to plain."""
    return (1 / ratio - 1) * plain_ms if ratio == ratio and ratio > 0 else float("nan")


def _floors(
    pool: str,
    kinds: dict[str, Kind],
    samples: dict[str, list[float]],
    ratios: dict[str, float],
    missed: list[str],
) -> list[str]:
    """The floor lines of one pool: the floors, then each missed contender against its own."""
    plain_rate = median(samples.get("plain", []))
    plain_ms = 1000 / plain_rate if plain_rate == plain_rate and plain_rate else float("nan")

    def at(key: str) -> str:
        r = ratios.get(key, float("nan"))
        extra = _extra_ms(r, plain_ms)
        return fmt_ratio(r) + (f" (extra {extra:+.2f} ms)" if extra == extra else "")

    lines = [
        f"{pool}: floor: plain + one durable PostgreSQL INSERT per task (no lease) runs at "
        f"{at('floor-pg')} of plain; with two round trips {at('floor-pg-2rt')}; with "
        f"five in the Redis + PostgreSQL order {at('floor-redis-pg-5rt')}; "
        f"celery-lease's own two statements sent raw {at('floor-pg-protocol')}; SQLite "
        f"{at('floor-sqlite')}, two committed SQLite INSERTs {at('floor-sqlite-2tx')} "
        f"(plain: {plain_ms:.2f} ms per task)."
    ]
    for key in missed:
        k = kinds[key]
        floors = [(f, what) for f, what in _FLOOR_OF.get(key, []) if f in ratios]
        if not floors:
            continue
        mine = _extra_ms(ratios[key], plain_ms)
        against = []
        for f, what in floors:
            theirs = _extra_ms(ratios[f], plain_ms)
            detail = [f"extra {theirs:+.2f} ms"] if theirs == theirs else []
            if mine == mine and mine > 0 and theirs == theirs:
                detail.append(
                    f"{theirs / mine:.0%} of its extra time"
                    if theirs > 0
                    else "within noise of plain: none of its extra time"
                )
            against.append(
                f"a floor of {fmt_ratio(ratios[f])} for {what}"
                + (f" ({', '.join(detail)})" if detail else "")
            )
        lines.append(f"{pool}: {k.label}: {at(key)} against " + " and ".join(against) + ".")
        floor_key, floor_what = _DESIGN_FLOOR.get(key, ("", ""))
        design = ratios.get(floor_key, float("nan"))
        if design != design:
            continue
        what = f"{floor_what} from a plain task, no lease, no fencing"
        if design < 0.8:
            lines.append(
                f"{pool}: {k.label}: 0.8\u00d7 is out of reach on this machine for any "
                f"design that claims before the body and records after it: its floor "
                f"({what}) runs at {fmt_ratio(design)}."
            )
        ahead = [kinds[p].label for p, r in ratios.items() if kinds[p].peer and not design > r]
        if ahead:
            lines.append(
                f"{pool}: {k.label}: being ahead of {', '.join(ahead)} is out of reach on this "
                f"machine for any such design: its floor ({what}) runs at {fmt_ratio(design)}, "
                "not above theirs (they lock at publish time and record no result)."
            )
    return lines


#: Head-to-head targets, each (contender, baseline, least ratio, what the baseline is):
#: the lock-only task against the peers (which lock at publish time and unlock in the
#: worker), and the PostgreSQL pair against its own statements sent raw (the distance
#: is celery-lease's own Python).
PAIR_TARGETS = [
    ("leased-redis-nocommit", "once", 1.0, "celery-once `QueueOnce`"),
    ("leased-redis-nocommit", "singleton", 1.0, "celery-singleton `Singleton`"),
    ("leased-pg-pg", "floor-pg-protocol", 0.95,
     "the floor row of celery-lease's own two PostgreSQL statements sent raw"),
]  # fmt: skip

_PAIR_LABELS = {
    "leased-redis-nocommit": "lock-only `LeasedTask` (Redis store, `lease_commit=False`)",
    "leased-pg-pg": "`LeasedTask`: PostgreSQL store + PostgreSQL results",
}


def _pair_targets(samples: dict[str, list[float]]) -> list[tuple[str, bool | None]]:
    """Each PAIR_TARGETS row both of whose contenders ran complete rounds: the median
    over rounds of contender ÷ baseline in the same round, and the spread of that
    ratio over the rounds (how far one round's figure can be from the next)."""
    out: list[tuple[str, bool | None]] = []
    for key, base, least, base_label in PAIR_TARGETS:
        xs, bs = samples.get(key, []), samples.get(base, [])
        if not xs or len(xs) != len(bs):
            continue
        per_round = [x / b for x, b in zip(xs, bs) if b]
        ratio = median(per_round)
        spread = f"rounds {min(per_round):.2f} to {max(per_round):.2f}"
        out.append(
            (
                f"{_PAIR_LABELS[key]} ≥ {least:.2f}\u00d7 {base_label} "
                f"({fmt_ratio(ratio)}; {spread}{_against_noise(per_round, least)})",
                ratio >= least,
            )
        )
    return out


def _pair_cpu(cpu: dict[str, list[dict[str, float]]]) -> list[str]:
    """The PAIR_TARGETS rows read by CPU per task instead of by drain rate.

    A drain's rate on a shared machine moves by a quarter from one round to the
    next; the CPU its processes spent per task moves far less, so it can tell
    apart what the rates cannot. Each round's figure is the baseline's CPU per
    task over the contender's, counting the processes that serve the drain
    (worker, PostgreSQL, Redis; not this runner or the rest of the machine):
    above 1, the contender spent less.
    """
    out = []
    for key, base, least, base_label in PAIR_TARGETS:
        xs, bs = cpu.get(key, []), cpu.get(base, [])
        if not xs or len(xs) != len(bs):
            continue
        per_round = [_served(b) / _served(x) for x, b in zip(xs, bs) if _served(x)]
        if not per_round:
            continue
        out.append(
            f"by CPU per task (worker, PostgreSQL and Redis), {_PAIR_LABELS[key]} against "
            f"{base_label}: {fmt_ratio(median(per_round))} (the baseline's CPU per task over "
            f"its own; rounds {min(per_round):.2f} to {max(per_round):.2f}"
            f"{_against_noise(per_round, least)}; a reading, not the target)"
        )
    return out


def _served(cpu: dict[str, float]) -> float:
    """CPU per task (ms) of the processes that serve a drain."""
    return sum(cpu[group] for group in CPU_GROUPS)


def _against_noise(per_round: list[float], least: float) -> str:
    """Whether the rounds tell the median from the target: its 95% interval
    (benchmarks.stats.median_interval) above, below or across ``least``."""
    interval = median_interval(per_round)
    if interval is None:
        return "; too few rounds for a 95% interval of the median"
    lo, hi = interval
    where = (
        "above the target" if lo >= least
        else "below the target" if hi < least
        else "across the target: these rounds cannot tell the median from it"
    )  # fmt: skip
    return f"; 95% interval of the median {lo:.2f} to {hi:.2f}, {where}"


def _floor_summary(pool: str, ratios: dict[str, float]) -> str:
    return (
        f"Per task ({pool}): floors (plain + a durable result, no lease): one PostgreSQL "
        f"INSERT {fmt_ratio(ratios.get('floor-pg'))}, two PostgreSQL round trips "
        f"{fmt_ratio(ratios.get('floor-pg-2rt'))}, five Redis + PostgreSQL round trips "
        f"{fmt_ratio(ratios.get('floor-redis-pg-5rt'))}, celery-lease's own two PostgreSQL "
        f"statements sent raw {fmt_ratio(ratios.get('floor-pg-protocol'))}, one SQLite "
        f"INSERT {fmt_ratio(ratios.get('floor-sqlite'))}, two committed SQLite INSERTs "
        f"{fmt_ratio(ratios.get('floor-sqlite-2tx'))} of plain"
    )
