"""9. With a result backend: the drain rate when every task's state is stored.

What a user who stores results compares (issue 22): a plain task with Celery's
own backend against ``LeasedTask`` with the backend it would run with, in the
same run, interleaved like section 2, each ratio against its own baseline.
"""

from __future__ import annotations

from functools import partial

from benchmarks.drains import Tally, cpu_table
from benchmarks.env import Env
from benchmarks.per_task import POOLS
from benchmarks.report import Section, Table, target_line
from benchmarks.stats import fmt_rate, fmt_ratio, interleave, median, paired_ratios
from benchmarks.workers import Kind, RunResult, Targets, drain

NAME = "backends"
TITLE = "9. With a result backend: drain rate when every task's state is stored"

KINDS = [
    Kind("plain-db", "plain `@app.task` + Celery's database backend "
         "`db+postgresql+psycopg://` (baseline A)", "plain", backend="db"),
    Kind("leased-pg-lease", "`LeasedTask`: PostgreSQL store + PostgreSQL results, backend "
         "`lease+postgresql+psycopg://` the same database", "leased", "pg", backend="lease",
         ours=True),
    Kind("plain-redis", "plain `@app.task` + Celery's Redis backend (baseline B)", "plain",
         backend="redis"),
    Kind("leased-redis-redis", "`LeasedTask`: Redis store + PostgreSQL results, Celery's "
         "Redis backend", "leased", "redis", "pg", backend="redis", ours=True),
]  # fmt: skip

#: each LeasedTask configuration: its baseline (the plain task with its kind of
#: backend), the baseline's letter, the target ratio
PAIRS = {
    "leased-pg-lease": ("plain-db", "A", 0.9),
    "leased-redis-redis": ("plain-redis", "B", 0.8),
}
_BY_KEY = {k.key: k for k in KINDS}
_MARK = {True: "met", False: "**missed**", None: "n/a"}


def run(env: Env) -> Section:
    n = 150 if env.quick else 2000
    rounds = env.rounds or (1 if env.quick else 3)
    section = Section(NAME, TITLE, intro=_intro(n, rounds))
    if not env.has_pg:
        section.add("_Not run: the baselines and both `LeasedTask` rows need PostgreSQL._")
        return section
    targets = Targets.make(env, "backends")
    tally = Tally(NAME, n)
    try:
        results = {
            pool: interleave(list(_BY_KEY), rounds, partial(_measure, targets, tally, pool))
            for pool in POOLS
        }
    finally:
        targets.close()
    table, verdicts = _report(results, tally, section)
    section.add(table)
    section.add("\n".join(f"- {v}" for v in verdicts))
    section.add(cpu_table(tally.cpu, _BY_KEY))
    left_out = tally.left_out()
    if left_out:
        section.add(left_out)
    return section


def _measure(targets: Targets, tally: Tally, pool: str, key: str, r: int) -> float | None:
    kind = _BY_KEY[key]
    res = drain(targets, kind, pool, tally.n)
    rate = tally.record(pool, key, r, res)
    if rate is not None:  # a complete drain: its tasks' states must be in the backend
        _check_stored(pool, kind, res)
    return rate


def _check_stored(pool: str, kind: Kind, res: RunResult) -> None:
    """Fail the section unless the first and the last task read SUCCESS from the backend."""
    states = res.stored or {}
    if len(states) < 2 or any(s != "SUCCESS" for s in states.values()):
        raise RuntimeError(
            f"{pool} / {kind.key}: the {kind.backend} result backend did not store the "
            f"tasks' states: the first and the last task read {states or 'nothing'} "
            "(expected SUCCESS for both)"
        )


def _report(
    results: dict[str, dict[str, list[float]]], tally: Tally, section: Section
) -> tuple[str, list[str]]:
    """The drain-rate table, and one target line per `LeasedTask` row (also summarized)."""
    table = Table(
        ["pool", "contender", "tasks/s (median)", "ms per task", "ratio to its baseline",
         "enqueue tasks/s", "target"],
        align="llrrrrl",
    )  # fmt: skip
    verdicts: list[str] = []
    for pool, samples in results.items():
        for key, xs in samples.items():
            k, rate = _BY_KEY[key], median(xs)
            ratio, cell = 1.0, ""
            if key in PAIRS:
                base, letter, goal = PAIRS[key]
                ratio = paired_ratios(samples, base)[key]
                met = None if ratio != ratio else ratio >= goal
                cell = f"≥ {goal}\u00d7 {letter}: " + _MARK[met]
                verdicts.append(
                    target_line(
                        met,
                        f"{pool}, {k.label} ≥ {goal}\u00d7 baseline {letter} ({fmt_ratio(ratio)})",
                    )
                )
                section.summary.append(
                    f"With a result backend ({pool}): {k.label}: {fmt_ratio(ratio)} of "
                    f"baseline {letter}, a plain task with the same kind of backend ({cell})"
                )
            table.add(
                pool,
                k.label,
                fmt_rate(rate),
                f"{1000 / rate:.2f}" if rate == rate and rate else "n/a",
                fmt_ratio(ratio),
                fmt_rate(median(tally.enqueue[pool][key])),
                cell,
            )
    return table.markdown(), verdicts


def _intro(n: int, rounds: int) -> str:
    return (
        f"{n:,} no-op tasks are enqueued on the Redis broker, then a `celery worker` drains "
        "them, as in section 2 (`-P solo`, or `-P prefork -c 2`; `-l WARNING`, no "
        "mingle/gossip/heartbeat; `task_acks_late`, prefetch multiplier 4; distinct "
        "arguments, so a distinct lease key per task; the rate is (N - 1) ÷ (last - first "
        "completion), from `task_postrun` timestamps, which come after the backend's "
        "write), except that every task's state is stored: the workers run with a result "
        "backend and `task_ignore_result` off. The publishing app has no backend, so "
        "Celery's Redis backend does not subscribe the publisher to each task's result "
        "channel, as it does at every `apply_async` otherwise. Two pairs, each a plain task "
        "against `LeasedTask` with the same kind of backend. *A*: Celery's database "
        "backend (SQLAlchemy) on a database of its own on the benchmark's PostgreSQL, "
        "against `LeasedTask` with leases and results in one PostgreSQL database and "
        "`result_backend = lease+` that database, `lease_result_url` unset (it defaults to "
        "the backend's database: the accepted row, the SUCCESS record and the release in "
        "one commit). Celery's database backend builds its SQLAlchemy engine with "
        "`NullPool` in a process that has not forked (`SessionManager.get_engine`, "
        "`celery/backends/database/session.py`): in the solo worker every state write "
        "opens a PostgreSQL connection of its own; prefork's pool processes keep one "
        "pooled engine each. *B*: Celery's Redis backend on the lease store's Redis, against "
        "`LeasedTask` with Redis leases, PostgreSQL results (`lease_result_url`) and the "
        "same Redis backend (the accepted row is committed in PostgreSQL, then Celery "
        "writes SUCCESS to Redis). Results are JSON, Celery's default serializer (the "
        "lease backend refuses any other). After each drain the first and the last task's "
        "state is read back from its backend; the section fails unless both read SUCCESS. "
        f"Contenders interleave within each pool, {rounds} round(s), rotating order; "
        "*ratio* is the median over rounds of `LeasedTask` ÷ its baseline in the same round."
    )
