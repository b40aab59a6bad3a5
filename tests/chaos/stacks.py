"""The workers' Python stacks, for a run that stopped making progress.

``py-spy dump`` of every worker's processes (its main process and pool
children, found through ``/proc``), one file per worker under
``<workdir>/stacks/``: what a stalled consumer was doing is then on disk next
to its log. Without py-spy (a requirement of the test suite, so normally
there) the dump says so and the run goes on.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["STALL", "Stall", "descendants", "dump"]

#: seconds of the settle without a task ending, messages held, before the stacks are taken
STALL = 120.0


class Stall:
    """Whether the settle has stalled: the same tasks pending and messages held
    for :data:`STALL` seconds. True once per stall (again after any progress)."""

    def __init__(self) -> None:
        self.seen: tuple[int, int] | None = None
        self.since = time.monotonic()
        self.reported = False
        self.label = ""

    def still(self, pending: int, queued: int) -> bool:
        now = time.monotonic()
        if (pending, queued) != self.seen or pending == 0 or queued == 0:
            self.seen, self.since, self.reported = (pending, queued), now, False
            return False
        if self.reported or now - self.since < STALL:
            return False
        self.reported = True
        self.label = time.strftime("%H%M%S")
        return True


def _py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (a faketime wrapper's Python, the pool)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            data = stat.read_text()
        except OSError:
            continue
        ppid = int(data[data.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return sorted(out)


def dump(workers: Iterable[Any], into: Path, label: str) -> list[Path]:
    """One ``<label>-<worker>.txt`` per live worker in ``into``; returns the files."""
    spy = _py_spy()
    into.mkdir(parents=True, exist_ok=True)
    written = []
    for w in workers:
        if not w.alive():
            continue
        path = into / f"{label}-{w.name}.txt"
        with open(path, "w") as out:
            out.write(f"# {w.name} at {time.strftime('%H:%M:%S')}\n")
            if spy is None:
                out.write("py-spy is not installed: no stacks\n")
            else:
                _dump_tree(spy, w.pid, out)
        written.append(path)
    return written


def _dump_tree(spy: str, pid: int, out: Any) -> None:
    for p in descendants(pid):
        out.write(f"\n=== pid {p}\n")
        out.flush()
        cmd = [spy, "dump", "--pid", str(p), "--locals"]
        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=30, check=False)
