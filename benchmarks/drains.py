"""What a section's worker drains measured, kept per pool and contender, and the
CPU table they make (sections 2 and 9)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from benchmarks.env import log
from benchmarks.report import Table
from benchmarks.stats import fmt_rate, median
from benchmarks.workers import Kind, RunResult


@dataclass
class Tally:
    """What one section's drains measured, by pool and contender: the enqueue rates,
    the CPU per task (with how many cores were busy), and the runs left out."""

    section: str
    n: int
    enqueue: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    cpu: dict[str, dict[str, list[dict[str, float]]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def record(self, pool: str, key: str, r: int, res: RunResult) -> float | None:
        """Keep one drain's figures; returns its rate, or None if it did not complete."""
        self.enqueue.setdefault(pool, {}).setdefault(key, []).append(res.enqueue_rate)
        cpu = self.cpu.setdefault(pool, {}).setdefault(key, [])
        log(
            f"{self.section}: {pool} round {r + 1}: {key}: {fmt_rate(res.rate)} tasks/s "
            f"({res.completed}/{self.n})"
        )
        if res.error or res.completed != self.n:
            self.errors.append(f"{pool} / {key}: {res.completed}/{self.n} done; {res.error or ''}")
            return None
        if res.cpu is not None:
            cpu.append({**res.cpu, "cores": res.cpu["machine"] * res.rate / 1000})
        return res.rate

    def left_out(self) -> str | None:
        if not self.errors:
            return None
        return "Runs that did not complete (left out of the medians):\n\n" + "\n".join(
            f"- {e}" for e in self.errors
        )


CPU_GROUPS = ["worker", "PostgreSQL", "Redis"]


def cpu_table(cpu: dict[str, dict[str, list[dict[str, float]]]], kinds: dict[str, Kind]) -> str:
    """CPU per task by process group (medians over rounds), and how busy the machine was."""
    table = Table(
        ["pool", "contender", "worker", "of which main process", "PostgreSQL",
         "Redis (broker, store)", "other", "all processes", "cores busy", "iowait"],
        align="llrrrrrrrr",
    )  # fmt: skip
    for pool, by_key in cpu.items():
        for key, rounds in by_key.items():
            if not rounds:
                continue

            def med(name: str, rounds: list[dict[str, float]] = rounds) -> float:
                return median([r[name] for r in rounds])

            other = median([r["machine"] - sum(r[g] for g in CPU_GROUPS) for r in rounds])
            table.add(
                pool, kinds[key].label, f"{med('worker'):.2f}", f"{med('worker main'):.2f}",
                *(f"{med(g):.2f}" for g in CPU_GROUPS[1:]), f"{other:.2f}",
                f"{med('machine'):.2f}", f"{med('cores'):.2f} of {os.cpu_count()}",
                f"{med('iowait'):.2f}",
            )  # fmt: skip
    return (
        "**CPU per task (ms), by process, from the first to the last completion** "
        "(`/proc` sampled every 0.1 s, interpolated at the two completions; median over "
        "rounds). *worker*: the `celery worker` process and its pool processes, "
        "celery-lease's and the driver libraries' Python included (*of which main "
        "process*: the worker's own process, which consumes, dispatches to the pool and "
        "acknowledges; with `-P solo` it also runs the tasks); *PostgreSQL*: the "
        "private cluster's processes (the statements' server work); *Redis*: the private "
        "broker and store servers; *other*: the rest of the machine (this runner, system); "
        "*cores busy*: all processes' CPU over the wall time. Where *cores busy* is at the "
        "machine's core count the drain is CPU-bound and its rate is the cores divided by "
        "*all processes*; below it, the worker also waits (locks, disk).\n\n" + table.markdown()
    )
