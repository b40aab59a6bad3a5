"""``LeasedTask`` end to end: real ``celery worker`` processes, real servers, real faults.

Every test runs workers of ``tests/apps/leaseapp.py`` in subprocesses (prefork,
``acks_late``, ``task_reject_on_worker_lost``) against a private Redis broker and
result backend, a lease store (Redis or PostgreSQL) and the fenced result table
in PostgreSQL. Task bodies write an independent, fsync'd execution log (one
``start`` and one ``end`` line per body, with task id, token, pid, hostname),
so executions are counted without trusting the plugin's own tables.

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
4. Basics: conflict policies (defer, reject), ``once`` duplicates (reject,
   return), a late redelivery of an accepted task id, ``lease_commit=False``, a
   non-JSON return value, ``self.retry()``.

Backend states are read uncached (``get_task_meta(cache=False)``): a client's
``AsyncResult`` keeps the first final state it saw.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kombu
import pytest
from sqlalchemy import Engine, create_engine, text

import celery_lease
from celery_lease import (
    DuplicateResult,
    LeaseNotAcquired,
    LeaseRecord,
    LeaseStore,
    ResultNotSerializable,
    StaleFencingToken,
)
from celery_lease.results import ResultTable
from tests.apps.leaseapp import build
from tests.servers import RedisServer, wait_for
from tests.workers import Worker, _state, read_log

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

#: Lease TTL of the fault tests (seconds): short, so leases lapse quickly.
TTL = 2.0


# --------------------------------------------------------------------------
# the cluster of one test: servers, client app, workers, logs
# --------------------------------------------------------------------------


class Cluster:
    """Broker + backend + lease store + result table + execution log + workers."""

    def __init__(
        self,
        logdir: Path,
        *,
        broker: str,
        backend: str,
        store_url: str,
        results_url: str,
        ttl: float,
        vt: float | None = None,
        store_options: dict[str, Any] | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.logdir = logdir
        self.store_url = store_url
        self.store_options = store_options or {}
        self.results_url = results_url
        self.ttl = ttl
        self.exec_log = logdir / f"exec-{uuid.uuid4().hex[:8]}.log"
        self.env = {
            "CL_BROKER": broker,
            "CL_BACKEND": backend,
            "CL_STORE": store_url,
            "CL_RESULTS": results_url,
            "CL_TTL": str(ttl),
            "CL_LOG": str(self.exec_log),
        }
        if vt is not None:
            self.env["CL_VT"] = str(vt)
        conf = dict(settings or {})
        if self.store_options:
            conf["lease_store_options"] = self.store_options
        if conf:
            self.env["CL_SETTINGS"] = json.dumps(conf)
        self.app, self.tasks = build(self.env)
        self.workers: list[Worker] = []
        self._store: LeaseStore | None = None
        self._table: ResultTable | None = None

    # -- workers ---------------------------------------------------------

    def worker(self, name: str, *, queue: str | None = None, concurrency: int = 1) -> Worker:
        extra = ("-Q", queue) if queue else ()
        w = Worker(name, self.env, self.logdir, concurrency=concurrency, extra_args=extra)
        self.workers.append(w)
        return w

    def start(self, *workers: Worker) -> None:
        """Start the workers side by side (each waits for its own "ready")."""
        with ThreadPoolExecutor(len(workers)) as pool:
            list(pool.map(lambda w: w.start(), workers))

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        # Drop the test's AsyncResults while the backend still answers: their
        # __del__ unsubscribes from it.
        gc.collect()
        self.app.close()

    # -- the lease store and the result table, as a client sees them -------

    @property
    def store(self) -> LeaseStore:
        if self._store is None:
            self._store = LeaseStore.from_url(self.store_url, **self.store_options)
        return self._store

    @property
    def table(self) -> ResultTable:
        if self._table is None:
            self._table = ResultTable(self.results_url)
        return self._table

    # -- the execution log ---------------------------------------------------

    def rows(self, event: str, task_id: str) -> list[dict[str, Any]]:
        return [
            r for r in read_log(self.exec_log) if r["event"] == event and r["task_id"] == task_id
        ]

    def starts(self, task_id: str) -> list[dict[str, Any]]:
        return self.rows("start", task_id)

    def ends(self, task_id: str) -> list[dict[str, Any]]:
        return self.rows("end", task_id)

    def wait_start(self, task_id: str, n: int = 1, timeout: float = 20.0) -> dict[str, Any]:
        """The ``n``-th body start of ``task_id`` (waits for it)."""
        rows = wait_for(
            lambda: (lambda s: s if len(s) >= n else None)(self.starts(task_id)),
            timeout,
            f"body start #{n} of {task_id}",
        )
        return rows[n - 1]

    def worker_logs(self) -> str:
        return "".join(w.log_text() for w in self.workers)


@pytest.fixture(scope="module")
def pg_results(pg_url: str) -> str:
    """The module's PostgreSQL database with celery-lease's tables."""
    celery_lease.migrate(pg_url)
    return pg_url


@pytest.fixture
def make_cluster(
    tmp_path: Path, make_redis_server: Callable[..., RedisServer], pg_results: str
) -> Iterator[Callable[..., Cluster]]:
    """``make_cluster(store="redis"|"pg", ttl=, vt=, results_url=)``: a private Redis
    (broker db 0, backend db 1, lease store db 2 when ``store="redis"``), results in
    PostgreSQL (or ``results_url``); every worker is killed after the test."""
    made: list[Cluster] = []

    def make(
        store: str = "redis",
        *,
        ttl: float = TTL,
        vt: float | None = None,
        results_url: str | None = None,
    ) -> Cluster:
        redis = make_redis_server(appendonly=False)
        cluster = Cluster(
            tmp_path,
            broker=redis.url(0),
            backend=redis.url(1),
            store_url=redis.url(2) if store == "redis" else pg_results,
            results_url=results_url or pg_results,
            ttl=ttl,
            vt=vt,
        )
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


def new_key(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def lapsed(store: LeaseStore, key: str) -> LeaseRecord | None:
    """The key's record once no live lease holds it (expired in store time)."""
    rec = store.inspect(key)
    return rec if rec is not None and not rec.live else None


