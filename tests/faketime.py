"""The ``faketime`` wrapper, without the leftovers of killed wrappers.

``faketime`` makes a POSIX semaphore and a shared-memory object named after
its own pid (``/dev/shm/sem.faketime_sem_<pid>``, ``/dev/shm/faketime_shm_<pid>``)
and removes them when it exits. A wrapper killed by SIGKILL (the chaos
suite's worker kills, a test's clean-up) leaves them behind, and a later
wrapper that is given the same pid fails at start with ``faketime: sem_open:
File exists``. Every launch therefore first removes the files of pids that
are not a running ``faketime``.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

__all__ = ["command", "sweep"]

SHM = Path("/dev/shm")
_NAME = re.compile(r"^(?:sem\.faketime_sem|faketime_shm)_(\d+)$")


def _running_faketime(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "faketime"
    except OSError:
        return False


def sweep(shm: Path = SHM) -> int:
    """Remove the semaphores and shared memory of wrappers that are gone; how many."""
    removed = 0
    for path in shm.glob("*faketime_*"):
        found = _NAME.match(path.name)
        if found is None or _running_faketime(int(found.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):  # another sweep was first
            path.unlink()
            removed += 1
    return removed


def command(skew: str, argv: list[str]) -> list[str]:
    """``faketime -f skew argv...``, after a sweep of what killed wrappers left."""
    sweep()
    return ["faketime", "-f", skew, *argv]
