"""Regression tests for the bugs the chaos suite found, each replayed deterministically.

Real ``celery worker`` processes of :mod:`tests.chaos.app` on a private Redis
(broker, lease store and result backend in three databases) and the fenced
result table in PostgreSQL; each worker consumes its own queue so a test
decides which worker receives which message.

1. *A guarded write refused in the body failed its task id while a copy of
   it was doing the work.* A (task T, token 7) pauses past its TTL; a copy
   of T on B claims token 8 and works. A resumes, its ``fencing.guard``
   write is refused and ``StaleFencingToken`` escaped the plugin, so Celery
   stored FAILURE for T (``get()`` raised) while B went on to SUCCESS (the
   chaos run's backend monitor saw FAILURE, then SUCCESS). A refusal in the
   body must end like a refused commit: FENCED, and the backend left to the
   execution that owns the task id.
2. *A deferral published by a worker whose clock is skewed waited an hour.*
   The plugin re-published a deferred task with ``countdown``, which Celery
   turns into an ETA by the publishing worker's clock; a worker under
   ``faketime -f '+1h'`` so made every other worker hold the copy for an
   hour (the chaos run ended with tasks stuck behind such ETAs). The ETA
   must come from the lease store's clock; and a receiver whose clock runs
   ahead (so the ETA passes too soon) waits out the rest before claiming.
3. *A broker hiccup while sending a custom event failed the task*;
4. *a worker dying while it deferred a task lost the task*;
5. *a late copy of a fenced task turned its final FAILURE into SUCCESS*;
6. *a re-publish the broker refused ended the task FAILURE*;
7. *RabbitMQ lost deferred tasks published without confirms*;
8. *a fenced execution acked away the crash cover of its live twin*;
9. *two threads making a metric at once failed a task (DuplicateTimeseries)*
   (see the tests' docstrings).
"""

from __future__ import annotations

import itertools
import os
import shlex
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, text

import celery_lease
from celery_lease import LeaseStore
from tests.chaos.app import PROTECTED_DDL, build
from tests.chaos.backends import BackendMonitor
from tests.chaos.cluster import ChaosWorker
from tests.etcd_cluster import etcd_cluster, etcd_url  # noqa: F401 - fixtures
from tests.servers import RabbitMQServer, RedisServer, wait_for
from tests.workers import read_log

pytestmark = pytest.mark.timeout(180)

TTL = 2.0


