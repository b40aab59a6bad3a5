"""tests/faketime.py: what killed faketime wrappers leave is swept before a launch."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import faketime


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_files_of_wrappers_that_are_gone_are_swept(tmp_path: Path) -> None:
    dead = _dead_pid()
    stale = [tmp_path / f"sem.faketime_sem_{dead}", tmp_path / f"faketime_shm_{dead}"]
    other = tmp_path / "PostgreSQL.12345"
    for p in [*stale, other]:
        p.write_bytes(b"")
    assert faketime.sweep(tmp_path) == 2
    assert not any(p.exists() for p in stale) and other.exists()


@pytest.mark.skipif(shutil.which("faketime") is None, reason="faketime is not installed")
def test_a_running_wrappers_files_are_kept(tmp_path: Path) -> None:
    wrapper = subprocess.Popen(
        faketime.command("+1h", [sys.executable, "-c", "import time; time.sleep(30)"])
    )
    try:
        sem = faketime.SHM / f"sem.faketime_sem_{wrapper.pid}"
        deadline = time.monotonic() + 10
        while not sem.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sem.exists(), "the wrapper made its semaphore"
        faketime.sweep()
        assert sem.exists(), "a running wrapper's semaphore is not swept"
    finally:
        wrapper.kill()
        wrapper.wait()
    assert sem.exists(), "SIGKILL leaves it behind: the fault this module sweeps up"
    faketime.sweep()
    assert not sem.exists()
