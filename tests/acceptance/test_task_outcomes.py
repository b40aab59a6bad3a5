"""What a task id ends as in the result backend when copies, crashes and outages meet.

Real ``celery -A tests.apps.tenantapp worker`` processes (prefork, ``acks_late``,
``task_reject_on_worker_lost``), a private Redis for the broker, the result
backend and the leases, a private PostgreSQL for the fenced result table.
Every test proves its fault happened (a child that died right after its
commit, a worker in state ``T`` past the TTL, a store that refuses
connections, deferrals counted in the worker's log) before it judges the
outcome; waits poll against deadlines.

1. A child SIGKILLed between the fenced commit and Celery's SUCCESS write:
   the redelivered copy finds its task id accepted and stores SUCCESS with the
   accepted value (the task never stays PENDING).
2. A stale copy (paused past its TTL while a redelivered copy of the same task
   id committed) that then raises, or calls ``self.retry()``, stores nothing:
   the winner's SUCCESS stands.
3. An outage of the lease store longer than ``lease_defer_max`` deferrals
   delays queued work, never fails it; waits behind a live copy of the same
   task id never spend the budget either.
4. ``task.accepted()`` needs only the arguments the key template names, or
   ``key=``.
5. A lost lease's event waits for the broker in a thread of its own: with the
   broker frozen, the renewal thread goes on renewing the process's other leases.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import celery_lease
from tests.sec_cluster import APP, Cluster, refused
from tests.servers import PostgresServer, RedisServer, wait_for
from tests.workers import Worker, _state

pytestmark = pytest.mark.timeout(150)

TTL = 2.0


@pytest.fixture
def cluster(
    tmp_path: Path,
    make_redis_server: Callable[..., RedisServer],
    make_pg_server: Callable[..., PostgresServer],
) -> Iterator[Callable[..., tuple[Cluster, RedisServer]]]:
    """``cluster(settings=, separate_store=)`` -> (Cluster, the lease store's Redis)."""
    made: list[Cluster] = []
    pg: list[PostgresServer] = []

    def make(
        *, settings: dict[str, Any] | None = None, separate_store: bool = False
    ) -> tuple[Cluster, RedisServer]:
        broker = make_redis_server(appendonly=False)
        store = make_redis_server(appendonly=True) if separate_store else broker
        if not pg:
            pg.append(make_pg_server())
        results = pg[0].create_database(f"outcomes_{uuid.uuid4().hex[:8]}")
        celery_lease.migrate(results)
        c = Cluster(
            tmp_path,
            broker=broker.url(0),
            backend=broker.url(1),
            store_url=store.url(2),
            results_url=results,
            ttl=TTL,
            settings=settings,
        )
        c.broker_server = broker  # type: ignore[attr-defined]
        arm_dir = tmp_path / "armed"
        arm_dir.mkdir(exist_ok=True)
        c.env["CL_ARM_DIR"] = str(arm_dir)
        made.append(c)
        return c, store

    yield make
    for c in made:
        c.close()


def _worker(c: Cluster, name: str, queue: str | None = None) -> Worker:
    extra = ("-Q", queue) if queue else ()
    w = Worker(name, c.env, c.logdir, app=APP, extra_args=extra)
    c.workers.append(w)
    return w.start()


def _key(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _gone(pid: int) -> bool:
    return _state(pid) in ("?", "Z")


# --------------------------------------------------------------------------
# 1. killed between the commit and the backend write
# --------------------------------------------------------------------------


def test_a_copy_stores_success_when_the_committer_died_before_the_backend_write(
    cluster: Callable[..., tuple[Cluster, RedisServer]],
) -> None:
    c, _ = cluster()
    w = _worker(c, "a")
    key = _key("die-after-commit")
    task_id = uuid.uuid4().hex
    (Path(c.env["CL_ARM_DIR"]) / task_id).touch()

    res = c.tasks.die_after_commit.apply_async((key,), {"tag": "first"}, task_id=task_id)
    committed = c.wait_row("committed", task_id)
    # The fault: the child that committed died before Celery stored SUCCESS.
    wait_for(lambda: _gone(committed["pid"]), 20, "the committing child to die")
    accepted = c.table.for_task(task_id)
    assert accepted is not None and accepted.value == committed["value"]
    assert not (Path(c.env["CL_ARM_DIR"]) / task_id).exists()

    # The message comes back (task_reject_on_worker_lost); the copy must not run
    # the body again, and must leave the backend saying what the table says.
    state, value = c.wait_state(task_id, ("SUCCESS", "FAILURE"), timeout=40)
    assert (state, value) == ("SUCCESS", accepted.value)
    assert res.get(timeout=5) == accepted.value
    assert len(c.rows("start", task_id)) == 1, "the body ran again"
    wait_for(lambda: f"LEASE_REJECTED {task_id}" in w.log_text(), 20, "the copy's rejection")
    assert c.store.inspect(key) is None or not c.store.inspect(key).live


# --------------------------------------------------------------------------
# 2. a stale copy that raises after the winner stored SUCCESS
# --------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["raise", "retry"])
def test_a_stale_copy_never_writes_the_state_of_a_task_id_another_copy_runs(
    cluster: Callable[..., tuple[Cluster, RedisServer]], how: str
) -> None:
    """Copy 1 of a task id pauses past its TTL; copy 2 (same id) takes the key
    over; copy 1 resumes while copy 2 still works and its body raises (or
    retries). Celery would store FAILURE (RETRY) for the task id while its work
    is still being done, and a caller's ``get()`` would raise: nothing may be
    stored by copy 1, and the task id ends SUCCESS with copy 2's value."""
    c, _ = cluster()
    a = _worker(c, "a", queue="qa")
    _worker(c, "b", queue="qb")
    key = _key("stale-copy")
    task_id = uuid.uuid4().hex
    tag = f"{how}:{a.hostname}"  # only the copy on A fails, after its body

    c.tasks.fail_on.apply_async((key,), {"sleep": 3.0, "tag": tag}, task_id=task_id, queue="qa")
    s1 = wait_for(lambda: c.rows("start", task_id) or None, 20, "A's start")[0]
    a.stop_group()
    expired = wait_for(
        lambda: (lambda r: r if r is not None and not r.live else None)(c.store.inspect(key)),
        TTL + 10,
        "A's lease to expire while A is paused",
    )
    assert expired.token == s1["token"] and _state(a.pid) == "T"

    # The same task id delivered again (to B): it takes the key over and works.
    c.tasks.fail_on.apply_async((key,), {"sleep": 6.0, "tag": tag}, task_id=task_id, queue="qb")
    s2 = wait_for(
        lambda: [r for r in c.rows("start", task_id) if r["token"] != s1["token"]] or None,
        20,
        "B's start",
    )[0]
    assert s2["token"] > s1["token"] and _state(a.pid) == "T"

    a.cont_group()
    # A's body ends, then it raises (or retries) without its lease, while B works.
    wait_for(
        lambda: [r for r in c.rows("end", task_id) if r["token"] == s1["token"]] or None,
        20,
        "A's body to end",
    )
    wait_for(lambda: f"LEASE_LOST {task_id}" in a.log_text(), 20, "A to report its lost lease")
    seen = []
    while not [r for r in c.rows("end", task_id) if r["token"] == s2["token"]]:
        seen.append(c.backend_state(task_id)[0])
        assert seen[-1] not in ("FAILURE", "RETRY"), (seen, a.log_text()[-3000:])
        time.sleep(0.05)
    state, value = c.wait_state(task_id, ("SUCCESS", "FAILURE", "RETRY"), timeout=30)
    assert state == "SUCCESS" and value["token"] == s2["token"], (state, value)
    accepted = c.table.for_task(task_id)
    assert accepted is not None and accepted.token == s2["token"]
    assert "late failure" not in a.log_text() or how == "raise"


# --------------------------------------------------------------------------
# 3. deferrals that must not count
# --------------------------------------------------------------------------


def test_a_lease_store_outage_longer_than_the_defer_budget_only_delays_work(
    cluster: Callable[..., tuple[Cluster, RedisServer]],
) -> None:
    c, store = cluster(
        settings={"lease_defer_max": 2, "lease_store_retry": 0.3}, separate_store=True
    )
    w = _worker(c, "a")
    store.stop()
    assert refused(store.port), "the lease store still answers"
    key = _key("outage")
    res = c.tasks.work.delay(key, sleep=0.1, tag="outage")
    # The fault outlasts the budget: more deferrals than lease_defer_max.
    wait_for(
        lambda: w.log_text().count(f"LEASE_DEFERRED {res.id}") > 3,
        60,
        "more than lease_defer_max deferrals while the store is down",
        abort=lambda: (lambda s: None if s[0] == "PENDING" else f"the outage ended it {s}")(
            c.backend_state(res.id)
        ),
    )
    assert refused(store.port)
    assert c.backend_state(res.id)[0] == "PENDING", c.backend_state(res.id)
    store.start()
    value = res.get(timeout=60)
    accepted = c.table.accepted(key)
    assert accepted is not None and accepted.task_id == res.id and accepted.value == value
    assert len(c.rows("start", res.id)) == 1


def test_waiting_behind_a_copy_of_the_same_task_id_spends_no_deferral(
    cluster: Callable[..., tuple[Cluster, RedisServer]],
) -> None:
    """The broker restores T1's message (visibility timeout) while A runs it; the
    restored copy, on B, defers behind A more often than the budget allows (and
    its ack removes A's unacked entry: the copy is T1's only crash cover). A's
    child then dies and another owner holds the key: the copy must still get T1
    done, not be rejected as "deferred too often"."""
    c, _ = cluster(settings={"lease_defer_max": 1})
    # Restored after 4 s; a deferred copy then waits up to 2 s (half of it).
    c.env["CL_VT"] = "4"
    a = _worker(c, "a", queue="q")
    key = _key("same-id")
    tag = f"slow:{a.hostname}"  # 40 s on A, 0.1 s for the copy that redoes it
    t1 = c.tasks.fail_on.apply_async((key,), {"sleep": 40.0, "tag": tag}, queue="q")
    s1 = wait_for(lambda: c.rows("start", t1.id) or None, 20, "A's start")[0]
    b = _worker(c, "b", queue="q")
    wait_for(
        lambda: c.worker_logs().count(f"LEASE_DEFERRED {t1.id}") >= 3,
        40,
        "the restored copy to defer behind A more often than lease_defer_max",
    )
    assert not c.rows("end", t1.id), "A must still be running"
    # A's child dies; another owner takes the key at once.
    os.kill(s1["pid"], signal.SIGKILL)
    wait_for(lambda: _gone(s1["pid"]), 10, "A's child to die")
    evicted = c.store.evict(key)
    assert evicted is not None and evicted.token == s1["token"]
    other = c.store.claim(key, owner_id="another-task", ttl=3.0)
    assert other is not None and other.token > s1["token"]
    # The copy meets that owner (an ordinary conflict), waits, and does T1.
    state, value = c.wait_state(t1.id, ("SUCCESS", "FAILURE"), timeout=60)
    assert state == "SUCCESS", (state, value, c.worker_logs()[-4000:])
    accepted = c.table.for_task(t1.id)
    assert accepted is not None and accepted.value == value
    assert accepted.token > other.token
    assert a.alive() and b.alive()


# --------------------------------------------------------------------------
# 4. reading a result by the arguments the key needs
# --------------------------------------------------------------------------


def test_accepted_binds_only_the_arguments_the_key_names(
    cluster: Callable[..., tuple[Cluster, RedisServer]],
) -> None:
    c, _ = cluster()
    _worker(c, "a")
    api_id = int(uuid.uuid4().int % 10**9)
    value = c.tasks.suite.delay(api_id, 0.05).get(timeout=30)
    by_field = c.tasks.suite.accepted(api_id=api_id)
    assert by_field is not None and by_field.value == value
    assert c.tasks.suite.accepted(api_id) == by_field
    assert c.tasks.suite.accepted(key=f"payment-security-{api_id}") == by_field
    assert c.tasks.suite.accepted(api_id=api_id + 1) is None
    with pytest.raises(celery_lease.LeaseConfigError, match="needs argument 'api_id'"):
        c.tasks.suite.accepted(work_s=1.0)


# --------------------------------------------------------------------------
# 5. a frozen broker does not stall the renewal thread
# --------------------------------------------------------------------------


def test_a_frozen_broker_never_stalls_the_renewal_of_other_leases(
    cluster: Callable[..., tuple[Cluster, RedisServer]],
) -> None:
    c, _ = cluster(separate_store=True)
    broker: RedisServer = c.broker_server  # type: ignore[attr-defined]
    w = Worker("t", c.env, c.logdir, app=APP, pool="threads", concurrency=2)
    c.workers.append(w)
    w.start()
    x_key, y_key = _key("lost"), _key("kept")
    x = c.tasks.work.delay(x_key, sleep=30.0, tag="x")
    y = c.tasks.work.delay(y_key, sleep=30.0, tag="y")
    sx = wait_for(lambda: c.rows("start", x.id) or None, 20, "X's start")[0]
    wait_for(lambda: c.rows("start", y.id) or None, 20, "Y's start")
    broker.pause()
    try:
        wait_for(lambda: _state(broker.pid) == "T", 10, "the broker to freeze")
        # X's lease is taken away: its next renewal answers "lost", and the
        # LEASE_LOST event for it must go to the frozen broker.
        evicted = c.store.evict(x_key)
        assert evicted is not None and evicted.token == sx["token"]
        wait_for(lambda: "lease lost" in w.log_text(), 10, "X's lease to be declared lost")
        first = c.store.inspect(y_key)
        assert first is not None and first.live
        # Y's lease goes on being renewed (every TTL / 3) while the broker stays frozen.
        renewed = wait_for(
            lambda: (
                lambda r: r if r is not None and r.expires_at > first.expires_at + 1.0 else None
            )(c.store.inspect(y_key)),
            10,
            "two more renewals of Y with the broker frozen",
        )
        assert renewed.live and renewed.token == first.token
        assert _state(broker.pid) == "T"
    finally:
        broker.resume()


# --------------------------------------------------------------------------
# 6. a copy of a finished task id while the lease store is down
# --------------------------------------------------------------------------


def test_a_copy_of_a_finished_task_is_retired_while_the_lease_store_is_down(
    cluster: Callable[..., tuple[Cluster, RedisServer]],
) -> None:
    """Copies of a finished task (broker restores, old deferrals) must not
    circulate through a lease-store outage: the deferral marker that dedupes
    them lives in the store, so each would defer again at every delivery and
    broker reconnects multiply them. The result table, still up, says the
    work is done."""
    c, store = cluster(settings={"lease_store_retry": 0.3}, separate_store=True)
    w = _worker(c, "a")
    key = _key("finished")
    res = c.tasks.work.delay(key, sleep=0.1, tag="done")
    value = res.get(timeout=30)
    accepted = c.table.accepted(key)
    assert accepted is not None and accepted.task_id == res.id and accepted.value == value
    store.stop()
    assert refused(store.port), "the lease store still answers"
    # A copy of the finished task id, as a broker restore or a deferral makes one.
    c.tasks.work.apply_async((key,), {"sleep": 0.1, "tag": "done"}, task_id=res.id)
    wait_for(
        lambda: w.log_text().count(f"[{res.id}] received") >= 2,
        30,
        "the copy's delivery while the store is down",
    )
    wait_for(
        lambda: (
            f"LEASE_REJECTED {res.id}" in w.log_text() or f"LEASE_DEFERRED {res.id}" in w.log_text()
        ),
        30,
        "the copy's outcome",
    )
    assert refused(store.port), "the store came back before the copy was decided"
    assert f"LEASE_DEFERRED {res.id}" not in w.log_text(), "the finished task's copy deferred"
    assert "this task id's result is accepted and stored" in w.log_text()
    assert c.backend_state(res.id)[0] == "SUCCESS"
    assert len(c.rows("start", res.id)) == 1, "the body ran once"
