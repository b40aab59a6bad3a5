"""Flower shows the lease states: FENCED, LEASE_DEFERRED, LEASE_REJECTED.

A real Flower process watches real workers (Redis broker, ``-E``) and the
test reads its HTTP API (``/api/task/info/<id>``, ``/api/tasks?state=...``):

* FENCED -- the canonical timeline: worker A claims key K and its whole
  process group is paused (SIGSTOP) past the TTL; a second submission of K
  on worker B is deferred until A's lease expires, then claims a newer token
  and commits; A resumes and its commit is refused.
* LEASE_DEFERRED -- a second submission of a key held by a long task, seen
  while the holder still runs (then SUCCESS once it ran after the holder).
* LEASE_REJECTED -- ``work_reject`` on the busy key, and a ``once`` mode
  duplicate of a key that already has an accepted result.

The result backend is checked too: custom states never go there; a fenced or
rejected task ends FAILURE with a named error.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.flower import Flower
from tests.workers import Worker, read_log, wait_log

pytestmark = pytest.mark.timeout(180)

TTL = 3.0


@pytest.fixture
def env(redis_url: str, tmp_path: Path) -> dict[str, str]:
    return {
        "CL_BROKER": redis_url,
        "CL_BACKEND": redis_url,
        "CL_STORE": redis_url,
        "CL_RESULTS": f"sqlite:///{tmp_path / 'results.sqlite3'}",
        "CL_TTL": str(TTL),
        "CL_LOG": str(tmp_path / "exec.log"),
        # While this file exists a body runs on past its sleep (tests/apps/leaseapp.py).
        "CL_HOLD": str(tmp_path / "hold"),
    }


@pytest.fixture
def flower(env: dict[str, str], tmp_path: Path) -> Iterator[Flower]:
    f = Flower(env, tmp_path)
    try:
        f.start()
        yield f
    finally:
        f.stop()


def _started(log: Path, task_id: str, timeout: float = 30) -> dict[str, Any]:
    rows = wait_log(
        log,
        lambda rs: any(r["event"] == "start" and r["task_id"] == task_id for r in rs),
        timeout,
        f"task {task_id} to start",
    )
    return next(r for r in rows if r["event"] == "start" and r["task_id"] == task_id)


def test_flower_shows_fenced_deferred_and_rejected(
    flower: Flower, env: dict[str, str], tmp_path: Path
) -> None:
    from tests.apps.leaseapp import build

    log = tmp_path / "exec.log"
    app, tasks = build(env)
    run = time.monotonic_ns()
    key, busy, once_key = f"payment-security-{run}", f"enrich-{run}", f"suite-{run}"
    a = Worker("flower-a", env, tmp_path, extra_args=("-Q", "a", "-E"))
    b = Worker("flower-b", env, tmp_path, concurrency=3, extra_args=("-Q", "b", "-E"))
    try:
        a.start()
        b.start()

        # Flower receives the workers' events before anything else is sent.
        def work_one() -> str:
            warmup = tasks.work.apply_async((f"warmup-{run}",), queue="b")
            assert warmup.get(timeout=30)["key"] == f"warmup-{run}"
            return str(warmup.id)

        flower.warm_up(work_one)

        # -- FENCED, part 1: A claims K, then its process group stops. -----------
        hold = Path(env["CL_HOLD"])  # A's body runs on until A is paused, however slow
        hold.touch()
        sent_a = time.monotonic()  # A's claim, and so its lease, began after this
        first = tasks.work.apply_async((key,), {"sleep": 4.0, "tag": "A"}, queue="a")
        token_a = _started(log, first.id)["token"]
        a.stop_group()
        assert not any(r["event"] == "end" and r["task_id"] == first.id for r in read_log(log)), (
            "A was paused too late: its body had ended"
        )
        hold.unlink()  # A's body ends once it resumes
        # B's submission of K is deferred while A's lease lives, then takes over.
        second = tasks.work.apply_async((key,), {"tag": "B"}, queue="b")

        # -- LEASE_DEFERRED and LEASE_REJECTED on a key held by a long task. --------
        holder = tasks.work.apply_async((busy,), {"sleep": 8.0, "tag": "holder"}, queue="b")
        _started(log, holder.id)
        deferred = tasks.work.apply_async((busy,), {"tag": "deferred"}, queue="b")
        rejected = tasks.work_reject.apply_async((busy,), {"tag": "rejected"}, queue="b")
        flower.wait_state(deferred.id, "LEASE_DEFERRED", 20, "a submission of a busy key")
        assert deferred.id in flower.tasks_in("LEASE_DEFERRED")
        assert not any(r["task_id"] == deferred.id for r in read_log(log)), "it ran"
        flower.wait_state(rejected.id, "LEASE_REJECTED", 20, "work_reject on a busy key")
        assert rejected.id in flower.tasks_in("LEASE_REJECTED")

        # -- FENCED, part 2: B committed K with a newer token while A was stopped. --
        result_b = second.get(timeout=30)
        assert result_b["token"] > token_a
        # A renewed until the pause (up to TTL/3 before it), so its lease can end
        # before pause + TTL; it cannot end before its claim + TTL.
        assert time.monotonic() - sent_a > TTL, "B took over before A's lease could expire"
        assert a.log_text().count(f"Task leaseapp.work[{first.id}] succeeded") == 0
        a.cont_group()
        flower.wait_state(first.id, "FENCED", 30, "the paused owner's refused commit")
        if os.environ.get("CL_FLOWER_SCREENSHOT"):  # docs/flower-states.png
            screenshot(flower, os.environ["CL_FLOWER_SCREENSHOT"], tmp_path)
        assert first.id in flower.tasks_in("FENCED")
        assert second.id not in flower.tasks_in("FENCED")
        flower.wait_state(second.id, "SUCCESS", 20, "the new owner")

        # The backend: A's task failed with StaleFencingToken; B's result stands.
        with pytest.raises(Exception) as raised:
            first.get(timeout=10)
        assert type(raised.value).__name__ == "StaleFencingToken", repr(raised.value)
        assert first.state == "FAILURE"
        accepted = tasks.work.accepted(key)
        assert accepted is not None and accepted.task_id == second.id
        assert accepted.token == result_b["token"]
        ends = [r for r in read_log(log) if r["event"] == "end" and r["task_id"] == first.id]
        assert ends and ends[0]["held"] is False, "A's body should have seen its lease gone"

        # The rejected task: FAILURE (LeaseNotAcquired) in the backend, never ran.
        with pytest.raises(Exception) as raised:
            rejected.get(timeout=10)
        assert type(raised.value).__name__ == "LeaseNotAcquired", repr(raised.value)
        assert not any(r["task_id"] == rejected.id for r in read_log(log))

        # -- LEASE_REJECTED for a once-mode duplicate. --------------------------
        once = tasks.work_once.apply_async((once_key,), queue="b")
        assert once.get(timeout=30)["key"] == once_key
        duplicate = tasks.work_once.apply_async((once_key,), queue="b")
        flower.wait_state(duplicate.id, "LEASE_REJECTED", 20, "a once-mode duplicate")
        with pytest.raises(Exception) as raised:
            duplicate.get(timeout=10)
        assert type(raised.value).__name__ == "DuplicateResult", repr(raised.value)
        assert not any(r["task_id"] == duplicate.id for r in read_log(log))

        # The deferred submission ran once the holder was done, and Flower says so.
        assert holder.get(timeout=30)["tag"] == "holder"
        assert deferred.get(timeout=30)["tag"] == "deferred"
        flower.wait_state(deferred.id, "SUCCESS", 20, "the deferred task, after the holder")
        rows = read_log(log)
        end_holder = next(r for r in rows if r["event"] == "end" and r["task_id"] == holder.id)
        start_def = next(r for r in rows if r["event"] == "start" and r["task_id"] == deferred.id)
        assert start_def["t"] >= end_holder["t"] and start_def["token"] > end_holder["token"]
        print(
            "flower states:",
            {
                "fenced": flower.state(first.id),
                "new owner": flower.state(second.id),
                "rejected": flower.state(rejected.id),
                "duplicate": flower.state(duplicate.id),
                "deferred, after the holder": flower.state(deferred.id),
            },
        )
    finally:
        a.kill()
        b.kill()
        app.close()


def screenshot(flower: Flower, path: str, tmp_path: Path) -> None:
    """Flower's task list in headless Chromium (Debian's ``chromium``), for the README."""
    subprocess.run(
        [
            "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={tmp_path / 'chromium'}",
            "--window-size=1500,620", "--virtual-time-budget=8000", f"--screenshot={path}",
            f"{flower.base}/tasks",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )  # fmt: skip
