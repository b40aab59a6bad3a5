"""The benchmark's profile names the task path's steps by module and function
(benchmarks/per_task.py, EXECUTOR): they must still be there, or the report
prints "not run" for steps that ran (it once printed 0 µs for each, silently,
after the steps moved out of celery_lease/task.py)."""

from __future__ import annotations

import inspect
from pathlib import Path

from benchmarks.per_task import EXECUTOR
from celery_lease.execution import Execution


def test_the_profiled_steps_are_execution_methods_in_the_named_module() -> None:
    source = Path(inspect.getfile(Execution)).as_posix()
    assert source.endswith(EXECUTOR), (source, EXECUTOR)
    for step in ("claim", "prepare", "commit", "release"):
        method = getattr(Execution, step)
        assert Path(inspect.getfile(method)).as_posix().endswith(EXECUTOR), step
