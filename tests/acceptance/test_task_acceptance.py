"""``LeasedTask`` end to end: real ``celery worker`` processes, real servers, real faults.

Every test runs a cluster of :mod:`tests.acceptance.lease_cluster` (real
workers, a private Redis, a lease store, the fenced result table), which
counts executions from the bodies' own log. The basics (conflict policies,
``once``, lock-only, retry) are in ``test_task_basics.py``.

Each fault test first proves that the fault really happened (a process in
state ``T`` after SIGSTOP, a lease that really expired in store time, a child
pid that really died, a second worker that really received the redelivered
copy), then asserts the outcome. Everything waits by polling against a
deadline; nothing sleeps to synchronise.

1. The canonical timeline (DESIGN.md): A takes T1, is paused (SIGSTOP of its
   whole process group) past its TTL, B takes T2 on the same key with a larger
   token and commits; A resumes and its commit is FENCED: ``get()`` raises
   ``StaleFencingToken``, B's result is the accepted one, each body ran once.
   Also with A resuming while B still works.
2. A Redis ``visibility_timeout`` shorter than the task: the broker restores the
   message and a second worker receives it while the owner runs; the copy is
   deferred, the body runs once, the owner's SUCCESS stands.
3. SIGKILL of the prefork child: the work is redone with a newer token after the
   TTL; and a redelivered copy that met the live owner (and acked the owner's
   shared delivery tag) still gets the work done after the owner's child dies.
   And a copy of the task id that claims while the owner's commit is still in
   flight (lease released in Redis, result row not yet committed in PostgreSQL)
   must see that commit and not run again.

Backend states are read uncached (``get_task_meta(cache=False)``): a client's
``AsyncResult`` keeps the first final state it saw.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import kombu
import pytest
from sqlalchemy import Engine, create_engine, text

import celery_lease
from celery_lease import (
    StaleFencingToken,
)
from tests.acceptance.lease_cluster import (
    TTL,
    Cluster,
    backend_state,
    in_log,
    kill_child,
    lapsed,
    new_key,
)
from tests.servers import wait_for
from tests.workers import _state

#: The two visibility-timeout tests need the broker to restore the unacked
#: message while its owner still runs. kombu 5.7 restores on the transport
#: option ``unacked_restore_interval`` (1 s in tests/apps/leaseapp.py); with
#: kombu 5.6 (what Celery 5.3-5.5 install) no restore was seen within 39 s of
#: a 2 s visibility timeout, so the fault these tests need does not happen.
needs_prompt_restore = pytest.mark.skipif(
    tuple(int(x) for x in kombu.__version__.split(".")[:2]) < (5, 7),
    reason="kombu < 5.7 does not restore an unacked message within the test's time",
)

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------
# 1. the canonical timeline: SIGSTOP past the TTL, a newer owner, a fenced commit
# --------------------------------------------------------------------------


@pytest.mark.parametrize("resume", ["after-B-commits", "while-B-works"])
@pytest.mark.parametrize("mode", ["exclusive", "once"])
@pytest.mark.parametrize("store", ["redis", "pg"], ids=["redis+pg", "pg+pg"])
def test_canonical_timeline_paused_owner_is_fenced(
    make_cluster: Callable[..., Cluster], store: str, mode: str, resume: str
) -> None:
    c = make_cluster(store)
    a, b = c.worker("a", queue="qa"), c.worker("b", queue="qb")
    c.start(a, b)
    task = c.tasks.work if mode == "exclusive" else c.tasks.work_once
    key = new_key("payment-security")
    b_sleep = 1.0 if resume == "after-B-commits" else 5.0

    # A claims K and starts its body.
    t1 = task.apply_async((key,), {"sleep": 3.0, "tag": "A"}, queue="qa")
    s1 = c.wait_start(t1.id)
    assert s1["hostname"] == a.hostname
    assert s1["pid"] in a.children()

    # A pauses: its whole process group is stopped (proof: state T, main and child).
    a.stop_group()
    wait_for(lambda: _state(s1["pid"]) == "T", 10, "A's child stopped")
    assert _state(a.pid) == "T"
    held = c.store.inspect(key)
    assert held is not None and held.live and held.token == s1["token"], held
    assert held.task_id == t1.id

    # A's lease really expires in store time while A is paused (no newer grant yet).
    expired = wait_for(lambda: lapsed(c.store, key), c.ttl + 5, "A's lease to expire")
    assert expired.token == s1["token"]
    assert _state(a.pid) == "T" and _state(s1["pid"]) == "T"

    # B takes K over with a larger token (proof: the store names B's task and token).
    t2 = task.apply_async((key,), {"sleep": b_sleep, "tag": "B"}, queue="qb")
    s2 = c.wait_start(t2.id)
    assert s2["hostname"] == b.hostname
    assert s2["token"] > s1["token"]
    now_held = c.store.inspect(key)
    assert now_held is not None and now_held.token == s2["token"], now_held
    assert now_held.task_id == t2.id

    if resume == "after-B-commits":
        v2 = t2.get(timeout=20)
        assert _state(a.pid) == "T", "B must have committed while A was still paused"
        a.cont_group()
    else:
        assert not c.ends(t2.id), "B must still be working when A resumes"
        a.cont_group()

    # A's commit is refused: FAILURE with StaleFencingToken (Flower: FENCED).
    with pytest.raises(StaleFencingToken) as info:
        t1.get(timeout=20)
    assert type(info.value).__name__ == "StaleFencingToken"
    message = str(info.value)
    assert "stale fencing token" in message and str(s1["token"]) in message, message
    assert backend_state(c, t1.id)[0] == "FAILURE"
    wait_for(in_log(a, f"FENCED {t1.id}"), 10, "A's worker to log FENCED")

    # A's body ran to its end, but without its lease.
    (a_end,) = c.ends(t1.id)
    assert a_end["held"] is False and a_end["token"] == s1["token"]

    if resume == "while-B-works":
        assert backend_state(c, t2.id)[0] == "STARTED", "A was fenced while B still worked"
        v2 = t2.get(timeout=20)
        (b_end,) = c.ends(t2.id)
        assert a_end["t"] < b_end["t"]

    # B's result is the accepted one, and the only one.
    assert v2["token"] == s2["token"] and v2["tag"] == "B"
    accepted = c.table.accepted(key)
    assert accepted is not None
    assert (accepted.token, accepted.task_id, accepted.value) == (s2["token"], t2.id, v2)
    assert [r.token for r in c.table.history(key)] == [s2["token"]]
    assert c.table.for_task(t1.id) is None
    assert backend_state(c, t2.id) == ("SUCCESS", v2)

    # Each body ran exactly once.
    assert len(c.starts(t1.id)) == 1 and len(c.starts(t2.id)) == 1
    assert len(c.ends(t2.id)) == 1


# --------------------------------------------------------------------------
# 2. broker redelivery while the owner still runs (Redis visibility_timeout)
# --------------------------------------------------------------------------


@needs_prompt_restore
def test_visibility_timeout_redelivery_is_deferred_and_the_body_runs_once(
    make_cluster: Callable[..., Cluster],
) -> None:
    # Visibility timeout 2 s, lease TTL 3 s renewed every 1 s, body 8 s: the
    # broker restores the unacked message long before the owner is done.
    c = make_cluster("redis", ttl=3.0, vt=2.0)
    a, b = c.worker("a"), c.worker("b")
    c.start(a, b)
    key = new_key("vt")
    t1 = c.tasks.work.apply_async((key,), {"sleep": 8.0, "tag": "long"})
    s1 = c.wait_start(t1.id)
    owner, other = (a, b) if s1["hostname"] == a.hostname else (b, a)
    assert s1["pid"] in owner.children()

    # Proof of the redelivery: the other worker received this very task id while
    # the owner's body still runs, and deferred it (it met the live owner).
    wait_for(in_log(other, f"[{t1.id}] received"), 15, "the restored copy at the other worker")
    wait_for(in_log(other, f"LEASE_DEFERRED {t1.id}"), 10, "the other worker to defer it")
    assert not c.ends(t1.id), "the redelivery must have met the owner while it still ran"
    rec = c.store.inspect(key)
    assert rec is not None and rec.live and rec.token == s1["token"] and rec.task_id == t1.id

    # The owner's SUCCESS stands: its token, its pid.
    value = t1.get(timeout=30)
    assert value["token"] == s1["token"] and value["pid"] == s1["pid"]
    (end,) = c.ends(t1.id)
    assert end["held"] is True, "renewals kept the lease through an 8 s body with a 3 s TTL"

    # The copy still circulating is rejected once the owner's result is accepted,
    # without running and without touching the backend state.
    wait_for(lambda: f"LEASE_REJECTED {t1.id}" in c.worker_logs(), 15, "the copy to be rejected")
    assert backend_state(c, t1.id) == ("SUCCESS", value)
    assert len(c.starts(t1.id)) == 1
    history = c.table.history(key)
    assert [(r.token, r.task_id) for r in history] == [(s1["token"], t1.id)]


# --------------------------------------------------------------------------
# 3. SIGKILL of the prefork child running the task
# --------------------------------------------------------------------------


def test_sigkill_of_the_child_redoes_the_work_with_a_newer_token(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster("redis", ttl=3.0)
    a = c.worker("a")
    c.start(a)
    key = new_key("killed")
    t1 = c.tasks.work.apply_async((key,), {"sleep": 4.0, "tag": "x"})
    s1 = c.wait_start(t1.id)
    killed_at = kill_child(a, s1["pid"])
    assert not c.ends(t1.id), "the child died mid-body"

    # The requeued message meets the dead child's lease (deferred, not dropped)
    # or arrives after it ran out (a slow machine); either way the work is
    # redone once that lease ran out, with a newer token.
    s2 = c.wait_start(t1.id, n=2, timeout=c.ttl + 10)
    assert time.monotonic() - killed_at < c.ttl + 5
    assert s2["token"] > s1["token"] and s2["pid"] != s1["pid"]

    value = t1.get(timeout=20)
    assert value["token"] == s2["token"] and value["pid"] == s2["pid"]
    history = c.table.history(key)
    assert [(r.token, r.task_id, r.value) for r in history] == [(s2["token"], t1.id, value)]
    assert len(c.starts(t1.id)) == 2 and len(c.ends(t1.id)) == 1


@needs_prompt_restore
def test_redelivered_copy_deferred_by_the_live_owner_survives_the_owner_sigkill(
    make_cluster: Callable[..., Cluster],
) -> None:
    # The restored copy shares the owner's delivery tag: acking it (when it is
    # deferred) removes the owner's unacked entry too, so when the owner's child
    # is killed there is nothing left to requeue but the deferred copy.
    c = make_cluster("redis", ttl=3.0, vt=2.0)
    a, b = c.worker("a"), c.worker("b")
    c.start(a, b)
    key = new_key("vt-killed")
    t1 = c.tasks.work.apply_async((key,), {"sleep": 6.0, "tag": "x"})
    s1 = c.wait_start(t1.id)
    owner, other = (a, b) if s1["hostname"] == a.hostname else (b, a)
    wait_for(in_log(other, f"[{t1.id}] received"), 15, "the restored copy at the other worker")
    wait_for(in_log(other, f"LEASE_DEFERRED {t1.id}"), 10, "the other worker to defer it")
    assert not c.ends(t1.id), "the copy met the owner while it still ran"

    kill_child(owner, s1["pid"])
    assert not c.ends(t1.id), "the owner's child died mid-body"

    s2 = c.wait_start(t1.id, n=2, timeout=c.ttl + 15)
    assert s2["token"] > s1["token"]
    value = t1.get(timeout=30)
    assert value["token"] == s2["token"]
    history = c.table.history(key)
    assert [(r.token, r.task_id) for r in history] == [(s2["token"], t1.id)]
    assert len(c.starts(t1.id)) == 2 and len(c.ends(t1.id)) == 1


# --------------------------------------------------------------------------
# 3c. a copy of the task id claims while the owner's commit is in flight
# --------------------------------------------------------------------------


def pg_waiting(engine: Engine, like: str) -> int:
    """Sessions of this database blocked on a lock, running a statement that matches ``like``."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE :like"
                ),
                {"like": like},
            ).scalar_one()
        )


