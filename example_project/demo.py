"""The whole payment-API timeline, with two real ``celery worker`` processes.

    A claims payment-security-42 (token n)
    B's copy is deferred while A holds the lease
    A stalls past its TTL (SIGSTOP: really stopped)
    B takes over with a larger token and commits
    A resumes; its late commit is refused (FENCED)

Run: ``python -m example_project`` (``scripts/demo`` makes the virtualenv first).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
KEY = "payment-security-42"
START = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - START:6.2f}s] {message}", flush=True)


def wait(predicate: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"demo failed: timed out waiting for {what}")


class Agent:
    """A security-test agent: one real ``celery worker`` (prefork, one child)."""

    def __init__(self, name: str, data: Path) -> None:
        self.name = name
        self.log = open(data / f"worker-{name}.log", "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "example_project",
                "worker",
                "-n",
                f"agent-{name}@demo",
                "-c",
                "1",
                "-l",
                "INFO",
                "--without-mingle",
                "--without-gossip",
                "--without-heartbeat",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "EXAMPLE_DATA": str(data)},
        )
        self.path = data / f"worker-{name}.log"

    def text(self) -> str:
        return self.path.read_text(errors="replace")

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise SystemExit(f"demo failed: agent {self.name} exited:\n{self.text()[-2000:]}")
        return " ready." in self.text()

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stopped(self) -> bool:
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        return stat[stat.rfind(")") + 2] == "T"

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            self.signal_group(signal.SIGCONT)
            self.signal_group(signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


def main() -> int:
    data = Path(os.environ.setdefault("EXAMPLE_DATA", str(Path(".example-data").resolve())))
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    from celery_lease import LeaseStore
    from celery_lease.config import config
    from celery_lease.exceptions import StaleFencingToken
    from celery_lease.results import ResultTable
    from example_project.tasks import app, generate_security_suite

    cfg = config(app)
    store = LeaseStore.from_url(cfg.store_url)
    table = ResultTable(cfg.result_url, store)
    say(f"lease store {cfg.store_url}, results {cfg.result_url}, TTL {cfg.ttl:g}s")
    agents: list[Agent] = []
    try:
        a = Agent("a", data)
        agents.append(a)
        wait(a.ready, 60, "agent A to start")
        say("agent A is ready")
        # A's body must outlast B's start and B's claim, or B's copy finds the key
        # free and is never deferred (seconds, on a loaded machine). The
        # body's clock runs on while A is stopped, so A still ends soon after SIGCONT.
        t1 = generate_security_suite.delay(42, seconds=8.0)
        first = wait(lambda: _live(store), 30, "A's claim")
        say(f"A claims {KEY} (token {first.token}, owner {first.owner_id})")

        b = Agent("b", data)
        agents.append(b)
        wait(b.ready, 60, "agent B to start")
        say("agent B is ready")
        t2 = generate_security_suite.delay(42, seconds=1.0)
        wait(lambda: "LEASE_DEFERRED" in b.text(), 30, "B's copy to be deferred")
        say(f"B's copy ({t2.id[:8]}) is deferred: A holds the lease (LEASE_DEFERRED)")

        a.signal_group(signal.SIGSTOP)
        wait(a.stopped, 10, "A to stop")
        say("A stalls (SIGSTOP): no body, no renewals")
        wait(lambda: not _still(store, first.token), 30, "A's lease to lapse")
        say(f"A's lease lapses in store time ({cfg.ttl:g}s TTL, no renewal)")
        second = wait(lambda: _newer(store, first.token), 60, "B's claim")
        say(f"B takes over with token {second.token} > {first.token}")
        accepted = wait(lambda: _accepted(table, second.token), 60, "B's commit")
        say(f"B commits its suite (token {accepted.token}): accepted")

        a.signal_group(signal.SIGCONT)
        say("A resumes (SIGCONT) and tries to commit with its old token")
        try:
            t1.get(timeout=60, propagate=True)
            outcome = "ACCEPTED (unexpected)"
        except StaleFencingToken as e:
            outcome = "FENCED"
            say(f"A's late commit is refused: FENCED ({e})")
        t2.get(timeout=60)

        final = table.accepted(KEY)
        assert final is not None
        print()
        print("Summary")
        rows = [
            ("agent A", t1.id[:8], first.token, outcome),
            ("agent B", t2.id[:8], second.token, "ACCEPTED"),
        ]
        print(f"  {'who':8} {'task':8} {'token':>18}  outcome")
        for who, task, token, what in rows:
            print(f"  {who:8} {task:8} {token:>18}  {what}")
        print()
        print(f"Accepted result for {KEY}: token {final.token}, task {final.task_id}")
        print(f"  {json.dumps(final.value, sort_keys=True)}")
        ok = outcome == "FENCED" and final.token == second.token
        print("RESULT:", "A FENCED, B accepted" if ok else "UNEXPECTED")
        return 0 if ok else 1
    finally:
        for agent in agents:
            agent.shutdown()


def _live(store: Any) -> Any:
    record = store.inspect(KEY)
    return record if record is not None and record.live else None


def _still(store: Any, token: int) -> bool:
    record = store.inspect(KEY)
    return record is not None and record.live and record.token == token


def _newer(store: Any, token: int) -> Any:
    record = store.inspect(KEY)
    return record if record is not None and record.live and record.token > token else None


def _accepted(table: Any, token: int) -> Any:
    accepted = table.accepted(KEY)
    return accepted if accepted is not None and accepted.token == token else None


if __name__ == "__main__":
    raise SystemExit(main())
