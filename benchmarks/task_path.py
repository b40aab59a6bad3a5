"""``python -m benchmarks.task_path [--rounds R] [-n N]``: the task's own path, no worker.

Section 2 drains queues through real workers, where the broker loop, the pool
and the message handling are most of a task's time and the machine's noise
is large. This takes them away: each contender's task (the same
``bench.noop`` of ``benchmarks/benchapp.py``, built in this process) is run
with ``Task.apply()``, N times a round, rounds interleaved, on private Redis
and PostgreSQL servers. What is left per task is Celery's tracer, the
contender's own code and its round trips, with no profiler's overhead: it
says how much of a lock-only or fenced task's distance to its baseline in
section 2 is celery-lease's own Python, and how much is waiting on servers.

``apply()`` is used for speed only here, never as evidence of behaviour:
the peers lock in ``apply_async``, so under ``apply()`` they do what they do
in a worker's drain (their unlock, one ``DEL``); ``LeasedTask`` claims,
runs and releases (or commits) as in a worker. The in-memory store
(``memory://``) row is the lock-only task with no I/O at all: celery-lease's
Python, the store's bookkeeping included.

Prints a Markdown table: the median µs per task (wall) and the CPU µs per
task of this process (``time.process_time``, which excludes the servers), the
µs above plain; then, per target pair of section 2 (by contender key), the
baseline's time over the contender's in each round, the median over rounds:
a throughput ratio, as in section 2. Last, Redis's own time per task: one
more pass of N tasks per contender that talks to Redis, between ``CONFIG
RESETSTAT`` and ``INFO commandstats`` on the private server (the peers' locks
and the lease store share it; ``apply()`` uses no broker), each command's
calls per task and the server's µs per call. A script's µs include the
commands it calls, which are listed after it. A run of the defaults takes
about a minute.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import redis

from benchmarks import benchapp
from benchmarks.env import log, start_env
from benchmarks.report import Table
from benchmarks.stats import fmt_ratio, interleave, median
from benchmarks.workers import FLOORS, KINDS, Kind, Targets

#: The contenders, in the order of the table.
ORDER = [
    "plain", "once", "singleton", "leased-memory-nocommit", "leased-redis-nocommit",
    "floor-pg-protocol", "leased-pg-pg",
]  # fmt: skip

#: (contender, baseline) pairs whose ratio the table gives: section 2's targets.
PAIRS = [
    ("leased-redis-nocommit", "once"),
    ("leased-redis-nocommit", "singleton"),
    ("leased-pg-pg", "floor-pg-protocol"),
    ("leased-memory-nocommit", "plain"),
]

MEMORY = Kind(
    "leased-memory-nocommit",
    "`LeasedTask`: in-memory store, `lease_commit=False` (no I/O)",
    "leased",
    "redis",
    "pg",
    commit=False,
)


def _variables(targets: Targets, kind: Kind, times: Path) -> dict[str, str]:
    v = targets.variables(kind, "task-path", times)
    if kind is MEMORY:  # the Redis lock-only task's variables, the store in memory
        v["BENCH_STORE"] = "memory://bench-task-path"
    return v


def _runner(targets: Targets, kind: Kind, times: Path) -> Callable[[int], None]:
    _app, task = benchapp.build(_variables(targets, kind, times), backend=False)

    def run(i: int) -> None:
        result = task.apply(args=(i,))
        if result.state != "SUCCESS":
            raise AssertionError(f"{kind.key}: bench.noop({i}) ended {result.state}")

    return run


def build_runners(targets: Targets, kinds: list[Kind]) -> dict[str, Callable[[int], None]]:
    """Each contender's task, built in this process: a call runs it once with apply()."""
    times = targets.env.tmpdir / "task-path-times"
    times.mkdir(exist_ok=True)
    return {k.key: _runner(targets, k, times) for k in kinds}


def measure(
    runners: dict[str, Callable[[int], None]], counter: Iterator[int], n: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per task (wall, and this process's CPU) per round, per contender."""
    for run in runners.values():  # connections, prepared statements, first-use imports
        for _ in range(max(50, n // 10)):
            run(next(counter))
    cpu: dict[str, list[float]] = {k: [] for k in runners}

    def one_round(key: str, r: int) -> float:
        run = runners[key]
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            run(next(counter))
        wall = (time.perf_counter() - t0) / n
        cpu[key].append((time.process_time() - c0) / n)
        log(f"task path: round {r + 1}: {key}: {wall * 1e6:,.0f} µs per task")
        return wall

    return interleave(list(runners), rounds, one_round), cpu


def server_time(
    runners: dict[str, Callable[[int], None]], counter: Iterator[int], n: int, url: str
) -> str:
    """Redis's own µs per task, by command, per contender that sends Redis commands."""
    client = redis.Redis.from_url(url)
    lines = []
    try:
        for key, run in runners.items():
            client.config_resetstat()
            for _ in range(n):
                run(next(counter))
            stats = client.info("commandstats")
            used = sorted(
                (
                    (v["usec"], name.removeprefix("cmdstat_").upper(), v)
                    for name, v in stats.items()
                    if name not in ("cmdstat_config|resetstat", "cmdstat_config", "cmdstat_info")
                ),
                reverse=True,
            )
            if not used:
                continue
            parts = [
                f"{name} {v['calls'] / n:.2f} \u00d7 {v['usec_per_call']:.2f} µs"
                for _, name, v in used
            ]
            lines.append(f"- Redis for {key}, per task: " + ", ".join(parts))
    finally:
        client.close()
    return "\n".join(lines)


def table(wall: dict[str, list[float]], cpu: dict[str, list[float]], labels: dict[str, str]) -> str:
    plain_wall, plain_cpu = median(wall["plain"]), median(cpu["plain"])
    t = Table(["contender", "µs per task", "above plain", "CPU µs per task", "CPU above plain"])
    for key in wall:
        w, c = median(wall[key]), median(cpu[key])
        t.add(
            labels[key],
            f"{w * 1e6:,.0f}",
            "" if key == "plain" else f"{(w - plain_wall) * 1e6:+,.0f}",
            f"{c * 1e6:,.0f}",
            "" if key == "plain" else f"{(c - plain_cpu) * 1e6:+,.0f}",
        )
    lines = [t.markdown(), ""]
    for key, base in PAIRS:
        if key not in wall or base not in wall:
            continue
        ratios = [b / x for x, b in zip(wall[key], wall[base]) if x]
        lines.append(
            f"- {key} ÷ {base}: {fmt_ratio(median(ratios))} "
            f"(rounds {min(ratios):.2f} to {max(ratios):.2f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.task_path", description=__doc__)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("-n", type=int, default=2000, help="tasks per contender per round")
    args = p.parse_args(argv)
    tmpdir = Path(tempfile.mkdtemp(prefix="bench-task-path-"))
    env = start_env(tmpdir, quick=False, redis_url=None, pg_url=None)
    targets = Targets.make(env, "taskpath")
    try:
        known = {k.key: k for k in (*KINDS, *FLOORS, MEMORY)}
        kinds = [known[key] for key in ORDER]
        absent = {k.key: why for k in kinds if (why := targets.available(k))}
        if absent:
            log(f"task path: left out: {absent}")
        kinds = [k for k in kinds if k.key not in absent]
        contenders = build_runners(targets, kinds)
        counter = iter(range(10**9))  # a distinct lease key per task, over every pass
        wall, cpu = measure(contenders, counter, args.n, args.rounds)
        print(table(wall, cpu, {k.key: k.label for k in kinds}))
        print()
        print(server_time(contenders, counter, args.n, env.store_url(targets.db)))
    finally:
        targets.close()
        env.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
