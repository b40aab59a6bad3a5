"""Regression tests for the chaos suite's bugs about fenced copies, replayed deterministically.

1. *A guarded write refused in the body failed its task id while a copy of
   it was doing the work.* A (task T, token 7) pauses past its TTL; a copy
   of T on B claims token 8 and works. A resumes, its ``fencing.guard``
   write is refused and ``StaleFencingToken`` escaped the plugin, so Celery
   stored FAILURE for T (``get()`` raised) while B went on to SUCCESS (the
   chaos run's backend monitor saw FAILURE, then SUCCESS). A refusal in the
   body must end like a refused commit: FENCED, and the backend left to the
   execution that owns the task id.
5. *a late copy of a fenced task turned its final FAILURE into SUCCESS*;
8. *a fenced execution acked away the crash cover of its live twin*.

Real workers on private servers: :mod:`tests.chaos.regression_cell`. The
bugs are numbered across the three ``test_regressions_*`` modules.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from tests.chaos.regression_cell import (
    Cell,
    is_event,
    late_copy_outcome,
    lease_live,
    message_restored,
)
from tests.servers import wait_for

pytestmark = pytest.mark.timeout(180)


def test_a_guard_refused_in_the_body_never_fails_its_task_id_while_a_copy_runs(
    cell: Cell,
) -> None:
    a = cell.worker("a", "qa")
    cell.worker("b", "qb")
    tid, key = str(uuid.uuid4()), f"guard-{uuid.uuid4().hex[:6]}"
    cell.tasks.exclusive.apply_async((key, 2.0, 0), task_id=tid, queue="qa")
    wait_for(lambda: cell.records(is_event("start", tid)), 30, "A's body to start")
    a.stop_group()
    try:
        wait_for(lambda: not lease_live(cell, key), 10, "A's lease to expire in store time")
        # A copy of the same task id (a redelivery) takes over on B, for 4 s.
        cell.tasks.exclusive.apply_async((key, 4.0, 1), task_id=tid, queue="qb")
        wait_for(lambda: len(cell.records(is_event("start", tid))) == 2, 30, "B's body to start")
    finally:
        a.cont_group()
    ends = wait_for(
        lambda: [r for r in cell.records(is_event("end", tid)) if r["write"] == "refused"],
        30,
        "A's guarded write to be refused",
    )
    wait_for(
        lambda: [r for r in cell.records(is_event("postrun", tid)) if r["pid"] == ends[0]["pid"]],
        30,
        "A's execution to end",
    )
    # B is still working: its task id must not read as failed meanwhile.
    assert not cell.records(is_event("end", tid, pid_not=ends[0]["pid"]))
    assert cell.state(tid)["status"] == "PENDING"
    wait_for(lambda: cell.state(tid)["status"] == "SUCCESS", 30, "B's SUCCESS")
    assert cell.state(tid)["result"]["n"] == 1  # B's value
    assert f"FENCED {tid}" in a.log_text()


def test_a_late_deferred_copy_of_a_fenced_task_never_turns_its_failure_into_success(
    cell: Cell,
) -> None:
    """5. *A task's final FAILURE turned into SUCCESS.* T's execution paused
    past its TTL, another task took the key, and T ended FAILURE
    StaleFencingToken (FENCED, taken over); a copy of T queued meanwhile (a
    deferred copy, a restored message) then ran after the other task and
    committed: T's state went FAILURE -> SUCCESS (seen by the chaos run's
    backend monitor), after ``get()`` had raised. A late copy of a task that
    already ended with a lease outcome is rejected like one of an accepted
    task.

    Late copies are made two ways, and each is replayed for real: this test
    has the plugin itself defer a copy of T (it meets the other task's live
    lease), so the late copy is the plugin's own re-publish, with the
    ``lease_defer_id`` header; the next test has the Redis broker restore T's
    message. (Only such copies are checked against the result backend: a
    fresh submission under a finished task id, neither deferred nor
    redelivered, is new work to Celery -- as for its own
    ``worker_deduplicate_successful_tasks`` -- and runs.)"""
    a = cell.worker("a", "qa")
    b = cell.worker("b", "qb")
    key = f"late-{uuid.uuid4().hex[:6]}"
    tid, other = str(uuid.uuid4()), str(uuid.uuid4())
    cell.tasks.exclusive.apply_async((key, 2.0, 0), task_id=tid, queue="qa")
    wait_for(lambda: cell.records(is_event("start", tid)), 30, "T's body to start")
    a.stop_group()
    try:
        wait_for(lambda: not lease_live(cell, key), 10, "T's lease to expire in store time")
        # The other task holds the key long enough for a copy of T to meet it.
        cell.tasks.exclusive.apply_async((key, 10.0, 1), task_id=other, queue="qb")
        wait_for(
            lambda: cell.records(is_event("start", other)), 30, "the other task to take the key"
        )
    finally:
        a.cont_group()
    wait_for(lambda: cell.state(tid)["status"] == "FAILURE", 30, "T to end fenced")
    assert type(cell.state(tid)["result"]).__name__ == "StaleFencingToken"
    # A copy of T on A meets the other task's live lease: the plugin defers it,
    # and the deferred copy comes back to A after the other task.
    assert lease_live(cell, key)
    cell.tasks.exclusive.apply_async((key, 0.1, 2), task_id=tid, queue="qa")
    wait_for(lambda: f"LEASE_DEFERRED {tid}" in a.log_text(), 30, "A to defer the copy of T")
    wait_for(lambda: cell.state(other)["status"] == "SUCCESS", 30, "the other task")
    outcome = wait_for(lambda: late_copy_outcome(cell, a, tid), 30, "A to take the deferred copy")
    assert outcome == "rejected", "the deferred copy of T ran after T had ended FENCED"
    deferred = [r for r in cell.records(is_event("prerun", tid)) if r["deferrals"] >= 1]
    assert deferred, "the rejected copy was the plugin's deferred copy"
    time.sleep(0.5)
    assert cell.state(tid)["status"] == "FAILURE"
    assert len(cell.records(is_event("start", tid))) == 1  # never ran again
    assert f"chaos.exclusive[{tid}]" not in b.log_text()


def test_a_late_restored_copy_of_a_fenced_task_never_turns_its_failure_into_success(
    cell: Cell,
) -> None:
    """5 (continued). The late copy is T's own message, restored by the Redis
    transport: A is stopped past the visibility timeout, the restore sweep of
    another worker puts T's message back on A's queue (``redelivered`` set,
    as kombu marks every restored message), and A runs it once T's execution
    has ended fenced. It must be rejected, not committed."""
    cell.restart_env(vt=3.0)
    a = cell.worker("a", "qa")
    cell.worker("b", "qb")  # runs the other task, and the restore sweep
    key = f"late-{uuid.uuid4().hex[:6]}"
    tid, other = str(uuid.uuid4()), str(uuid.uuid4())
    cell.tasks.exclusive.apply_async((key, 2.0, 0), task_id=tid, queue="qa")
    wait_for(lambda: cell.records(is_event("start", tid)), 30, "T's body to start")
    a.stop_group()
    try:
        wait_for(lambda: not lease_live(cell, key), 10, "T's lease to expire in store time")
        cell.tasks.exclusive.apply_async((key, 0.1, 1), task_id=other, queue="qb")
        wait_for(lambda: cell.state(other)["status"] == "SUCCESS", 30, "the other task")
        wait_for(lambda: message_restored(cell, tid), 30, "the broker to restore T's message")
    finally:
        a.cont_group()
    outcome = wait_for(lambda: late_copy_outcome(cell, a, tid), 30, "A to take the restored copy")
    assert outcome == "rejected", "the restored copy of T ran after T had ended FENCED"
    assert type(cell.state(tid)["result"]).__name__ == "StaleFencingToken"
    assert f"FENCED {tid}" in a.log_text()
    restored = [r for r in cell.records(is_event("prerun", tid)) if r["redelivered"]]
    assert restored and restored[0]["deferrals"] == 0, "the rejected copy was the restored one"
    time.sleep(0.5)
    assert cell.state(tid)["status"] == "FAILURE"
    assert len(cell.records(is_event("start", tid))) == 1  # never ran again


def test_a_fenced_copy_never_acks_away_the_crash_cover_of_its_live_twin(cell: Cell) -> None:
    """8. *A task was lost after its restored twin's worker died.* A runs T and
    pauses past the TTL and the visibility timeout; the broker restores T's
    message and B runs it (same task id, same delivery tag). A resumes, is
    fenced, and -- another execution of T holding the key -- acked: with the
    Redis transport an ack of the shared tag removes B's unacked entry too,
    so when B's child was SIGKILLed nothing was requeued and T never ended
    (the long chaos run: one task "ended in no state"). A fenced execution
    whose twin holds the key now leaves a deferred copy behind instead."""
    cell.restart_env(vt=3.0)
    key, tid = f"twin-{uuid.uuid4().hex[:6]}", str(uuid.uuid4())
    a = cell.worker("a", "qa")
    cell.tasks.exclusive.apply_async((key, 6.0, 0), task_id=tid, queue="qa")
    wait_for(lambda: cell.records(is_event("start", tid)), 30, "A's body to start")
    a.stop_group()
    try:
        b = cell.worker("b", "qa")  # its restore sweep hands it T's message after 3 s
        started = wait_for(
            lambda: [r for r in cell.records(is_event("start", tid)) if r["host"] == b.hostname],
            30,
            "B to run the restored copy of T",
        )
    finally:
        a.cont_group()
    wait_for(
        lambda: [
            r for r in cell.records(is_event("postrun", tid)) if r["pid"] != started[0]["pid"]
        ],
        30,
        "A's execution to end, fenced",
    )
    os.kill(started[0]["pid"], signal.SIGKILL)  # B's child, mid-body
    wait_for(
        lambda: cell.state(tid)["status"] == "SUCCESS",
        45,
        "T to be redone after its last execution died",
    )
