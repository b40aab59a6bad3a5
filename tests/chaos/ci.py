"""The CI-sized chaos run: its options and its checks, shared by the CI chaos tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.runner import Options, run

__all__ = ["OPTIONS", "run_and_check"]

OPTIONS: dict[str, Any] = {
    "duration": 100.0,
    "seed": 20240,
    "workers": 3,
    "tasks": 120,
    "keys": 8,
    "fault_rate": 0.25,
    "settle": 150.0,
}


def run_and_check(tmp_path: Path, **options: Any) -> dict[str, Any]:
    """The CI-sized run with ``options``; asserts it is clean; returns its figures."""
    opts = Options(**OPTIONS, **options, workdir=tmp_path / "chaos", quiet=True)
    try:
        result = run(opts)
    except FileNotFoundError as exc:  # a server binary missing on a developer machine
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    print(result.table)
    f = result.figures
    missing = [k for k in opts.kinds if not f["faults"].get(k)]
    assert not missing, f"fault kinds never injected: {missing}\n{result.table}"
    # An incomplete replay proves no transport loss, so a task kombu's Redis
    # transport lost would read as lost by the plugin: fail as what it is.
    assert f.get("broker_aof_complete", True), f"broker AOF replay incomplete\n{result.table}"
    assert result.report.violations == [], result.table
    assert result.report.lost_plugin == [], result.table
    assert f["executions"] >= f["keys"] and f["accepted"] >= f["keys"]
    f["table"] = result.table
    return f
