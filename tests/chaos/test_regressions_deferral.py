"""Regression tests for the chaos suite's bugs about deferrals, replayed deterministically.

2. *A deferral published by a worker whose clock is skewed waited an hour.*
   The plugin re-published a deferred task with ``countdown``, which Celery
   turns into an ETA by the publishing worker's clock; a worker under
   ``faketime -f '+1h'`` so made every other worker hold the copy for an
   hour (the chaos run ended with tasks stuck behind such ETAs). The ETA
   must come from the lease store's clock; and a receiver whose clock runs
   ahead (so the ETA passes too soon) waits out the rest before claiming.
4. *a worker dying while it deferred a task lost the task*; and the twin
   copies a restore makes of a deferred task, and a deferred copy whose
   markers were never written.

Real workers on private servers: :mod:`tests.chaos.regression_cell`. The
bugs are numbered across the three ``test_regressions_*`` modules.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.chaos import aof
from tests.chaos.regression_cell import (
    Cell,
    holds_copy,
    is_event,
    message_of,
    message_restored,
)
from tests.servers import RedisServer, wait_for

pytestmark = pytest.mark.timeout(180)


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
    wait_for(lambda: cell.records(is_event("start", first)), 30, "the first body to start")
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
    start = cell.records(is_event("start", second))[0]
    assert start["mono"] > cell.records(is_event("end", first))[0]["mono"]


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
        # Judge every copy the deferral published, from the broker's own AOF
        # (fsync'd before the publish returned, so before LEASE_DEFERRED was
        # logged), not from where the copies are now: the worker goes on
        # consuming "qa", and kombu's Redis transport holds a copy it popped in
        # neither the queue nor "unacked" until its second round trip.
        copies = published_copies(broker, "qa", task_id)
        assert copies, "the broker never received a deferred copy"
        for copy in copies:
            eta = copy["headers"].get("eta")
            skew = None
            if eta is not None:
                skew = datetime.fromisoformat(eta).timestamp() - time.time()
            assert eta is None, f"the copy carries an ETA {skew:.0f} s ahead of the real clock"
            assert copy["headers"].get("lease_delay", 0) > 0
    finally:
        cell.close()


def published_copies(broker: RedisServer, queue: str, task_id: str) -> list[dict[str, Any]]:
    """The messages of ``task_id`` a deferral pushed on ``queue``, from the AOF."""
    files, _ = aof.aof_files(broker.data_dir)
    pushed = [
        message_of(payload)
        for f in files
        for cmd in aof.read_commands(f)
        if cmd[0].upper() in (b"LPUSH", b"RPUSH") and cmd[1] == queue.encode()
        for payload in cmd[2:]  # a push may carry several
    ]
    return [
        m
        for m in pushed
        if m["headers"].get("id") == task_id and m["headers"].get("lease_defer_id")
    ]


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
    wait_for(lambda: cell.records(is_event("start", first)), 30, "the first body to start")
    cell.tasks.exclusive.apply_async((key, 0.1, 1), task_id=second, queue="qa")
    wait_for(lambda: cell.state(second)["status"] == "SUCCESS", 30, "the deferred task")
    assert 1 <= skewed.log_text().count(f"LEASE_DEFERRED {second}") <= 3
    start = cell.records(is_event("start", second))[0]
    end = cell.records(is_event("end", first))[0]
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
    wait_for(lambda: cell.records(is_event("start", first)), 30, "the first body to start")
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
    start = cell.records(is_event("start", second))[0]
    assert start["mono"] > cell.records(is_event("end", first))[0]["mono"]


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
    wait_for(lambda: cell.records(is_event("start", first)), 30, "the first body to start")
    cell.tasks.exclusive.apply_async((key, 0.1, 1), task_id=second, queue="qa")
    wait_for(lambda: f"LEASE_DEFERRED {second}" in a.log_text(), 30, "A to defer the second task")
    wait_for(lambda: holds_copy(cell, second), 30, "A to take the deferred copy (unacked)")
    a.stop_group()  # holding the deferred copy, unacked
    try:
        wait_for(
            lambda: message_restored(cell, second), 30, "the broker to restore the deferred copy"
        )
    finally:
        a.cont_group()

    def twins() -> list[str]:
        ids = [r["defer_id"] for r in cell.records(is_event("prerun", second)) if r["defer_id"]]
        return sorted({i for i in ids if ids.count(i) > 1})

    twin = wait_for(lambda: twins(), 30, "both copies of one defer id to be delivered")[0]
    drop = f"LEASE_REJECTED {second}"
    wait_for(
        lambda: drop in a.log_text() or cell.records(is_event("end", first)),
        30,
        "one twin's line to be dropped",
    )
    assert drop in a.log_text(), "both twins' copies went on deferring until the key was free"
    assert "a deferred copy is already queued" in a.log_text()
    wait_for(lambda: cell.state(second)["status"] == "SUCCESS", 60, "the second task")
    assert len(cell.records(is_event("start", second))) == 1
    # The twins' two successors arrive together one deferral (<= 1.5 s: half
    # the visibility timeout) later, and one is dropped; from then on, one
    # line: no two deliveries of the task id at once.
    deliveries = [r["mono"] for r in cell.records(is_event("prerun", second))]
    twins_at = max(
        r["mono"] for r in cell.records(is_event("prerun", second)) if r["defer_id"] == twin
    )
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
        assert len(cell.records(is_event("start", second))) == 1
    finally:
        admin.close()
        cell.close()
