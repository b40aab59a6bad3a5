"""2. Per task through a real worker: drain rate of pre-enqueued no-op tasks."""

from __future__ import annotations

import pstats

from benchmarks.common import (
    Env,
    Section,
    Table,
    by_package,
    cumulative,
    fmt_rate,
    fmt_ratio,
    interleave,
    log,
    median,
    paired_ratios,
    profile_compare,
    target_line,
    top_functions,
)
from benchmarks.workers import KINDS, Kind, Targets, WorkerRun, drain

NAME = "per_task"
TITLE = "2. Per task through a real worker: drain rate"
POOLS = ["solo", "prefork"]


def run(env: Env) -> Section:
    n = 150 if env.quick else 2000
    rounds = 1 if env.quick else 3
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
    kinds = {k.key: k for k in KINDS}
    skipped: dict[str, str] = {}
    for k in KINDS:
        why = targets.available(k)
        if why:
            skipped[k.key] = why
    runnable = [k for k in kinds if k not in skipped]
    #: the quick pass runs prefork for plain and one LeasedTask configuration only
    quick_prefork = ["plain", "leased-redis-pg"]
    results: dict[str, dict[str, list[float]]] = {}
    enqueue: dict[str, dict[str, list[float]]] = {}
    errors: list[str] = []
    try:
        for pool in POOLS:
            these = [k for k in runnable if not (env.quick and pool == "prefork")
                     or k in quick_prefork]  # fmt: skip
            enqueue[pool] = {k: [] for k in these}

            def measure(key: str, r: int, pool: str = pool) -> float | None:
                res = drain(targets, kinds[key], pool, n)
                enqueue[pool][key].append(res.enqueue_rate)
                log(
                    f"{NAME}: {pool} round {r + 1}: {key}: {fmt_rate(res.rate)} tasks/s "
                    f"({res.completed}/{n})"
                )
                if res.error or res.completed != n:
                    errors.append(f"{pool} / {key}: {res.completed}/{n} done; {res.error or ''}")
                    return None
                return res.rate

            results[pool] = interleave(these, rounds, measure)

        table = Table(
            ["pool", "contender", "tasks/s (median)", "ms per task", "ratio to plain",
             "enqueue tasks/s", "target"],
            align="llrrrrl",
        )  # fmt: skip
        verdicts: list[str] = []
        misses: list[Kind] = []
        for pool in POOLS:
            samples = results[pool]
            ratios = paired_ratios(samples, "plain")
            peers = [k for k in samples if kinds[k].peer]
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
                elif k.kind == "leased":
                    section.summary.append(
                        f"Per task ({pool}): {k.label}: {fmt_ratio(ratios[key])} of plain"
                    )
                table.add(
                    pool,
                    k.label + (" (baseline)" if key == "plain" else ""),
                    fmt_rate(rate),
                    f"{1000 / rate:.2f}" if rate == rate and rate else "n/a",
                    "1.00\u00d7" if key == "plain" else fmt_ratio(ratios[key]),
                    fmt_rate(median(enqueue[pool][key])),
                    tgt,
                )
            for key, why in skipped.items():
                table.add(pool, kinds[key].label, "skipped", "", "", "", f"could not run: {why}")
            for key in runnable:
                if key not in samples:
                    table.add(pool, kinds[key].label, "not run", "", "", "", "quick pass")
        section.add(table.markdown())
        section.add("\n".join(f"- {v}" for v in verdicts))
        if errors:
            section.add(
                "Runs that did not complete (left out of the medians):\n\n"
                + "\n".join(f"- {e}" for e in errors)
            )
        if misses and not env.quick:
            section.add(_profile(targets, misses, n=min(n, 1000)))
        elif misses:
            section.add("_Profiles of the misses are taken in the full run only._")
    finally:
        targets.close()
    return section


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
            (what, cumulative(stats, per, "celery_lease/task.py", func))
            for what, func in (
                ("claim", "claim"),
                ("prepare", "prepare"),
                ("commit", "commit"),
                ("release", "release"),
            )
        ]
        parts += [
            "",
            f"Where the time goes, {k.label}: {more * 1e6:,.0f} µs per task more than plain "
            f"under cProfile: {', '.join(shown)}. Of the task path, "
            + ", ".join(f"{what} {t * 1e6:,.0f} µs" for what, t in steps)
            + " (cumulative, `celery_lease/task.py`).",
            "",
            f"{k.label}: heaviest celery-lease functions:",
            "",
            top_functions(stats, per, "celery_lease"),
        ]
    return "\n".join(parts)
