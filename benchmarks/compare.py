"""Two code versions side by side: ``python -m benchmarks.compare A1.md B1.md A2.md B2.md``.

Each argument is a report written by ``python -m benchmarks --out`` (the
benchmark runner of one checkout, run against its own installed package),
given in the order the runs were made: the first two name the versions
(``A`` and ``B``), then they alternate (A, B, A, B ...), so that drift of a
shared, noisy machine falls on both alike. For every celery-lease row of the
primitives and per-task tables it prints the ratio to that run's baseline
(raw driver, plain task: measured in the same run, so the machine's speed at
that moment cancels), per run, the mean of each version, the spread between
runs of one version, and whether B is lower than A by more than that spread.
The table is Markdown, for BENCHMARKS.md::

    python -m benchmarks.compare old-1.md new-1.md old-2.md new-2.md --names old,new
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

#: (section heading prefix, the column holding the ratio) of the tables compared
TABLES = {
    "## 1. Lease primitives": "ratio to baseline",
    "## 2. Per task through a real worker": "ratio to plain",
}
TIMES = "\u00d7"  # the reports' multiplication sign
RATIO = re.compile(r"([0-9.]+)" + TIMES)


def rows(report: str) -> dict[str, float]:
    """``{"section | group | contender": ratio}`` for celery-lease's rows."""
    out: dict[str, float] = {}
    for heading, column in TABLES.items():
        if heading not in report:
            continue
        section = report.split(heading, 1)[1].split("\n## ", 1)[0]
        lines = [ln for ln in section.splitlines() if ln.startswith("| ")]
        if not lines:
            continue
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        at = header.index(column)
        for ln in lines[2:]:
            cells = [c.strip() for c in ln.strip("|").split("|")]
            contender = cells[1]
            if "celery-lease" not in contender and "LeasedTask" not in contender:
                continue
            m = RATIO.search(cells[at])
            if m:
                out[f"{heading[3:].split(':')[0]} | {cells[0]} | {contender}"] = float(m.group(1))
    return out


def compare(paths: list[Path], names: tuple[str, str]) -> str:
    runs = [(names[i % 2], rows(p.read_text())) for i, p in enumerate(paths)]
    by: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for name, found in runs:
        for row, ratio in found.items():
            by[row][name].append(ratio)
    a, b = names
    head = ["benchmark", "group", "contender", *(f"{n} run {i // 2 + 1}" for i, (n, _) in
            enumerate(runs)), f"{a} mean", f"{b} mean", "spread (max within a version)",
            f"{b} ÷ {a}", "verdict"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in sorted(by, key=lambda r: list(by).index(r)):
        per = by[row]
        if not per.get(a) or not per.get(b):
            continue
        mean = {n: sum(v) / len(v) for n, v in per.items()}
        spread = max(max(v) - min(v) for v in per.values())
        drop = mean[a] - mean[b]
        verdict = "lower beyond the spread" if drop > spread else "within the spread"
        if drop < -spread:
            verdict = "higher beyond the spread"
        each = [f"{found.get(row, float('nan')):.2f}{TIMES}" for _, found in runs]
        means = [f"{mean[a]:.2f}{TIMES}", f"{mean[b]:.2f}{TIMES}"]
        tail = [f"{spread:.2f}", f"{mean[b] / mean[a]:.2f}", verdict]
        cells = [*row.split(" | "), *each, *means, *tail]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__)
    p.add_argument("reports", nargs="+", type=Path, help="reports in run order: A, B, A, B ...")
    p.add_argument("--names", default="A,B", help="the two versions' names (default A,B)")
    a = p.parse_args(argv)
    names = tuple(a.names.split(",", 1))
    if len(names) != 2 or len(a.reports) < 4:
        p.error("two names, and at least four reports (A, B, A, B)")
    print(compare(a.reports, (names[0], names[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