@pytest.mark.parametrize("mode", ["exclusive", "once"])
def test_redelivery_during_the_owners_commit_is_not_executed(
    make_cluster: Callable[..., Cluster], mode: str
) -> None:
    """Leases in Redis, results in PostgreSQL: the owner's commit releases the lease
    in Redis while its transaction (holding the key's fence row) is still open. A
    copy of the same task id that claims in that window must wait for the commit
    and then see it: rejected as a redelivery, the owner's SUCCESS untouched.

    The window is widened for real: the test holds a SHARE lock on the result
    table, so the owner's INSERT waits (as behind any slow statement)."""
    c = make_cluster("redis")
    w = c.worker("a", concurrency=2)
    c.start(w)
    task = c.tasks.work if mode == "exclusive" else c.tasks.work_once
    key = new_key(f"in-flight-{mode}")
    engine = create_engine(c.results_url)
    blocker = engine.connect()
    try:
        t1 = task.apply_async((key,), {"sleep": 0.5, "tag": "owner"})
        s1 = c.wait_start(t1.id)
        blocker.begin()
        blocker.exec_driver_sql("LOCK TABLE celery_lease_results IN SHARE MODE")

        # Proof of the window: the owner's INSERT waits on the lock, its lease is
        # already released in Redis, and no result is accepted yet.
        wait_for(
            lambda: pg_waiting(engine, "%INSERT INTO celery_lease_results%") == 1,
            10,
            "the owner's commit to wait on the result table",
        )
        rec = c.store.inspect(key)
        assert rec is not None and not rec.live and rec.token == s1["token"], rec
        assert c.ends(t1.id) and c.table.for_task(t1.id) is None

        # The copy: claims the free key, then its registration (with the look-up,
        # one call: celery_lease_register_lookup) waits on the fence row that the
        # owner's commit holds.
        c.app.send_task(
            task.name, args=(key,), kwargs={"sleep": 0.5, "tag": "owner"}, task_id=t1.id
        )
        wait_for(lambda: w.log_text().count(f"[{t1.id}] received") == 2, 10, "the copy to arrive")
        wait_for(
            lambda: pg_waiting(engine, "%celery_lease_register_lookup%") == 1,
            10,
            "the copy's registration to wait on the owner's commit",
        )
        copy = c.store.inspect(key)
        assert copy is not None and copy.live and copy.token > s1["token"], copy
        assert copy.task_id == t1.id
    finally:
        blocker.rollback()
        blocker.close()
        engine.dispose()
    value = t1.get(timeout=20)
    assert value["token"] == s1["token"] and value["pid"] == s1["pid"]

    wait_for(
        lambda: f"LEASE_REJECTED {t1.id}" in w.log_text() or len(c.starts(t1.id)) > 1,
        15,
        "the copy's outcome",
    )
    assert len(c.starts(t1.id)) == 1, "the copy ran the body of an accepted task again"
    wait_for(in_log(w, f"LEASE_REJECTED {t1.id}"), 10, "the copy to be rejected")
    assert backend_state(c, t1.id) == ("SUCCESS", value)
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [(s1["token"], t1.id)]


