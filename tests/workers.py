"""Real ``celery worker`` processes for acceptance tests.

Each :class:`Worker` is a ``celery -A tests.apps.leaseapp worker`` subprocess
in its own process group, configured through ``CL_*`` environment variables
(see ``tests/apps/leaseapp.py``), with its log kept for assertions.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tests.servers import signal_group, spawn, wait_for

ROOT = Path(__file__).resolve().parent.parent

#: The workers started since the current test began (tests/conftest.py shows
#: their logs' errors when the test fails: a worker is often killed by then).
STARTED: list[Worker] = []


class Worker:
    def __init__(
        self,
        name: str,
        env: Mapping[str, str],
        logdir: Path,
        *,
        concurrency: int = 1,
        pool: str = "prefork",
        app: str = "tests.apps.leaseapp",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.hostname = f"{name}@localhost"
        # Its own TMPDIR, among the test's files: a killed worker leaves its
        # temporary files behind (billiard's, the metrics samples'), and a
        # suite that kills hundreds would otherwise fill the machine's /tmp.
        tmp = logdir / f"tmp-{name}"
        tmp.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp), **env}
        self.log_path = logdir / f"worker-{name}.log"
        self.argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app,
            "worker",
            "-n",
            self.hostname,
            "-c",
            str(concurrency),
            "-P",
            pool,
            "-l",
            "INFO",
            "--without-mingle",
            "--without-gossip",
            *extra_args,
        ]
        self.proc: Any = None
        self._log: Any = None

    def start(self, timeout: float = 60.0) -> Worker:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        STARTED.append(self)
        self._log = open(self.log_path, "ab")
        self.proc = spawn(self.argv, log=self._log, env=self.env, cwd=str(ROOT))

        def ready() -> bool:
            return " ready." in self.log_text(offset)

        def exited() -> str | None:
            if self.proc.poll() is not None:
                tail = self.log_text(offset)[-3000:]
                return f"worker {self.name} exited ({self.proc.returncode}):\n{tail}"
            return None

        from tests.servers import ServerStartError

        try:
            wait_for(ready, timeout, f"worker {self.name} ready", abort=exited)
        except ServerStartError as e:
            raise AssertionError(str(e)) from None
        return self

    def run_to_exit(self, timeout: float = 60.0) -> tuple[int, str]:
        """Start and wait for the worker to exit by itself (bad settings)."""
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._log = open(self.log_path, "ab")
        self.proc = spawn(self.argv, log=self._log, env=self.env, cwd=str(ROOT))
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return code, self.log_text(offset)

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def children(self) -> list[int]:
        found: list[int] = []
        for task in Path(f"/proc/{self.pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                found += [int(p) for p in (task / "children").read_text().split()]
        return found

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self, offset: int = 0) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(offset)
                return fh.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def stop_group(self) -> None:
        """SIGSTOP the whole process group (main process and children)."""
        signal_group(self.pid, signal.SIGSTOP)
        wait_for(lambda: _state(self.pid) == "T", 10, f"{self.name} stopped")

    def cont_group(self) -> None:
        signal_group(self.pid, signal.SIGCONT)

    def stop(self, timeout: float = 20.0) -> None:
        if not self.alive():
            return
        signal_group(self.pid, signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc is None:
            return
        signal_group(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def error_lines(path: Path, limit: int = 20, width: int = 300) -> list[str]:
    """The ERROR and CRITICAL lines of a worker's log (the first ``limit``)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    found = [ln for ln in text.splitlines() if "ERROR/" in ln or "CRITICAL/" in ln]
    return [ln[:width] for ln in found[:limit]]


def _state(pid: int) -> str:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return data[data.rfind(")") + 2 :].split()[0]


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@contextlib.contextmanager
def workers(*ws: Worker) -> Iterator[tuple[Worker, ...]]:
    try:
        for w in ws:
            w.start()
        yield ws
    finally:
        for w in ws:
            w.kill()


def wait_log(path: Path, predicate: Any, timeout: float, what: str) -> list[dict[str, Any]]:
    return wait_for(
        lambda: (lambda rows: rows if predicate(rows) else None)(read_log(path)), timeout, what
    )


def celery_cli(env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.apps.leaseapp ARGS...`` in a subprocess, configured by ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.leaseapp", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def now() -> float:
    return time.time()


def signal_when_active(app: Any, worker: Worker, task_ids: list[str], sig: int) -> int:
    """Send ``sig`` to ``worker`` once it reports exactly ``task_ids`` active
    (``[]``: idle), and return its exit code (within 30 s).

    The report is a control reply, which comes from the worker's event loop, so
    the signal finds that loop idle: Celery 5.7's cold shutdown can hang for
    good when SIGQUIT lands while the main process handles a pool message (its
    handler joins the pool from inside the result handler).
    """
    inspect = app.control.inspect(destination=[worker.hostname], timeout=2)

    def active() -> list[str] | None:  # None: no reply within the timeout, ask again
        replies = inspect.active() or {}
        if worker.hostname not in replies:
            return None
        return [r["id"] for r in replies[worker.hostname]]

    wait_for(lambda: active() == task_ids, 30, f"{worker.name} to report {task_ids} active")
    worker.proc.send_signal(sig)
    return int(worker.proc.wait(30))
