"""The settle's stall detector and the stacks it takes (tests/chaos/stacks.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.chaos import stacks


def test_a_stall_is_reported_once_after_the_bound_and_again_after_progress(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(stacks.time, "monotonic", lambda: now[0])
    stall = stacks.Stall()
    assert not stall.still(5, 3)
    now[0] += stacks.STALL - 1
    assert not stall.still(5, 3), "not yet: within the bound"
    now[0] += 2
    assert stall.still(5, 3), "the same pending tasks and held messages past the bound"
    now[0] += stacks.STALL * 2
    assert not stall.still(5, 3), "once per stall"
    assert not stall.still(4, 3), "a task ended: progress"
    now[0] += stacks.STALL + 1
    assert stall.still(4, 3), "and a new stall after it"
    now[0] += stacks.STALL + 1
    assert not stall.still(4, 0) and not stall.still(0, 2), "nothing held, or nothing pending"


class _Proc:
    """What stacks.dump reads of a worker: name, pid, alive()."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        self.name, self.proc = name, proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


def test_the_stacks_of_a_process_and_its_children_are_written(tmp_path: Path) -> None:
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "def parked_in_the_parent():\n"
        "    time.sleep(60)\n"
        "parked_in_the_parent()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert stacks.descendants(parent.pid) == sorted([parent.pid, child])
        (path,) = stacks.dump([_Proc("w9", parent)], tmp_path / "stacks", "t1")
        text = path.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait(10)
    assert path.name == "t1-w9.txt"
    assert f"=== pid {parent.pid}" in text and f"=== pid {child}" in text
    assert "parked_in_the_parent" in text, text[-2000:]