@pytest.mark.parametrize("t0_ended", ["accepted", "fenced"])
def test_a_fenced_task_is_requeued_when_a_late_copy_of_a_finished_task_holds_its_key(
    make_cluster: Callable[..., Cluster], t0_ended: str
) -> None:
    """T1's lease lapsed (its worker paused past the TTL) and a late copy of T0,
    a task that already ended, claimed the key meanwhile. T1's commit is
    refused; the copy's look-up will reject it (``prepare``: T0's result is
    accepted, or T0 ended FAILURE with a lease outcome) and it will release the
    key, so nobody newer does the key's work: T1 is re-queued and runs again,
    not failed (chaos, seed 11, the accepted case: T1 ended FAILURE
    StaleFencingToken with no newer result for its key). The test claims and
    registers the copy's lease as the copy's own claim does before its look-up.

    ``fenced``: T0 ended FENCED before any result of it was accepted; its
    backend state is written as the worker's ``not_done`` writes it
    (``mark_as_failure`` with ``StaleFencingToken``), the real backend."""
    c = make_cluster("redis")
    a = c.worker("a", queue="qa")
    c.start(a)
    task = c.tasks.work
    key = new_key("late-copy")
    history: list[tuple[int, str]] = []
    if t0_ended == "accepted":
        t0 = task.apply_async((key,), {"sleep": 0.1, "tag": "T0"}, queue="qa")
        v0 = t0.get(timeout=20)
        t0_id = t0.id
        history.append((v0["token"], t0_id))
    else:
        t0_id = str(uuid.uuid4())
        c.app.backend.mark_as_failure(
            t0_id, StaleFencingToken(key, 1, 2, "a newer owner committed first")
        )
        assert c.app.AsyncResult(t0_id).state == "FAILURE"

    t1 = task.apply_async((key,), {"sleep": 2.0, "tag": "T1"}, queue="qa")
    s1 = c.wait_start(t1.id)
    a.stop_group()
    wait_for(lambda: _state(s1["pid"]) == "T", 10, "A's child stopped")
    expired = wait_for(lambda: lapsed(c.store, key), c.ttl + 5, "T1's lease to expire")
    assert expired.token == s1["token"] and _state(s1["pid"]) == "T"

    late = c.store.claim(
        key, ttl=10.0, owner_id="late-copy-of-t0", meta={"task_id": t0_id, "task_name": task.name}
    )
    assert late is not None and late.token > s1["token"]
    c.table.register(late)
    a.cont_group()

    wait_for(in_log(a, f"FENCED {t1.id}"), 20, "T1's commit to be refused")
    # The copy held the key before and after T1 decided: T1 saw it live.
    holder = c.store.inspect(key)
    assert holder is not None and holder.live and holder.task_id == t0_id, holder
    # (A FAILURE is written before the FENCED event, so it would be there by now.)
    assert backend_state(c, t1.id)[0] != "FAILURE", "T1 failed with nobody left to do its work"

    assert c.store.release(late)  # the copy's look-up rejected it: it lets go
    v1 = t1.get(timeout=40)
    assert v1["token"] > late.token
    assert len(c.starts(t1.id)) == 2
    assert backend_state(c, t1.id) == ("SUCCESS", v1)
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [(v1["token"], t1.id), *history]


