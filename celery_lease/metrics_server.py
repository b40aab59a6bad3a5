"""Serving the metrics from a prefork worker (prometheus-client multiprocess mode).

Each process writes its samples to files named after its pid in one
directory; the main process's HTTP server sums them. A live gauge
(``celery_lease_held_leases``) must stop counting a process once it is dead,
or a SIGKILLed child's leases stay in the sum forever: Celery's
``worker_process_shutdown`` never runs in a killed child. So every scrape
first drops the live-gauge files of processes that no longer exist
(``mark_process_dead``), and a worker starting drops every file a dead
process left (a directory reused from an earlier run would count it twice).
Only dead pids are touched: a directory given by the user may be shared with
other live workers. A directory the worker made itself is its alone, and is
removed when the worker's main process exits.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["dead_pids", "prepare", "process_init", "start", "sweep_dead"]

#: ``counter_123.db``, ``gauge_livesum_123.db``, ``histogram_123.db``...
_FILE = re.compile(r"^[a-z_]+_(?P<pid>\d+)\.db$")


def prepare(port: int) -> None:
    """Before children fork: a multiprocess directory for their samples."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        path = tempfile.mkdtemp(prefix=f"celery-lease-{port}-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
        # At interpreter exit, after the pool's children wrote their last samples
        # (a warm or a cold shutdown). A restart makes a fresh one, so a kept
        # directory would only fill the temporary directory, which is often RAM.
        atexit.register(_remove, os.getpid(), path)
        return
    Path(path).mkdir(parents=True, exist_ok=True)
    for pid in dead_pids(path):
        for file in Path(path).glob(f"*_{pid}.db"):
            file.unlink(missing_ok=True)


def _remove(owner: int, path: str) -> None:
    if os.getpid() == owner:  # a forked child inherits the hook, not the directory
        shutil.rmtree(path, ignore_errors=True)


def process_init() -> None:
    """In a new prefork child: forget live gauges a dead process of this pid left.

    A pid is reused; a child would otherwise start from the dead one's value
    (prometheus-client reads the existing file). Runs before the child counts.
    """
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(os.getpid(), path)  # type: ignore[no-untyped-call]


def start(port: int, addr: str = "127.0.0.1") -> None:
    """Listen on ``addr`` (``lease_metrics_addr``: loopback unless told otherwise)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(_LiveCollector(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
    start_http_server(port, addr=addr, registry=registry)


def dead_pids(path: str) -> set[int]:
    """The pids that have files in ``path`` and no running process (this one excepted)."""
    pids = set()
    for name in os.listdir(path):
        m = _FILE.match(name)
        if m:
            pids.add(int(m["pid"]))
    pids.discard(os.getpid())
    return {pid for pid in pids if not _running(pid)}


def sweep_dead(path: str) -> set[int]:
    """``mark_process_dead`` for every dead pid in ``path``; the pids."""
    from prometheus_client import multiprocess

    dead = dead_pids(path)
    for pid in dead:
        multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
    return dead


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: signal 0 is all there is to go on
    return stat[stat.rfind(")") + 2 :].split()[0] not in ("Z", "X")  # a zombie is dead


class _LiveCollector:
    """prometheus-client's multiprocess collector, dead processes' live gauges dropped first."""

    def __init__(self, path: str) -> None:
        from prometheus_client import multiprocess

        self._path = path
        self._inner = multiprocess.MultiProcessCollector(None, path)  # type: ignore[no-untyped-call]

    def collect(self) -> Iterator[Any]:
        sweep_dead(self._path)
        return iter(self._inner.collect())  # type: ignore[no-untyped-call]