def gone(pid: int) -> bool:
    """True once ``pid`` exited and was reaped (no /proc entry) or is a zombie."""
    return _state(pid) in ("?", "Z")


def backend_state(c: Cluster, task_id: str) -> tuple[str, Any]:
    """State and result of ``task_id`` as the result backend holds it now (not cached)."""
    meta = c.app.backend.get_task_meta(task_id, cache=False)
    result = meta.get("result")
    if meta.get("status") == "FAILURE":
        result = c.app.backend.exception_to_python(result)
    return meta.get("status"), result


def in_log(worker: Worker, text: str) -> Callable[[], bool]:
    return lambda: text in worker.log_text()


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


def kill_child(worker: Worker, pid: int) -> float:
    """SIGKILL ``pid`` (a prefork child of ``worker``); returns when it is proven dead."""
    assert pid in worker.children(), f"{pid} is not a child of {worker.name}"
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: gone(pid) and pid not in worker.children(), 10, f"child {pid} to die")
    wait_for(in_log(worker, "signal 9 (SIGKILL)"), 10, f"{worker.name} to notice the lost child")
    return killed_at


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


# --------------------------------------------------------------------------
# 4. basics: one worker (2 children) shared by the module, Redis store, PG results
# --------------------------------------------------------------------------

#: databases of the session's Redis used by the basics cluster (broker, backend, store)
BASICS_DBS = (61, 62, 63)


@pytest.fixture(scope="module")
def basics(
    redis_server: RedisServer, pg_results: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Cluster, Worker]]:
    redis_server.ensure_running()
    for db in BASICS_DBS:
        redis_server.flushdb(db)
    broker, backend, store = (redis_server.url(db) for db in BASICS_DBS)
    c = Cluster(
        tmp_path_factory.mktemp("basics"),
        broker=broker,
        backend=backend,
        store_url=store,
        results_url=pg_results,
        ttl=TTL,
    )
    w = c.worker("basics", concurrency=2)
    try:
        c.start(w)
        yield c, w
    finally:
        c.close()


def test_conflict_defer_runs_after_the_holder_with_a_larger_token(
    basics: tuple[Cluster, Worker],
) -> None:
    c, w = basics
    key = new_key("defer")
    t1 = c.tasks.work.apply_async((key,), {"sleep": 1.5, "tag": "first"})
    c.wait_start(t1.id)
    t2 = c.tasks.work.apply_async((key,), {"tag": "second"})
    wait_for(in_log(w, f"LEASE_DEFERRED {t2.id}"), 10, "the second submission to be deferred")
    v1 = t1.get(timeout=20)
    v2 = t2.get(timeout=20)
    assert v2["token"] > v1["token"] and v2["tag"] == "second"
    (s2,) = c.starts(t2.id)
    (e1,) = c.ends(t1.id)
    assert s2["t"] > e1["t"], "the deferred task ran after the holder's body"
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [
        (v2["token"], t2.id),
        (v1["token"], t1.id),
    ]


