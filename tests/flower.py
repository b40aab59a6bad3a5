"""A real Flower (``celery -A tests.apps.leaseapp flower``) on a private port, read
through its HTTP API (``/api/task/info/<id>``, ``/api/tasks?state=...``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.servers import free_port, signal_group, spawn, wait_for
from tests.workers import ROOT

__all__ = ["Flower"]


class Flower:
    """``celery -A tests.apps.leaseapp flower`` on a private port, its API open."""

    def __init__(self, env: dict[str, str], logdir: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = logdir / "flower.log"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "FLOWER_UNAUTHENTICATED_API": "true",
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "celery", "-A", "tests.apps.leaseapp", "flower",
            f"--port={self.port}", "--address=127.0.0.1",
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = spawn(argv, log=log, env=self.env, cwd=str(ROOT))

        def up() -> bool:
            try:
                return self.get_text("/healthcheck") == "OK"
            except OSError:
                return False

        def exited() -> str | None:
            if self.proc is not None and self.proc.poll() is not None:
                return (
                    f"flower exited ({self.proc.returncode}):\n{self.log_path.read_text()[-3000:]}"
                )
            return None

        wait_for(up, 60, "flower's HTTP server", abort=exited)

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.base + path, timeout=5) as resp:
            return str(resp.read().decode())

    def get(self, path: str) -> Any:
        return json.loads(self.get_text(path))

    def state(self, task_id: str) -> str | None:
        try:
            return str(self.get(f"/api/task/info/{task_id}")["state"])
        except urllib.error.HTTPError as e:
            if e.code == 404:  # Flower has not seen the task yet
                return None
            raise

    def tasks_in(self, state: str) -> dict[str, Any]:
        found: dict[str, Any] = self.get(f"/api/tasks?state={state}")
        return found

    def wait_state(self, task_id: str, state: str, timeout: float, what: str) -> None:
        seen: list[str | None] = []

        def reached() -> bool:
            current = self.state(task_id)
            if not seen or seen[-1] != current:
                seen.append(current)
            return current == state

        try:
            wait_for(reached, timeout, f"flower to show {what} {task_id} as {state}")
        except TimeoutError as e:
            raise AssertionError(f"{e}; states seen: {seen}") from None

    def warm_up(self, run_one: Callable[[], str]) -> None:
        """Run tasks (``run_one`` runs one to its end, returns its id) until Flower
        has seen one succeed. Flower's event consumer connects some time after its
        HTTP server answers, and events sent before that are gone for it."""

        def seen() -> bool:
            task_id = run_one()
            try:
                return bool(wait_for(lambda: self.state(task_id) == "SUCCESS", 3, "warm-up"))
            except TimeoutError:
                return False

        wait_for(seen, 60, "flower to receive the workers' events")

    def stop(self) -> None:
        if self.proc is None:
            return
        signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
