"""7. Memory in a long-running worker: each pool child's RSS over a long drain.

``BENCH_MEMORY_ONLY="prefork:plain,solo:plain"`` runs only those soaks (pool:contender),
for a machine that cannot give the whole section its hours in one go;
``BENCH_MEMORY_LONG=1`` (or 2) adds the checkpoint at 400,000 (and 800,000) tasks.
``BENCH_SQLITE_CACHE_KIB=64`` bounds every SQLite connection's page cache in the
workers (``PRAGMA cache_size=-64``): the check that the SQLite row's growth is
that cache filling up, not celery-lease.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from benchmarks.env import Env, log
from benchmarks.report import Section, Table
from benchmarks.stats import median
from benchmarks.workers import KINDS, Kind, Targets, WorkerRun

NAME = "memory"
TITLE = "7. Memory: each pool child's RSS over a long run"
#: the contenders: plain, LeasedTask on each store pair, and the lock-only task
CONTENDERS = ["plain", "leased-redis-pg", "leased-pg-pg", "leased-sqlite", "leased-redis-nocommit"]
#: solo runs for plain and the main configuration only (one process: its RSS is the worker's)
SOLO = ["plain", "leased-redis-pg"]
#: the broker never holds more than this many tasks: a 200k-task backlog would itself
#: grow Redis by hundreds of MB and slow the drain
BATCH = 5_000


@dataclass
class Sample:
    done: int
    rss_kb: dict[int, int]  # pid -> VmRSS
    uss_kb: dict[int, int]  # pid -> private (Private_Clean + Private_Dirty)


@dataclass
class Soak:
    kind: str
    pool: str
    main_pid: int = 0
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None

    def processes(self) -> list[int]:
        """The pids that ran tasks: the pool children (prefork) or the worker (solo)."""
        if self.pool == "solo":
            return [self.main_pid]
        first = set(self.samples[0].rss_kb) if self.samples else set()
        return sorted(p for p in first if p != self.main_pid)


def _status_kb(pid: int, field_name: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise LookupError(field_name)


def _private_kb(pid: int) -> int:
    """Pages only this process maps: a forked child's own cost, beside the shared RSS."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
    return total


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _sample(main_pid: int, done: int) -> Sample:
    pids = [main_pid, *_children(main_pid)]
    return Sample(
        done,
        {p: _status_kb(p, "VmRSS") for p in pids},
        {p: _private_kb(p) for p in pids},
    )


def soak(targets: Targets, kind: Kind, pool: str, checkpoints: list[int]) -> Soak:
    """Drain ``checkpoints[-1]`` tasks through one worker, sampling RSS at each checkpoint."""
    passed = {k: os.environ[k] for k in ("BENCH_SQLITE_CACHE_KIB",) if os.environ.get(k)}
    run = WorkerRun(targets, kind, pool, extra_env=passed)
    out = Soak(kind.key, pool)
    total = checkpoints[-1]
    enqueued = 0
    try:
        enqueued += BATCH
        run.enqueue(min(BATCH, total))
        run.start()
        assert run.proc is not None
        out.main_pid = run.proc.pid
        pending = list(checkpoints)
        deadline = time.monotonic() + max(120.0, total / 50)
        while pending:
            done = run.completed()
            if enqueued < total and done >= enqueued - BATCH // 2:
                n = min(BATCH, total - enqueued)
                run.enqueue(n)
                enqueued += n
            if done >= pending[0]:
                out.samples.append(_sample(out.main_pid, done))
                log(f"{NAME}: {kind.key}/{pool}: {done:,} done, RSS {out.samples[-1].rss_kb}")
                pending.pop(0)
                continue
            if run.proc.poll() is not None:
                out.error = f"worker exited with {run.proc.returncode}: {run.log_tail()}"
                break
            if time.monotonic() > deadline:
                out.error = f"timed out with {done:,}/{total:,} done"
                break
            time.sleep(0.2)  # a poll of the completion count, not a synchronisation
    finally:
        run.cleanup()
    return out