def test_conflict_reject_raises_lease_not_acquired(basics: tuple[Cluster, Worker]) -> None:
    c, w = basics
    key = new_key("reject")
    t1 = c.tasks.work_reject.apply_async((key,), {"sleep": 1.5, "tag": "holder"})
    s1 = c.wait_start(t1.id)
    t2 = c.tasks.work_reject.apply_async((key,), {"tag": "late"})
    with pytest.raises(LeaseNotAcquired) as info:
        t2.get(timeout=20)
    assert type(info.value).__name__ == "LeaseNotAcquired" and key in str(info.value)
    assert backend_state(c, t2.id)[0] == "FAILURE"
    wait_for(in_log(w, f"LEASE_REJECTED {t2.id}"), 10, "the conflict to be logged")
    assert t1.get(timeout=20)["token"] == s1["token"]
    assert not c.starts(t2.id)
    assert [r.task_id for r in c.table.history(key)] == [t1.id]


@pytest.mark.parametrize("policy", ["reject", "return"])
def test_once_mode_duplicate(basics: tuple[Cluster, Worker], policy: str) -> None:
    c, w = basics
    task = c.tasks.work_once if policy == "reject" else c.tasks.work_once_return
    key = new_key(f"once-{policy}")
    t1 = task.apply_async((key,), {"tag": "first"})
    v1 = t1.get(timeout=20)
    t2 = task.apply_async((key,), {"tag": "second"})
    if policy == "reject":
        with pytest.raises(DuplicateResult) as info:
            t2.get(timeout=20)
        assert type(info.value).__name__ == "DuplicateResult"
        assert key in str(info.value) and str(v1["token"]) in str(info.value)
        assert backend_state(c, t2.id)[0] == "FAILURE"
    else:
        assert t2.get(timeout=20) == v1
        assert backend_state(c, t2.id) == ("SUCCESS", v1)
    wait_for(in_log(w, f"LEASE_REJECTED {t2.id}"), 10, "the duplicate to be rejected")
    assert not c.starts(t2.id), "a duplicate never runs its body"
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [(v1["token"], t1.id)]


def test_late_redelivery_of_an_accepted_task_id_is_not_executed(
    basics: tuple[Cluster, Worker],
) -> None:
    c, w = basics
    key = new_key("late")
    t1 = c.tasks.work.apply_async((key,), {"tag": "x"})
    v1 = t1.get(timeout=20)
    assert w.log_text().count(f"[{t1.id}] received") == 1

    # The same message again (same task id, same lease header), after the commit.
    c.app.send_task(
        "leaseapp.work",
        args=(key,),
        kwargs={"tag": "x"},
        task_id=t1.id,
        headers={"lease_keys": [key], "lease_tenant": None},
    )
    wait_for(
        lambda: w.log_text().count(f"[{t1.id}] received") == 2,
        10,
        "the worker to receive the late copy",
    )
    wait_for(in_log(w, f"LEASE_REJECTED {t1.id}"), 10, "the late copy to be rejected")
    assert backend_state(c, t1.id) == ("SUCCESS", v1)
    assert len(c.starts(t1.id)) == 1
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [(v1["token"], t1.id)]


def test_lock_only_returns_without_writing_a_result(basics: tuple[Cluster, Worker]) -> None:
    c, _ = basics
    key = new_key("lock-only")
    t = c.tasks.lock_only.apply_async((key,), {"tag": "lock"})
    value = t.get(timeout=20)
    (s,) = c.starts(t.id)
    assert value["token"] == s["token"]
    assert c.table.accepted(key) is None and c.table.for_task(t.id) is None
    rec = c.store.inspect(key)
    assert rec is not None and not rec.live and rec.token == s["token"], "released after the body"


def test_non_json_return_value_fails_naming_the_type_and_commits_nothing(
    basics: tuple[Cluster, Worker],
) -> None:
    c, _ = basics
    key = new_key("not-json")
    t = c.tasks.bad_return.apply_async((key,), {"tag": "bad"})
    with pytest.raises(ResultNotSerializable) as info:
        t.get(timeout=20)
    message = str(info.value)
    assert "set" in message and "leaseapp.bad_return" in message and "JSON" in message, message
    assert backend_state(c, t.id)[0] == "FAILURE"
    assert len(c.starts(t.id)) == 1 and len(c.ends(t.id)) == 1, "the body ran once"
    assert c.table.accepted(key) is None and c.table.for_task(t.id) is None
    rec = c.store.inspect(key)
    assert rec is not None and not rec.live, "the lease is released"


def test_retry_claims_again_with_a_newer_token(basics: tuple[Cluster, Worker]) -> None:
    c, w = basics
    key = new_key("retry")
    t = c.tasks.retry_once.apply_async((key,), {"tag": "r"})
    value = t.get(timeout=20)
    first, second = c.starts(t.id)
    assert second["token"] > first["token"]
    assert value["token"] == second["token"]
    assert f"leaseapp.retry_once[{t.id}] retry" in w.log_text()
    assert [(r.token, r.task_id) for r in c.table.history(key)] == [(second["token"], t.id)]
