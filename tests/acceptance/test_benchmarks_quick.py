"""The quick benchmark pass runs end to end and writes every table.

It asserts nothing about speed: only that ``python -m benchmarks --quick``
exits 0 and that BENCHMARKS.md has every benchmark's table (the full run is
``python -m benchmarks --out BENCHMARKS.md``). How long the pass took is
printed (``.ci/run``'s ``--durations`` shows it too; it is one of
``.ci/run``'s long runs, ``scripts/test --slow -m ci``); on a loaded machine it
takes longer, which is no failure of the code.

``python -m benchmarks.task_path`` (the task's own path, no worker) runs
tiny here, in the default suite: a few seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: each benchmark's heading and a header row its table must have
EXPECTED = {
    "## 1. Lease primitives": "| store | contender | pairs/s (median) |",
    "## 2. Per task through a real worker": "| pool | contender | tasks/s (median) |",
    "## 3. Round trips per task, counted": "| contender | publish side: Redis |",
    "## 4. Renewal scaling": "| leases | store | round trips per cycle |",
    "## 5. Contention: 32 processes on one key": "| store | contender | grants/s |",
    "## 6. Growth": "| configuration | live leases + results | claim p50 |",
    "## 7. Memory": "| pool | contender | process | RSS at start kB |",
    "## 8. Redis Sentinel and Cluster": "| deployment | contender | pairs/s |",
    "## 9. With a result backend": "| pool | contender | tasks/s (median) | ms per task |",
}


@pytest.mark.slow  # a benchmark pass (two minutes): .ci/run's long runs (-m ci)
@pytest.mark.ci
@pytest.mark.timeout(660)
def test_quick_benchmarks_write_every_table(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
    env["PYTHONPATH"] = str(ROOT)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    took = time.monotonic() - started
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    print(f"the quick pass took {took:.0f} s")
    text = out.read_text()
    for heading, header in EXPECTED.items():
        assert heading in text, f"missing section {heading!r}"
        section = text.split(heading, 1)[1].split("\n## ", 1)[0]
        assert header in section, f"{heading}: missing its table ({header!r})"
        rows = [
            line
            for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| ---")
        ]
        assert len(rows) >= 3, f"{heading}: the table has no rows"
        assert "This benchmark failed" not in section, section[:3000]
    for fact in ("| nproc |", "| CPU |", "| python |", "| celery |", "| Redis server |",
                 "| PostgreSQL server |", "Command: `"):  # fmt: skip
        assert fact in text, f"machine facts: missing {fact!r}"
    # the memory section sampled every process at every checkpoint
    memory = text.split("## 7. Memory", 1)[1].split("\n## ", 1)[0]
    assert "did not complete" not in memory, memory[-3000:]
    # the per-task section's CPU table attributes the drain's CPU to the worker
    per_task = text.split("## 2. Per task through a real worker", 1)[1].split("\n## ", 1)[0]
    assert "**CPU per task (ms)" in per_task, "per task: missing the CPU table"
    cpu_table = per_task.split("**CPU per task (ms)", 1)[1]
    plain = next(
        line for line in cpu_table.splitlines() if line.startswith("| solo | plain `@app.task` |")
    )
    worker_ms = float(plain.split("|")[3])
    assert worker_ms > 0, f"the plain worker's CPU per task was not measured: {plain}"


@pytest.mark.timeout(120)  # a few seconds: private servers, 2 rounds of 20 tasks
def test_task_path_prints_every_contender_and_target() -> None:
    """``python -m benchmarks.task_path``, tiny: a row per contender with its time
    measured, a ratio line per target pair, and Redis's own time per task for each
    contender that uses Redis, by command (it asserts nothing about speed)."""
    from benchmarks.task_path import ORDER, PAIRS

    env = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.task_path", "--rounds", "2", "-n", "20"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    rows = [
        line.split("|")[1:-1]
        for line in proc.stdout.splitlines()
        if line.startswith("| ") and not line.startswith(("| ---", "| contender"))
    ]
    assert len(rows) == len(ORDER), proc.stdout
    for cells in rows:
        assert float(cells[1].replace(",", "")) > 0, cells  # µs per task
        assert float(cells[3].replace(",", "")) > 0, cells  # CPU µs per task
    lines = proc.stdout.splitlines()
    ratios = [line for line in lines if line.startswith("- ") and "\u00d7 (rounds " in line]
    assert len(ratios) == len(PAIRS), proc.stdout
    # Redis's own time: the peers' unlock and the lease store's two scripts, counted
    server = {line.split(",")[0]: line for line in lines if line.startswith("- Redis for ")}
    assert set(server) == {
        "- Redis for once",
        "- Redis for singleton",
        "- Redis for leased-redis-nocommit",
    }, proc.stdout
    assert "DEL 1.00 \u00d7 " in server["- Redis for once"], proc.stdout
    assert "EVALSHA 1.00 \u00d7 " in server["- Redis for leased-redis-nocommit"], proc.stdout
