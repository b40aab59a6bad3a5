"""Benchmark tooling, checked without running a benchmark.

The profile names the task path's steps by module and function
(benchmarks/per_task.py, EXECUTOR): a refactor that moves them must move the
name too, or the report says "not run" for steps that ran. A head-to-head's
bad arguments fail before any server starts. The interval a head-to-head
verdict is read against covers the median as often as it says."""

from __future__ import annotations

import inspect
import itertools
import random
from pathlib import Path

import pytest

from benchmarks.per_task import EXECUTOR, _against_noise
from benchmarks.stats import median_interval
from celery_lease.execution import Execution


def test_the_profiled_steps_are_execution_methods_in_the_named_module() -> None:
    source = Path(inspect.getfile(Execution)).as_posix()
    assert source.endswith(EXECUTOR), (source, EXECUTOR)
    for step in ("claim", "prepare", "commit", "release"):
        method = getattr(Execution, step)
        assert Path(inspect.getfile(method)).as_posix().endswith(EXECUTOR), step


def test_a_head_to_head_with_an_unknown_contender_fails_before_any_server_starts() -> None:
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as bad_name:
        main(["--contenders", "once,nope"])
    with pytest.raises(SystemExit) as bad_rounds:
        main(["--rounds", "0"])
    assert bad_name.value.code == 2 and bad_rounds.value.code == 2


@pytest.mark.parametrize("n", range(1, 16))
def test_the_median_interval_covers_at_least_95_percent_whatever_the_noise(n: int) -> None:
    # Exact: with the true median at 0, each round lands above it or below it
    # with probability 1/2 whatever the noise's shape, so enumerating every sign
    # pattern gives the interval's coverage (values 1..n in magnitude).
    if median_interval([float(i) for i in range(n)]) is None:
        assert n <= 5  # below six rounds no pair of order statistics reaches 95%
        return

    def coverage(k: int) -> float:  # of [x(k), x(n+1-k)], by every sign pattern
        covered = 0
        for signs in itertools.product((-1, 1), repeat=n):
            s = sorted(sign * (i + 1) for i, sign in enumerate(signs))
            covered += s[k - 1] <= 0 <= s[n - k]
        return covered / 2**n

    values = [float(i) for i in range(n)]
    lo, _hi = median_interval(values)  # type: ignore[misc]
    k = values.index(lo) + 1
    assert coverage(k) >= 0.95
    # and no wider than it must be: one order statistic further in falls below 95%
    assert k + 1 > n // 2 or coverage(k + 1) < 0.95


def test_the_median_interval_is_two_of_the_rounds_around_their_median() -> None:
    rng = random.Random(7)
    rounds = [rng.uniform(0.6, 1.3) for _ in range(15)]
    lo, hi = median_interval(rounds)  # type: ignore[misc]
    s = sorted(rounds)
    assert (lo, hi) == (s[3], s[11])  # n = 15: the 4th and the 12th of 15
    assert median_interval(rounds[:7]) == (min(rounds[:7]), max(rounds[:7]))


def test_a_head_to_head_verdict_says_when_the_rounds_cannot_tell() -> None:
    assert "above the target" in _against_noise([1.1, 1.2, 1.05, 1.3, 1.15, 1.08, 1.2], 1.0)
    assert "below the target" in _against_noise([0.8, 0.9, 0.85, 0.7, 0.95, 0.88, 0.9], 1.0)
    assert "cannot tell" in _against_noise([0.9, 1.1, 0.95, 1.05, 1.0, 0.97, 1.02], 1.0)
    assert "too few rounds" in _against_noise([1.1, 1.2, 1.3], 1.0)


def test_the_cpu_reading_of_a_head_to_head_is_the_baselines_cpu_over_the_contenders() -> None:
    from benchmarks.per_task import _pair_cpu

    def cpu(worker: float) -> dict[str, float]:  # ms per task; "machine" also counts the rest
        return {"worker": worker, "PostgreSQL": 0.5, "Redis": 0.2, "machine": 9.0}

    lines = _pair_cpu(
        {
            "leased-pg-pg": [cpu(1.3)] * 7,  # 2.0 ms served per task
            "floor-pg-protocol": [cpu(1.26)] * 7,  # 1.96 ms: 1.96 / 2.0 = 0.98
            "leased-redis-nocommit": [cpu(1.0)] * 6,
            "once": [cpu(0.9)] * 7,  # a round left out of one side: no reading
        }
    )
    assert len(lines) == 1, lines
    assert "0.98\u00d7" in lines[0] and "above the target" in lines[0], lines[0]