@pytest.mark.parametrize("results", ["postgresql", "sqlite"])
def test_a_commit_waiting_on_the_result_database_past_the_ttl_keeps_its_lease(
    make_cluster: Callable[..., Cluster], tmp_path: Path, results: str
) -> None:
    """Leases in Redis: the body has ended, and its commit waits for the result
    database's lock (a row lock on PostgreSQL; SQLite's one writer, as behind a
    hundred threads' commits) for three TTLs. The lease is renewed meanwhile, so
    the commit is accepted when the lock goes: the body ran once, no FENCED, no
    re-run of work that was done."""
    if results == "sqlite":
        results_url = f"sqlite:///{tmp_path / 'results.sqlite3'}"
        celery_lease.migrate(results_url)
    else:
        results_url = None
    c = make_cluster("redis", results_url=results_url)
    w = c.worker("a", concurrency=1)
    c.start(w)
    key = new_key("slow-commit")
    engine = create_engine(c.results_url)
    blocker = engine.connect()
    lite = (
        sqlite3.connect(results_url[len("sqlite:///") :], isolation_level=None)
        if results_url
        else None
    )
    try:
        t1 = c.tasks.work.apply_async((key,), {"sleep": 1.0, "tag": "owner"})
        s1 = c.wait_start(t1.id)
        if lite is not None:
            lite.execute("BEGIN IMMEDIATE")  # the database's one write lock
        else:
            blocker.begin()
            blocker.execute(
                text("SELECT 1 FROM celery_lease_fences WHERE resource = :k FOR UPDATE"),
                {"k": key},
            ).one()  # the key's fence row, registered before the body
        # The fault: the body ended and its commit waits on the lock.
        end = wait_for(lambda: (c.ends(t1.id) or [None])[0], 10, "the body's end")
        if results == "postgresql":
            wait_for(
                lambda: pg_waiting(engine, "%celery_lease_fences%FOR UPDATE%") == 1,
                10,
                "the owner's commit to wait on the fence row",
            )
        renewed_past_ttl = False
        while time.time() < end["t"] + 3 * TTL:
            rec = c.store.inspect(key)
            # Held by the owner the whole time: never expired, never taken over.
            assert rec is not None and rec.live and rec.token == s1["token"], rec
            assert rec.task_id == t1.id
            renewed_past_ttl = renewed_past_ttl or rec.expires_at > end["t"] + TTL + 0.5
            assert not t1.ready(), "the commit went through while the lock was held"
            time.sleep(0.2)
        assert renewed_past_ttl, "the lease was not renewed while the commit waited"
    finally:
        if lite is not None:
            lite.close()  # rolls the open transaction back
        blocker.rollback()
        blocker.close()
        engine.dispose()
    value = t1.get(timeout=20)
    assert value["token"] == s1["token"] and value["pid"] == s1["pid"]
    assert len(c.starts(t1.id)) == 1 and len(c.ends(t1.id)) == 1
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [(s1["token"], t1.id)]
    logs = w.log_text()
    assert "FENCED" not in logs and "LEASE_LOST" not in logs, logs[-3000:]
    rec = c.store.inspect(key)
    assert rec is None or not rec.live, "the commit did not release the lease"