def slope_per_1000(points: list[tuple[int, int]]) -> float:
    """Least-squares kB per 1,000 tasks through (tasks done, kB)."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return 1000 * sxy / sxx if sxx else float("nan")


def growth(s: Soak, pid: int, which: str = "rss") -> float:
    """kB per 1,000 tasks of one process from the second checkpoint on (the first is
    the start footprint: connections open, caches warm)."""
    pts = [(x.done, (x.rss_kb if which == "rss" else x.uss_kb)[pid]) for x in s.samples[1:]]
    return slope_per_1000(pts)


def _fmt_kb(kb: float) -> str:
    return f"{kb:,.0f}"


def _fmt_slope(x: float) -> str:
    return "n/a" if x != x else f"{x:+.2f}"


def run(env: Env) -> Section:
    checkpoints = [500, 2_000, 4_000] if env.quick else [1_000, 10_000, 50_000, 100_000, 200_000]
    if os.environ.get("BENCH_MEMORY_LONG"):  # a longer soak: 400k and 800k too
        checkpoints += [400_000, 800_000][: int(os.environ["BENCH_MEMORY_LONG"])]
    contenders = ["plain", "leased-redis-pg"] if env.quick else CONTENDERS
    solo = [] if env.quick else SOLO
    kinds = {k.key: k for k in KINDS}
    targets = Targets.make(env, "memory")
    section = Section(
        NAME,
        TITLE,
        intro=(
            f"One `celery worker` per contender drains {checkpoints[-1]:,} no-op tasks "
            "(distinct keys) from a Redis broker, fed in batches of "
            f"{BATCH:,}, the same settings as the per-task benchmark; `-P prefork -c 2` for "
            f"every contender, `-P solo` for {', '.join(SOLO)}. At "
            f"{', '.join(f'{c:,}' for c in checkpoints)} completed tasks the driver reads "
            "`VmRSS` and the private pages (`Private_Clean + Private_Dirty` of "
            "`/proc/<pid>/smaps_rollup`: what a forked child does not share with its "
            f"parent) of the main process and each pool child. *At start* is the first "
            f"checkpoint ({checkpoints[0]:,} tasks: connections open, caches warm). "
            "*Growth* is the least-squares slope in kB per 1,000 tasks from the second "
            "checkpoint on, per process; its *spread* is the range over the pool's "
            "children. A contender is within plain's spread when its growth is at most "
            "plain's largest child growth plus 1 kB per 1,000 tasks (a 4 kB page per "
            "4,000 tasks: the resolution of RSS)."
        ),
    )
    soaks: dict[tuple[str, str], Soak] = {}
    only = {tuple(x.split(":", 1)) for x in os.environ.get("BENCH_MEMORY_ONLY", "").split(",") if x}
    for pool, keys in (("prefork", contenders), ("solo", solo)):
        for key in keys:
            if only and (pool, key) not in only:
                continue
            why = targets.available(kinds[key])
            if why:
                log(f"{NAME}: {key} skipped: {why}")
                continue
            soaks[key, pool] = soak(targets, kinds[key], pool, checkpoints)
    targets.close()

    table = Table(
        ["pool", "contender", "process", "RSS at start kB", "private at start kB",
         f"RSS at {checkpoints[-1]:,} kB", "RSS growth kB / 1k tasks", "private growth"],
        align="lllrrrrr",
    )  # fmt: skip
    growth_by: dict[tuple[str, str], list[float]] = {}
    start_by: dict[tuple[str, str], list[int]] = {}
    errors: list[str] = []
    for (key, pool), s in soaks.items():
        if s.error or len(s.samples) < len(checkpoints):
            errors.append(f"{pool} / {key}: {s.error or 'incomplete'}")
            continue
        label = kinds[key].label
        rows = [("main", s.main_pid)] if pool == "prefork" else []
        rows += [(f"child {i + 1}" if pool == "prefork" else "worker", p)
                 for i, p in enumerate(s.processes())]  # fmt: skip
        for name, pid in rows:
            first, last = s.samples[0], s.samples[-1]
            if pid not in last.rss_kb:
                errors.append(f"{pool} / {key}: {name} (pid {pid}) was replaced mid-run")
                continue
            g = growth(s, pid)
            if name != "main":
                growth_by.setdefault((key, pool), []).append(g)
                start_by.setdefault((key, pool), []).append(first.rss_kb[pid])
            table.add(
                pool, label, name, _fmt_kb(first.rss_kb[pid]), _fmt_kb(first.uss_kb[pid]),
                _fmt_kb(last.rss_kb[pid]), _fmt_slope(g), _fmt_slope(growth(s, pid, "uss")),
            )  # fmt: skip
    section.add(table.markdown())
    lines: list[str] = []
    for pool in ("prefork", "solo"):
        base = growth_by.get(("plain", pool))
        base_start = start_by.get(("plain", pool))
        if not base or not base_start:
            continue
        limit = max(base) + 1.0
        for (key, p), gs in growth_by.items():
            if p != pool or key == "plain":
                continue
            within = max(gs) <= limit
            lines.append(
                f"{pool}, {kinds[key].label}: growth {', '.join(_fmt_slope(g) for g in gs)} "
                f"kB per 1,000 tasks against plain's {', '.join(_fmt_slope(g) for g in base)}: "
                + ("within plain's spread" if within else "**beyond plain's spread**")
                + f"; start {_fmt_kb(median(start_by[key, p]))} kB, "
                f"{median(start_by[key, p]) - median(base_start):+,.0f} kB against plain"
            )
            section.summary.append(
                f"Memory ({pool}): {kinds[key].label}: "
                + ("within plain's growth spread" if within else "beyond plain's growth spread")
                + f", {median(start_by[key, p]) - median(base_start):+,.0f} kB per child at start"
            )
    if lines:
        section.add("\n".join(f"- {line}" for line in lines))
    if errors:
        section.add("**Runs that did not complete:**\n\n" + "\n".join(f"- {e}" for e in errors))
    return section