class Cell:
    def __init__(
        self,
        tmp: Path,
        redis: RedisServer,
        pg_url: str,
        broker: str | None = None,
        store_url: str | None = None,
    ) -> None:
        celery_lease.migrate(pg_url)
        engine = create_engine(pg_url)
        with engine.begin() as conn:
            conn.execute(text(PROTECTED_DDL))
        engine.dispose()
        self.history = tmp / "history.jsonl"
        self.env = {
            "CHAOS_BROKER": broker or redis.url(0),
            "CHAOS_BACKEND": redis.url(1),
            "CHAOS_STORE": store_url or redis.url(2),
            "CHAOS_RESULTS": pg_url,
            "CHAOS_HISTORY": str(self.history),
            "CHAOS_TTL": str(TTL),
            "CHAOS_VT": "3600",
        }
        self.logdir = tmp
        self.app, self.tasks = build(self.env)
        self.store = LeaseStore.from_url(store_url or redis.url(2), key_prefix="celery-lease")
        self.workers: list[ChaosWorker] = []

    def restart_env(self, *, vt: float) -> None:
        """Change the visibility timeout (before any worker starts)."""
        assert not self.workers
        self.env["CHAOS_VT"] = str(vt)
        self.app, self.tasks = build(self.env)

    def worker(self, name: str, queues: str, skew: str | None = None) -> ChaosWorker:
        w = ChaosWorker(
            name, self.env, self.logdir, pool="prefork", concurrency=1, extra_args=("-Q", queues)
        )
        self.workers.append(w)
        w.launch(skew)
        w.wait_ready()
        return w

    def state(self, task_id: str) -> dict[str, Any]:
        meta: dict[str, Any] = self.app.backend.get_task_meta(task_id, cache=False)
        return meta

    def records(self, pred: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        return [r for r in read_log(self.history) if pred(r)]

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.store.close()


@pytest.fixture
def cell(
    tmp_path: Path, make_redis_server: Callable[..., RedisServer], pg_url: str
) -> Iterator[Cell]:
    c = Cell(tmp_path, make_redis_server(), pg_url)
    try:
        yield c
    finally:
        c.close()


def test_a_guard_refused_in_the_body_never_fails_its_task_id_while_a_copy_runs(
    cell: Cell,
) -> None:
    a = cell.worker("a", "qa")
    cell.worker("b", "qb")
    tid, key = str(uuid.uuid4()), f"guard-{uuid.uuid4().hex[:6]}"
    cell.tasks.exclusive.apply_async((key, 2.0, 0), task_id=tid, queue="qa")
    wait_for(lambda: cell.records(_is("start", tid)), 30, "A's body to start")
    a.stop_group()
    try:
        wait_for(lambda: not _live(cell, key), 10, "A's lease to expire in store time")
        # A copy of the same task id (a redelivery) takes over on B, for 4 s.
        cell.tasks.exclusive.apply_async((key, 4.0, 1), task_id=tid, queue="qb")
        wait_for(lambda: len(cell.records(_is("start", tid))) == 2, 30, "B's body to start")
    finally:
        a.cont_group()
    ends = wait_for(
        lambda: [r for r in cell.records(_is("end", tid)) if r["write"] == "refused"],
        30,
        "A's guarded write to be refused",
    )
    wait_for(
        lambda: [r for r in cell.records(_is("postrun", tid)) if r["pid"] == ends[0]["pid"]],
        30,
        "A's execution to end",
    )
    # B is still working: its task id must not read as failed meanwhile.
    assert not cell.records(_is("end", tid, pid_not=ends[0]["pid"]))
    assert cell.state(tid)["status"] == "PENDING"
    wait_for(lambda: cell.state(tid)["status"] == "SUCCESS", 30, "B's SUCCESS")
    assert cell.state(tid)["result"]["n"] == 1  # B's value
    assert f"FENCED {tid}" in a.log_text()


def _is(event: str, task_id: str, pid_not: int | None = None) -> Callable[[dict[str, Any]], bool]:
    return lambda r: r["ev"] == event and r["task_id"] == task_id and r["pid"] != pid_not


def _live(cell: Cell, key: str) -> bool:
    record = cell.store.inspect(key)
    return record is not None and record.live


@pytest.fixture
def etcd_cell(
    tmp_path: Path,
    make_redis_server: Callable[..., RedisServer],
    pg_url: str,
    request: pytest.FixtureRequest,
) -> Iterator[Cell]:
    """A cell whose leases live in etcd, a store with no clock a client can read."""
    c = Cell(tmp_path, make_redis_server(), pg_url, store_url=request.getfixturevalue("etcd_url"))
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize("store", ["redis", pytest.param("etcd", marks=pytest.mark.etcd)])
def test_a_deferral_published_by_a_worker_an_hour_fast_runs_on_time(
    request: pytest.FixtureRequest, store: str
) -> None:
    """With etcd leases the ETA comes from the PostgreSQL result database's
    clock (etcd answers none): on the old code it was the deferring worker's."""
    cell: Cell = request.getfixturevalue("cell" if store == "redis" else "etcd_cell")
    skewed = cell.worker("skewed", "qa", skew="+1h")
    b = cell.worker("b", "qb,qa")
    key = f"skew-{uuid.uuid4().hex[:6]}"
    first, second, blocker = (str(uuid.uuid4()) for _ in range(3))
    # B holds the key for 3 s; the skewed worker meets it and defers the second
    # task, then takes the blocker queued behind it (8 s, another key), so the
    # deferred copy, queued after the blocker, is B's to run.
    cell.tasks.exclusive.apply_async((key, 3.0, 0), task_id=first, queue="qb")
    wait_for(lambda: cell.records(_is("start", first)), 30, "the first body to start")
    cell.tasks.exclusive.apply_async((key, 0.1, 1), task_id=second, queue="qa")
    cell.tasks.exclusive.apply_async((f"{key}-b", 8.0, 2), task_id=blocker, queue="qa")
    wait_for(
        lambda: f"LEASE_DEFERRED {second}" in skewed.log_text(),
        30,
        "the skewed worker to defer the second task",
    )
    deferred_at = time.monotonic()
    wait_for(
        lambda: cell.state(second)["status"] == "SUCCESS",
        30,
        "the deferred task to run after the first one's lease, not an hour later",
    )
    assert time.monotonic() - deferred_at < 30
    assert f"chaos.exclusive[{second}] succeeded" in b.log_text()
    start = cell.records(_is("start", second))[0]
    assert start["mono"] > cell.records(_is("end", first))[0]["mono"]


def test_a_deferral_made_while_the_store_is_down_never_carries_a_skewed_eta(
    tmp_path: Path, make_redis_server: Callable[..., RedisServer], pg_url: str
) -> None:
    """With the lease store down no clock answers, and Celery turned the
    deferral's countdown into an ETA by the deferring worker's clock: a worker
    an hour fast held the copy an hour for every other worker (a chaos run
    left 41 copies so). The copy must carry no such ETA: it is published for
    now, with the delay in a header its receiver waits out."""
    broker, store = make_redis_server(), make_redis_server()
    cell = Cell(tmp_path, broker, pg_url, store_url=store.url(2))
    try:
        cell.env["CHAOS_STORE_RETRY"] = "0.5"
        skewed = cell.worker("skewed", "qa", skew="+1h")
        store.stop()
        task_id = str(uuid.uuid4())
        cell.tasks.exclusive.apply_async(
            (f"down-{task_id[:6]}", 0.1, 0), task_id=task_id, queue="qa"
        )
        wait_for(
            lambda: f"LEASE_DEFERRED {task_id}" in skewed.log_text(),
            30,
            "the skewed worker to defer the task while the store is down",
        )
        skewed.stop_group()  # the copy stays where the broker has it
        client = redis.Redis.from_url(broker.url(0))
        raw = client.lrange("qa", 0, -1) + list(client.hgetall("unacked").values())
        # The original delivery may still sit in "unacked" (the group was
        # stopped before its ack reached the broker): judge only the copies the
        # deferral published, which carry its defer id.
        copies = [
            m
            for m in map(_message, raw)
            if m["headers"].get("id") == task_id and m["headers"].get("lease_defer_id")
        ]
        assert copies, "the deferred copy is neither queued nor unacked"
        for copy in copies:
            eta = copy["headers"].get("eta")
            skew = None
            if eta is not None:
                from datetime import datetime

                skew = datetime.fromisoformat(eta).timestamp() - time.time()
            assert eta is None, f"the copy carries an ETA {skew:.0f} s ahead of the real clock"
            assert copy["headers"].get("lease_delay", 0) > 0
    finally:
        cell.close()


def _message(raw: bytes) -> dict[str, Any]:
    import json

    payload = json.loads(raw)
    if isinstance(payload, list):  # the unacked hash keeps [message, exchange, routing key]
        payload = payload[0]
    return payload  # type: ignore[no-any-return]


def test_a_worker_an_hour_fast_waits_out_an_early_deferred_copy(cell: Cell) -> None:
    # The other side of taking the ETA from the store's clock: a worker whose
    # clock runs an hour ahead gets the deferred copy at once (its ETA has long
    # passed by its clock); it must wait until the store's ETA, not defer again
    # and again as fast as the broker delivers.
    skewed = cell.worker("skewed", "qa", skew="+1h")
    cell.worker("b", "qb")
    key = f"fast-{uuid.uuid4().hex[:6]}"
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    cell.tasks.exclusive.apply_async((key, 3.0, 0), task_id=first, queue="qb")
    wait_for(lambda: cell.records(_is("start", first)), 30, "the first body to start")
    cell.tasks.exclusive.apply_async((key, 0.1, 1), task_id=second, queue="qa")
    wait_for(lambda: cell.state(second)["status"] == "SUCCESS", 30, "the deferred task")
    assert 1 <= skewed.log_text().count(f"LEASE_DEFERRED {second}") <= 3
    start = cell.records(_is("start", second))[0]
    end = cell.records(_is("end", first))[0]
    assert start["mono"] > end["mono"]  # after the first one, never beside it


def test_a_worker_dying_while_it_defers_a_task_never_loses_it(cell: Cell) -> None:
    """4. *A task was dropped as a duplicate of a copy that was never published.*
    Deferring, the plugin marked "a copy of this task id is queued" in the
    store, then published the copy; the worker killed in between left the
    marker without a copy, and the redelivered message (``acks_late``,
    ``task_reject_on_worker_lost``) was then dropped as a duplicate: the task
    was lost (the chaos run: a worker SIGKILL, then LEASE_REJECTED and no
    state, ever). The crash is placed exactly there by the chaos app's
    ``before_task_publish`` hook."""
    key = f"crash-{uuid.uuid4().hex[:6]}"
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    cell.env["CHAOS_CRASH_BEFORE_REPUBLISH"] = second
    a = cell.worker("a", "qa")
    cell.worker("b", "qb")
    # The first task holds the key long enough for the redelivered second one
    # to meet it too (A notices its dead child after a few seconds).
    cell.tasks.exclusive.apply_async((key, 10.0, 0), task_id=first, queue="qb")
    wait_for(lambda: cell.records(_is("start", first)), 30, "the first body to start")
    cell.tasks.exclusive.apply_async((key, 0.1, 1), task_id=second, queue="qa")
    wait_for(
        lambda: Path(f"{cell.history}.before-republish-{second}").exists(),
        30,
        "A's child to die while deferring the second task",
    )
    wait_for(lambda: "WorkerLostError" in a.log_text(), 30, "A to see its child die")
    wait_for(
        lambda: cell.state(second)["status"] == "SUCCESS",
        40,
        "the redelivered second task to be deferred and run, not dropped",
    )
    assert a.log_text().count(f"LEASE_DEFERRED {second}") >= 1  # it did meet the first
    start = cell.records(_is("start", second))[0]
    assert start["mono"] > cell.records(_is("end", first))[0]["mono"]


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
    wait_for(lambda: cell.records(_is("start", tid)), 30, "T's body to start")
    a.stop_group()
    try:
        wait_for(lambda: not _live(cell, key), 10, "T's lease to expire in store time")
        # The other task holds the key long enough for a copy of T to meet it.
        cell.tasks.exclusive.apply_async((key, 10.0, 1), task_id=other, queue="qb")
        wait_for(lambda: cell.records(_is("start", other)), 30, "the other task to take the key")
    finally:
        a.cont_group()
    wait_for(lambda: cell.state(tid)["status"] == "FAILURE", 30, "T to end fenced")
    assert type(cell.state(tid)["result"]).__name__ == "StaleFencingToken"
    # A copy of T on A meets the other task's live lease: the plugin defers it,
    # and the deferred copy comes back to A after the other task.
    assert _live(cell, key)
    cell.tasks.exclusive.apply_async((key, 0.1, 2), task_id=tid, queue="qa")
    wait_for(lambda: f"LEASE_DEFERRED {tid}" in a.log_text(), 30, "A to defer the copy of T")
    wait_for(lambda: cell.state(other)["status"] == "SUCCESS", 30, "the other task")
    outcome = wait_for(lambda: _late_copy_outcome(cell, a, tid), 30, "A to take the deferred copy")
    assert outcome == "rejected", "the deferred copy of T ran after T had ended FENCED"
    deferred = [r for r in cell.records(_is("prerun", tid)) if r["deferrals"] >= 1]
    assert deferred, "the rejected copy was the plugin's deferred copy"
    time.sleep(0.5)
    assert cell.state(tid)["status"] == "FAILURE"
    assert len(cell.records(_is("start", tid))) == 1  # never ran again
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
    wait_for(lambda: cell.records(_is("start", tid)), 30, "T's body to start")
    a.stop_group()
    try:
        wait_for(lambda: not _live(cell, key), 10, "T's lease to expire in store time")
        cell.tasks.exclusive.apply_async((key, 0.1, 1), task_id=other, queue="qb")
        wait_for(lambda: cell.state(other)["status"] == "SUCCESS", 30, "the other task")
        wait_for(lambda: _restored(cell, tid), 30, "the broker to restore T's message")
    finally:
        a.cont_group()
    outcome = wait_for(lambda: _late_copy_outcome(cell, a, tid), 30, "A to take the restored copy")
    assert outcome == "rejected", "the restored copy of T ran after T had ended FENCED"
    assert type(cell.state(tid)["result"]).__name__ == "StaleFencingToken"
    assert f"FENCED {tid}" in a.log_text()
    restored = [r for r in cell.records(_is("prerun", tid)) if r["redelivered"]]
    assert restored and restored[0]["deferrals"] == 0, "the rejected copy was the restored one"
    time.sleep(0.5)
    assert cell.state(tid)["status"] == "FAILURE"
    assert len(cell.records(_is("start", tid))) == 1  # never ran again


def _late_copy_outcome(cell: Cell, worker: ChaosWorker, task_id: str) -> str | None:
    if f"LEASE_REJECTED {task_id}" in worker.log_text():
        return "rejected"
    if len(cell.records(_is("start", task_id))) > 1:
        return "ran again"
    return None


def _holds_copy(cell: Cell, task_id: str) -> bool:
    """True while a deferred copy of ``task_id`` (it has a defer id) is unacked."""
    client = redis.Redis.from_url(cell.env["CHAOS_BROKER"])
    try:
        messages = [_message(v) for v in client.hvals("unacked")]
    finally:
        client.close()
    return any(
        m["headers"].get("id") == task_id and m["headers"].get("lease_defer_id") for m in messages
    )


def _restored(cell: Cell, task_id: str) -> bool:
    """True once the broker took ``task_id``'s message out of its unacked set.

    Only a restore does that while the worker holding the message is stopped
    (an ack would too, but a stopped worker acks nothing).
    """
    client = redis.Redis.from_url(cell.env["CHAOS_BROKER"])
    try:
        return not any(task_id.encode() in v for v in client.hvals("unacked"))
    finally:
        client.close()


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
    wait_for(lambda: cell.records(_is("start", tid)), 30, "A's body to start")
    a.stop_group()
    try:
        b = cell.worker("b", "qa")  # its restore sweep hands it T's message after 3 s
        started = wait_for(
            lambda: [r for r in cell.records(_is("start", tid)) if r["host"] == b.hostname],
            30,
            "B to run the restored copy of T",
        )
    finally:
        a.cont_group()
    wait_for(
        lambda: [r for r in cell.records(_is("postrun", tid)) if r["pid"] != started[0]["pid"]],
        30,
        "A's execution to end, fenced",
    )
    os.kill(started[0]["pid"], signal.SIGKILL)  # B's child, mid-body
    wait_for(
        lambda: cell.state(tid)["status"] == "SUCCESS",
        45,
        "T to be redone after its last execution died",
    )


def test_an_event_lost_with_its_broker_connection_never_fails_the_task(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    """3. *A deferred task ended FAILURE ConnectionError, then SUCCESS.* The
    LEASE_DEFERRED event was published on a pooled broker connection that
    the broker's restart had broken; redis-py's own ConnectionError (not a
    kombu error) escaped ``events.send`` after the copy was re-published, so
    the task id read FAILURE until its copy succeeded (the chaos run's
    backend monitor saw FAILURE ConnectionError -> SUCCESS)."""
    from celery import Celery

    from celery_lease import events

    broker = make_redis_server(appendonly=False)
    app = Celery("events-regression", broker=broker.url(0))
    events.send(app, events.LEASE_DEFERRED, task_id="t1", hostname="h")  # a pooled connection
    broker.kill()
    events.send(app, events.LEASE_DEFERRED, task_id="t2", hostname="h")  # must not raise


def test_a_deferral_the_broker_cannot_take_is_requeued_not_failed(
    tmp_path: Path, make_redis_server: Callable[..., RedisServer], pg_url: str
) -> None:
    """6. *A deferred task ended FAILURE OperationalError, then SUCCESS.* The
    broker (RabbitMQ, restarting) refused the deferral's re-publish; the
    error escaped, Celery stored FAILURE, and the message, never acked, came
    back and ran: FAILURE -> SUCCESS (the chaos run with ``--broker amqp``).
    A re-publish the broker cannot take now gives the message back
    (``Reject(requeue=True)``), backend untouched. The broker is stopped
    (``rabbitmqctl stop_app``) by the chaos app's hook, right before the
    re-publish."""
    try:
        rabbit = RabbitMQServer(tmp_path / "rabbit")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    rabbit.start()
    try:
        env = rabbit._env()
        script = tmp_path / "stop_app.sh"
        script.write_text(
            "#!/bin/sh\nexec env -i "
            + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
            + f" {shlex.quote(rabbit.ctl_bin)} -n {shlex.quote(rabbit.nodename)} stop_app\n"
        )
        script.chmod(0o755)
        cell = Cell(tmp_path, make_redis_server(), pg_url, broker=rabbit.url())
        monitor = BackendMonitor(cell.env["CHAOS_BACKEND"], tmp_path / "states.jsonl")
        monitor.start()
        key = f"nobroker-{uuid.uuid4().hex[:6]}"
        first, second = str(uuid.uuid4()), str(uuid.uuid4())
        cell.env["CHAOS_RUN_BEFORE_REPUBLISH"] = f"{second}:{script}"
        try:
            a = cell.worker("a", "qa")
            cell.worker("b", "qb")
            cell.tasks.exclusive.apply_async((key, 4.0, 0), task_id=first, queue="qb")
            wait_for(lambda: cell.records(_is("start", first)), 30, "the first body to start")
            cell.tasks.exclusive.apply_async((key, 0.1, 1), task_id=second, queue="qa")
            wait_for(
                lambda: any(
                    line in a.log_text()
                    for line in (
                        f"could not re-publish {second}",  # requeued
                        f"chaos.exclusive[{second}] raised unexpected",  # the bug
                    )
                ),
                60,
                "A to fail to re-publish the second task",
            )
            rabbit.ctl("start_app")
            wait_for(lambda: cell.state(second)["status"] == "SUCCESS", 90, "the second task")
            time.sleep(0.5)
            states = [b.state for b in monitor.states.get(second, [])]
            assert "FAILURE" not in states, states
        finally:
            monitor.stop()
            cell.close()
    finally:
        rabbit.cleanup()


def test_a_deferral_whose_publish_fails_inside_kombu_is_requeued_not_failed(
    tmp_path: Path, make_redis_server: Callable[..., RedisServer], pg_url: str
) -> None:
    """8. *A deferred task ended FAILURE AttributeError, then SUCCESS.* During a
    broker reconnect the deferral's re-publish failed inside kombu (``'NoneType'
    object has no attribute 'client'``), an error that is no connection or
    channel error; only those gave the message back, so this one escaped,
    Celery stored FAILURE, and a restored copy of the task later stored
    SUCCESS (the 3,000 s chaos run). Any error of the re-publish now gives
    the message back under ``acks_late``. The chaos app's hook makes the
    re-publish fail in kombu's own encoder (a header it cannot encode)."""
    cell = Cell(tmp_path, make_redis_server(), pg_url)
    monitor = BackendMonitor(cell.env["CHAOS_BACKEND"], tmp_path / "states.jsonl")
    monitor.start()
    key = f"unencodable-{uuid.uuid4().hex[:6]}"
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    cell.env["CHAOS_UNENCODABLE_REPUBLISH"] = second
    try:
        a = cell.worker("a", "qa")
        cell.worker("b", "qb")
        cell.tasks.exclusive.apply_async((key, 3.0, 0), task_id=first, queue="qb")
        wait_for(lambda: cell.records(_is("start", first)), 30, "the first body to start")
        cell.tasks.exclusive.apply_async((key, 0.1, 1), task_id=second, queue="qa")
        wait_for(
            lambda: Path(f"{cell.history}.unencodable-{second}").exists(),
            30,
            "A to re-publish the second task with the unencodable header",
        )
        wait_for(
            lambda: any(
                line in a.log_text()
                for line in (
                    f"could not re-publish {second}",  # requeued
                    f"chaos.exclusive[{second}] raised unexpected",  # the bug
                )
            ),
            30,
            "the re-publish to fail",
        )
        assert "TypeError" in a.log_text()  # kombu's encoder, not the transport
        wait_for(
            lambda: {"SUCCESS", "FAILURE"} & {b.state for b in monitor.states.get(second, [])},
            60,
            "the monitor to see the second task end",
        )
        states = [b.state for b in monitor.states.get(second, [])]
        assert "FAILURE" not in states, states
    finally:
        monitor.stop()
        cell.close()


def test_twin_copies_of_a_deferred_task_made_by_a_restore_do_not_both_go_on(
    cell: Cell,
) -> None:
    """9. *Copies of a task id multiplied: 19,743 deliveries for 1,252 tasks.*
    The Redis transport restores a deferred copy held past its visibility
    timeout while the worker holding it still has it: two identical copies.
    Both found the deferral marker naming their (shared) defer id, both
    re-published, and every later restore doubled them again, until the
    task ran. Each copy now has its own defer id and the marker moves to one
    twin's successor only (compare-and-set); the other is dropped at its next
    deferral. The twins are made as the chaos run made them: A is stopped,
    holding the deferred copy, past the visibility timeout, and B's restore
    sweep puts the copy back."""
    cell.restart_env(vt=3.0)
    a = cell.worker("a", "qa")
    cell.worker("b", "qb")  # holds the key, and runs the restore sweep
    key = f"twins-{uuid.uuid4().hex[:6]}"
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    cell.tasks.exclusive.apply_async((key, 16.0, 0), task_id=first, queue="qb")
    wait_for(lambda: cell.records(_is("start", first)), 30, "the first body to start")
    cell.tasks.exclusive.apply_async((key, 0.1, 1), task_id=second, queue="qa")
    wait_for(lambda: f"LEASE_DEFERRED {second}" in a.log_text(), 30, "A to defer the second task")
    wait_for(lambda: _holds_copy(cell, second), 30, "A to take the deferred copy (unacked)")
    a.stop_group()  # holding the deferred copy, unacked
    try:
        wait_for(lambda: _restored(cell, second), 30, "the broker to restore the deferred copy")
    finally:
        a.cont_group()

    def twins() -> list[str]:
        ids = [r["defer_id"] for r in cell.records(_is("prerun", second)) if r["defer_id"]]
        return sorted({i for i in ids if ids.count(i) > 1})

    twin = wait_for(lambda: twins(), 30, "both copies of one defer id to be delivered")[0]
    drop = f"LEASE_REJECTED {second}"
    wait_for(
        lambda: drop in a.log_text() or cell.records(_is("end", first)),
        30,
        "one twin's line to be dropped",
    )
    assert drop in a.log_text(), "both twins' copies went on deferring until the key was free"
    assert "a deferred copy is already queued" in a.log_text()
    wait_for(lambda: cell.state(second)["status"] == "SUCCESS", 60, "the second task")
    assert len(cell.records(_is("start", second))) == 1
    # The twins' two successors arrive together one deferral (<= 1.5 s: half
    # the visibility timeout) later, and one is dropped; from then on, one
    # line: no two deliveries of the task id at once.
    deliveries = [r["mono"] for r in cell.records(_is("prerun", second))]
    twins_at = max(r["mono"] for r in cell.records(_is("prerun", second)) if r["defer_id"] == twin)
    later = [t for t in deliveries if t > twins_at + 2.5]
    close = [round(b - a_, 3) for a_, b in itertools.pairwise(later) if b - a_ < 0.5]
    assert len(later) >= 2, f"too few deliveries after the twins to judge: {deliveries}"
    assert not close, f"copies delivered together after the drop: {later}"


def test_a_deferred_copy_whose_markers_were_never_written_goes_on(
    tmp_path: Path, make_redis_server: Callable[..., RedisServer], pg_url: str
) -> None:
    """10. *A probe was dropped as a duplicate of itself* (a 600 s chaos run of
    the one-id-per-copy deferral). With the lease store refusing writes
    (Redis OOM; a READONLY replica after a failover) but still answering
    reads, two deferrals in a row published their copy and could not move
    the marker; the third copy met the marker of two copies back, took it
    for another copy's and was dropped: the task was lost. A copy now
    carries the marker value its publisher read, so it goes on under
    whatever marker is left. Here the key is held by a lease the test
    claimed (every copy defers behind it, a 3 s countdown: half the 6 s
    visibility timeout), and the store answers OOM to writes for two of
    the deferrals (its claim script, meeting a busy key, writes nothing)."""
    broker, store = make_redis_server(), make_redis_server()
    cell = Cell(tmp_path, broker, pg_url, store_url=store.url(2))
    cell.restart_env(vt=6.0)
    admin = redis.Redis.from_url(store.url(0))
    try:
        a = cell.worker("a", "qa")
        key = f"oom-{uuid.uuid4().hex[:6]}"
        held = cell.store.claim(key, ttl=90.0)
        assert held is not None
        second = str(uuid.uuid4())
        cell.tasks.exclusive.apply_async((key, 0.1, 1), task_id=second, queue="qa")

        def deferrals() -> int:
            return a.log_text().count(f"LEASE_DEFERRED {second}")

        wait_for(lambda: deferrals() >= 1, 30, "a first deferral, behind the held key")
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", str(max(1, used // 2)))
        try:
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                admin.set("celery-lease-test:oom-probe", "x")  # the fault is on
            wait_for(lambda: deferrals() >= 3, 30, "two deferrals while the store refuses writes")
        finally:
            admin.config_set("maxmemory", "0")
        dropped = "a deferred copy is already queued"
        wait_for(
            lambda: deferrals() >= 4 or dropped in a.log_text(),
            30,
            "the next copy to meet the held key",
        )
        assert dropped not in a.log_text(), "the copy was dropped: the task is lost"
        assert cell.store.release(held)
        wait_for(lambda: cell.state(second)["status"] == "SUCCESS", 30, "the second task")
        assert len(cell.records(_is("start", second))) == 1
    finally:
        admin.close()
        cell.close()


def test_an_amqp_broker_without_publisher_confirms_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """7. *RabbitMQ lost deferred tasks.* A deferral re-publishes the task and
    acks the message it came in; a copy published (unconfirmed) a few hundred
    ms before RabbitMQ was SIGKILLed was gone after the restart, and with it
    the task (the chaos run with ``--broker amqp``: two tasks never ended).
    Only publisher confirms make the hand-over safe; the chaos app now sets
    ``confirm_publish`` and the worker warns at start when it is off."""
    from celery import Celery

    from celery_lease.signals import warn_unconfirmed_publish

    app = Celery("confirms", broker="amqp://guest:guest@127.0.0.1:1//")
    with caplog.at_level("WARNING", logger="celery_lease.signals"):
        assert warn_unconfirmed_publish(app)
    assert "confirm_publish" in caplog.text
    app.conf.broker_transport_options = {"confirm_publish": True}
    assert not warn_unconfirmed_publish(app)
    assert not warn_unconfirmed_publish(Celery("redis", broker="redis://127.0.0.1:1/0"))
    assert build({"CHAOS_BROKER": "amqp://guest:guest@127.0.0.1:1//"})[0].conf[
        "broker_transport_options"
    ] == {"confirm_publish": True}


def test_two_threads_counting_for_the_first_time_make_one_metric() -> None:
    """9. *A task failed with prometheus-client's DuplicateTimeseries.* Metrics
    are made on first use; in a ``-P threads`` worker (and between a task and
    the renewal thread) two threads could both find a metric unmade and both
    register it: the second registration raised inside the task, which ended
    FAILURE (a CI-sized chaos run: FAILURE DuplicateTimeseries -> SUCCESS).
    The slow registration below widens the window the race needs."""
    import threading

    prometheus_client = pytest.importorskip("prometheus_client")
    from celery_lease.metrics import _Lazy

    registry = prometheus_client.CollectorRegistry()
    made = []

    def make(p: Any) -> Any:
        time.sleep(0.05)
        made.append(1)
        return p.Counter("chaos_regression_total", "doc", registry=registry)

    metric = _Lazy(make)
    errors: list[BaseException] = []
    go = threading.Barrier(8)

    def count() -> None:
        go.wait()
        try:
            metric.inc()
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=count) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(made) == 1
    assert registry.get_sample_value("chaos_regression_total") == 8
