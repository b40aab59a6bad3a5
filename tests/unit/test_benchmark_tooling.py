"""Benchmark tooling, checked without running a benchmark.

The profile names the task path's steps by module and function
(benchmarks/per_task.py, EXECUTOR): a refactor that moves them must move the
name too, or the report says "not run" for steps that ran. A head-to-head's
bad arguments fail before any server starts."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from benchmarks.per_task import EXECUTOR
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
