"""The ``lease+`` backend and leased tasks: fenced writes and the SUCCESS in the commit.

No worker here (tests/acceptance/test_result_backend_fenced.py runs them):
each test drives the backend the way the tracer and a LeasedTask's execution
do, with Celery's own request object (``celery.app.task.Context``) carrying
the execution's :class:`~celery_lease.backend.LeaseWriter`, then reads
``celery_lease_task_meta`` itself.

For every pairing of lease store and result database (tests/results_helpers.py:
``redis+pg``, ``redis+sqlite`` and ``sqlite+pg``, the fence-row path; ``pg+pg`` and
``sqlite+sqlite``, the one-transaction path), with the backend in the result
table's database:

- a commit carrying the task's record writes it with the accepted row, in
  the same transaction (PostgreSQL: the same ``xmin``, and the round trips
  of the commit alone), with the lease's token; a refused commit writes none;
- the tracer's SUCCESS write after such a commit is a no-op (no round trip),
  unless children were added after it (then one fenced write adds them);
- a write carrying a token is refused over a larger token and over a
  SUCCESS (unless it is a SUCCESS itself), logged and counted, never raised;
- a write without a token (Celery's own path) never replaces a SUCCESS that
  has a token, in one statement; a header cannot pose as a writer.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, states
from celery.app.task import Context
from celery.result import AsyncResult
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from celery_lease import DuplicateResult, Lease, StaleFencingToken
from celery_lease.backend import WRITER_ATTR, LeaseWriter, commit_record
from celery_lease.sql import PG_TRAFFIC, count_pg_traffic
from tests.results_helpers import Pairing, backend_of, new_key, wait_until_expired

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def app(pairing: Pairing) -> Iterator[Celery]:
    app = Celery(
        "fenced", broker="memory://", backend=f"lease+{pairing.result_url}", set_as_current=False
    )
    app.conf.result_extended = True
    yield app
    app.close()


def request_for(task_id: str, token: int | Lease | None, **fields: Any) -> Context:
    """The tracer's request object for ``task_id``, as a LeasedTask's execution leaves
    it (given a lease: its token and keys, as with the backend in the result database)."""
    req = Context(
        id=task_id,
        task="fenced.work",
        args=["k"],
        kwargs={},
        hostname="w1@localhost",
        delivery_info={"routing_key": "celery"},
        **fields,
    )
    if isinstance(token, Lease):
        setattr(req, WRITER_ATTR, LeaseWriter(token.token, token.keys))
    elif token is not None:
        setattr(req, WRITER_ATTR, LeaseWriter(token))
    return req


def record(url: str, task_id: str) -> dict[str, Any] | None:
    """The task's row as stored: its JSON, token and (PostgreSQL) writing transaction."""
    engine = create_engine(url, poolclass=NullPool)
    xmin = "xmin::text" if url.startswith("postgresql") else "NULL"
    try:
        with engine.connect() as conn:
            found = conn.execute(
                text(
                    f"SELECT value, token, {xmin} AS xid FROM celery_lease_task_meta WHERE key = :k"
                ),
                {"k": f"celery-task-meta-{task_id}"},
            ).first()
    finally:
        engine.dispose()
    if found is None:
        return None
    return {**json.loads(found.value), "token": found.token, "xid": found.xid}


def result_xid(url: str, lease: Lease) -> str:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return str(
                conn.execute(
                    text(
                        "SELECT xmin::text FROM celery_lease_results "
                        "WHERE lease_key = :k AND fencing_token = :t"
                    ),
                    {"k": lease.key, "t": lease.token},
                ).scalar_one()
            )
    finally:
        engine.dispose()


def claim(p: Pairing, key: str) -> Lease:
    lease = p.store.claim(key, ttl=30, owner_id="w1:1")
    assert lease is not None
    p.table.register(lease)
    return lease


def pg_round_trips(fn: Any) -> int:
    """Round trips to PostgreSQL while ``fn()`` runs (celery_lease.sql.PG_TRAFFIC)."""
    before = PG_TRAFFIC["round_trips"]
    count_pg_traffic()
    try:
        fn()
    finally:
        count_pg_traffic(False)
    return PG_TRAFFIC["round_trips"] - before


# -- the SUCCESS record in the commit's transaction -----------------------------------


def test_the_commit_writes_the_task_success_in_its_transaction(
    pairing: Pairing, app: Celery
) -> None:

    @app.task(name="fenced.work", shared=False)
    def work() -> None: ...

    lease = claim(pairing, new_key("meta"))
    tid = str(uuid.uuid4())
    req = request_for(tid, lease.token)
    meta = commit_record(work, req, tid, {"v": 1}, pairing.table.db)
    assert meta is not None
    # Only in the result table's database, and only when Celery would store it.
    assert (
        commit_record(work, request_for(tid, 1, ignore_result=True), tid, 1, pairing.table.db)
        is None
    )

    def commit() -> None:
        pairing.table.commit(lease, {"v": 1}, task_id=tid, meta=meta)

    trips = pg_round_trips(commit)
    row = record(pairing.result_url, tid)
    assert row is not None
    # What Celery's tracer writes, with the accepted row's token.
    assert (row["status"], row["result"], row["token"]) == (states.SUCCESS, {"v": 1}, lease.token)
    assert (row["task_id"], row["name"], row["args"], row["worker"]) == (
        tid,
        "fenced.work",
        ["k"],
        "w1@localhost",
    )
    assert row["date_done"] is not None and row["children"] == []
    assert AsyncResult(tid, app=app).get(timeout=5) == {"v": 1}
    if pairing.kind == "pg+pg":
        assert trips == 1  # check + release + insert + record: one statement
    if pairing.kind in ("redis+pg", "sqlite+pg"):
        assert trips == 2  # lock the fence row; insert + record + COMMIT
    if pairing.result_url.startswith("postgresql"):
        assert row["xid"] == result_xid(pairing.result_url, lease), "not one transaction"


def test_a_refused_commit_writes_no_record(pairing: Pairing, app: Celery) -> None:
    backend = backend_of(app)
    key = new_key("refused")
    old = pairing.store.claim(key, ttl=1.0, owner_id="old:1")
    assert old is not None
    pairing.table.register(old)
    wait_until_expired(pairing.store, old)
    claim(pairing, key)  # a newer owner
    tid = str(uuid.uuid4())
    meta = backend.success_record(tid, {"v": "stale"}, request_for(tid, old.token))
    with pytest.raises(StaleFencingToken):
        pairing.table.commit(old, {"v": "stale"}, task_id=tid, meta=meta)
    assert record(pairing.result_url, tid) is None


def test_a_duplicate_writes_no_record(pairing: Pairing, app: Celery) -> None:
    backend = backend_of(app)
    key = new_key("dup")
    first = claim(pairing, key)
    pairing.table.commit(first, {"v": 1}, mode="once", task_id="first")
    second = claim(pairing, key)
    tid = str(uuid.uuid4())
    meta = backend.success_record(tid, {"v": 2}, request_for(tid, second.token))
    with pytest.raises(DuplicateResult):
        pairing.table.commit(second, {"v": 2}, mode="once", task_id=tid, meta=meta)
    assert record(pairing.result_url, tid) is None


def test_the_tracers_success_after_the_commit_writes_nothing(pairing: Pairing, app: Celery) -> None:
    backend = backend_of(app)
    lease = claim(pairing, new_key("noop"))
    tid = str(uuid.uuid4())
    req = request_for(tid, lease.token)
    pairing.table.commit(
        lease, {"v": 1}, task_id=tid, meta=backend.success_record(tid, {"v": 1}, req)
    )
    writer = getattr(req, WRITER_ATTR)
    writer.committed(req)
    written = record(pairing.result_url, tid)

    trips = pg_round_trips(lambda: backend.mark_as_done(tid, {"v": 1}, request=req))
    assert record(pairing.result_url, tid) == written  # date_done and all: not written again
    if pairing.result_url.startswith("postgresql"):
        assert trips == 0

    # A child Celery adds after the body (a link, a chain's next task): one fenced
    # write of the same token adds it to the SUCCESS record.
    req.children.append(AsyncResult(str(uuid.uuid4()), app=app))
    trips = pg_round_trips(lambda: backend.mark_as_done(tid, {"v": 1}, request=req))
    row = record(pairing.result_url, tid)
    assert row is not None and len(row["children"]) == 1
    assert (row["status"], row["token"]) == (states.SUCCESS, lease.token)
    if pairing.result_url.startswith("postgresql"):
        assert trips == 1


# -- fenced state writes ----------------------------------------------------------


def test_a_leased_write_carries_its_token_in_one_statement(pairing: Pairing, app: Celery) -> None:
    backend = backend_of(app)
    tid = str(uuid.uuid4())

    def started() -> None:
        backend.store_result(tid, {"pid": 1}, states.STARTED, request=request_for(tid, 7))

    trips = pg_round_trips(started)
    row = record(pairing.result_url, tid)
    assert row is not None and (row["status"], row["token"]) == (states.STARTED, 7)
    if pairing.result_url.startswith("postgresql"):
        assert trips == 1  # no read before the write: the statement checks


@pytest.mark.parametrize("state", [states.FAILURE, states.RETRY, "PROGRESS", states.SUCCESS])
def test_a_stale_token_writes_nothing_over_a_newer_owners_record(
    pairing: Pairing, app: Celery, state: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = backend_of(app)
    tid = str(uuid.uuid4())
    backend.store_result(tid, {"pid": 2}, states.STARTED, request=request_for(tid, 8))
    before = record(pairing.result_url, tid)
    value: Any = RuntimeError("stale") if state in (states.FAILURE, states.RETRY) else {"p": 1}
    with caplog.at_level(logging.WARNING, logger="celery_lease.backend"):
        backend.store_result(tid, value, state, request=request_for(tid, 7))  # never raises
    assert record(pairing.result_url, tid) == before
    assert (
        f"refused the {state} write of celery-task-meta-{tid} by token 7: "
        "the record holds STARTED by token 8"
    ) in caplog.text


def stale_and_newer(
    p: Pairing, task_id: str, key: str, while_held: Callable[[Lease], None]
) -> tuple[Lease, Lease]:
    """Copy A of ``task_id`` claims (``while_held(A)`` runs then) and lapses; a newer
    copy B claims the key (and registers, where the pairing does) and writes
    nothing yet (``task_track_started`` off)."""
    old = p.store.claim(key, ttl=1.0, owner_id="a:1", meta={"task_id": task_id})
    assert old is not None
    p.table.register(old)
    while_held(old)
    wait_until_expired(p.store, old)
    newer = p.store.claim(key, ttl=30, owner_id="b:1", meta={"task_id": task_id})
    assert newer is not None and newer.token > old.token
    p.table.register(newer)
    return old, newer


@pytest.mark.parametrize("before", ["absent", "older"])
@pytest.mark.parametrize("state", [states.FAILURE, states.SUCCESS, states.RETRY, "PROGRESS"])
def test_a_stale_copy_writes_nothing_before_the_newer_copy_wrote(
    pairing: Pairing,
    app: Celery,
    state: str,
    before: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Invariant 8 with nothing of the newer copy's in the row to compare with:
    the registered token refuses the stale write, then the newer copy's commit
    lands. A final state (FAILURE, a lock-only copy's SUCCESS) is refused by a
    newer grant *of this task id*: the lease rows (leases in this database) or
    the registrations (``celery_lease_registrations``, leases elsewhere)."""
    backend = backend_of(app)
    tid = str(uuid.uuid4())

    def started(lease: Lease) -> None:  # A's own STARTED, written while it held the lease
        if before == "older":
            backend.store_result(tid, {"pid": 1}, states.STARTED, request=request_for(tid, lease))

    old, newer = stale_and_newer(pairing, tid, new_key("unwritten"), started)
    kept = record(pairing.result_url, tid)
    value: Any = RuntimeError("stale") if state in (states.FAILURE, states.RETRY) else {"p": 1}
    with caplog.at_level(logging.WARNING, logger="celery_lease.backend"):
        backend.store_result(tid, value, state, request=request_for(tid, old))  # never raises
    assert record(pairing.result_url, tid) == kept
    assert (kept is None) is (before == "absent")
    assert f"refused the {state} write of celery-task-meta-{tid} by token {old.token}" in (
        caplog.text
    )
    req = request_for(tid, newer)
    success = backend.success_record(tid, {"v": "B"}, req)
    pairing.table.commit(newer, {"v": "B"}, task_id=tid, meta=success)
    assert AsyncResult(tid, app=app).get(timeout=5) == {"v": "B"}
    row = record(pairing.result_url, tid)
    assert row is not None and (row["status"], row["token"]) == (states.SUCCESS, newer.token)


@pytest.mark.parametrize("state", [states.FAILURE, states.SUCCESS])
def test_a_stale_copys_final_state_is_refused_after_another_task_id_took_the_key_too(
    pairing: Pairing, app: Celery, state: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A (token 7) of T lapses; B of T claims and registers (8); then U, another
    task id, claims and registers (9); then A writes its final state. The fence
    row holds U's 9 and says nothing of T, but B of T still holds a newer grant
    and will write T's outcome: A's write is refused (invariant 8). Leases
    elsewhere only: in the result database the lease row holds only the newest
    grant's task id (U's), which cannot say that B of T came before it."""
    if pairing.table.colocated:
        pytest.skip("leases in the result database: the lease row names only U")
    backend = backend_of(app)
    tid = str(uuid.uuid4())
    key = new_key("then-other")
    old, newer = stale_and_newer(pairing, tid, key, lambda lease: None)
    pairing.store.release(newer)
    other = pairing.store.claim(key, ttl=30, owner_id="u:1", meta={"task_id": "another"})
    assert other is not None and other.token > newer.token
    pairing.table.register(other)
    value: Any = RuntimeError("late") if state == states.FAILURE else {"v": "A"}
    with caplog.at_level(logging.WARNING, logger="celery_lease.backend"):
        backend.store_result(tid, value, state, request=request_for(tid, old))  # never raises
    assert record(pairing.result_url, tid) is None
    assert f"refused the {state} write of celery-task-meta-{tid} by token {old.token}" in (
        caplog.text
    )


@pytest.mark.parametrize("state", [states.FAILURE, states.SUCCESS])
def test_a_lapsed_copys_final_state_stands_when_another_task_id_took_the_key(
    pairing: Pairing, app: Celery, state: str
) -> None:
    """No copy of this task id writes its outcome but this one: refusing it for
    another task id's newer token would leave the task id PENDING for ever."""
    backend = backend_of(app)
    tid = str(uuid.uuid4())
    key = new_key("other")
    old = pairing.store.claim(key, ttl=1.0, owner_id="a:1", meta={"task_id": tid})
    assert old is not None
    pairing.table.register(old)
    wait_until_expired(pairing.store, old)
    other = pairing.store.claim(key, ttl=30, owner_id="u:1", meta={"task_id": "another"})
    assert other is not None
    pairing.table.register(other)
    value: Any = RuntimeError("late") if state == states.FAILURE else {"v": "A"}
    backend.store_result(tid, value, state, request=request_for(tid, old))
    row = record(pairing.result_url, tid)
    assert row is not None and (row["status"], row["token"]) == (state, old.token)


@pytest.mark.parametrize("state", [states.FAILURE, states.RETRY, "PROGRESS", states.STARTED])
def test_only_a_success_replaces_a_success(
    pairing: Pairing, app: Celery, state: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = backend_of(app)
    tid = str(uuid.uuid4())
    backend.mark_as_done(tid, {"v": "owner"}, request=request_for(tid, 8))
    before = record(pairing.result_url, tid)
    value: Any = RuntimeError("late") if state in (states.FAILURE, states.RETRY) else {"p": 1}
    with caplog.at_level(logging.WARNING, logger="celery_lease.backend"):
        # A larger token does not help: Celery never overwrites a SUCCESS.
        backend.store_result(tid, value, state, request=request_for(tid, 9))
    assert record(pairing.result_url, tid) == before
    assert f"refused the {state} write of celery-task-meta-{tid} by token 9" in caplog.text
    assert "the record holds SUCCESS by token 8" in caplog.text
    # A SUCCESS with a smaller token is refused too; one with a token at least the
    # row's may replace it (the same execution adding children, a lease_commit=False
    # task's newer owner).
    backend.mark_as_done(tid, {"v": "stale"}, request=request_for(tid, 7))
    assert record(pairing.result_url, tid) == before
    backend.mark_as_done(tid, {"v": "newer"}, request=request_for(tid, 10))
    row = record(pairing.result_url, tid)
    assert row is not None and (row["result"], row["token"]) == ({"v": "newer"}, 10)


def test_a_newer_token_replaces_an_older_state(pairing: Pairing, app: Celery) -> None:
    backend = backend_of(app)
    tid = str(uuid.uuid4())
    backend.store_result(tid, {"pid": 1}, states.STARTED, request=request_for(tid, 7))
    backend.mark_as_failure(tid, RuntimeError("lost"), request=request_for(tid, 7))
    backend.store_result(tid, {"pid": 2}, states.STARTED, request=request_for(tid, 8))
    row = record(pairing.result_url, tid)
    assert row is not None and (row["status"], row["token"]) == (states.STARTED, 8)


def test_an_expired_record_is_absent_to_a_fenced_write(pairing: Pairing, db_clock: Any) -> None:
    app = Celery(
        "fenced-expiry",
        broker="memory://",
        backend=f"lease+{pairing.result_url}",
        set_as_current=False,
    )
    app.conf.result_expires = 1
    try:
        backend = backend_of(app)
        tid = str(uuid.uuid4())
        backend.mark_as_done(tid, {"v": "old"}, request=request_for(tid, 9))
        db_clock(pairing.result_url, f"celery-task-meta-{tid}")
        backend.mark_as_failure(tid, RuntimeError("again"), request=request_for(tid, 1))
        row = record(pairing.result_url, tid)
        assert row is not None and (row["status"], row["token"]) == (states.FAILURE, 1)
    finally:
        app.close()


@pytest.fixture
def db_clock() -> Any:
    """``expire(url, key)``: put a row's expiry in the past (the database's clock)."""

    def expire(url: str, key: str) -> None:
        engine = create_engine(url, poolclass=NullPool)
        try:
            with engine.begin() as conn:
                conn.execute(
                    text("UPDATE celery_lease_task_meta SET expires_at = 1 WHERE key = :k"),
                    {"k": key},
                )
        finally:
            engine.dispose()

    return expire


# -- writes without a token ----------------------------------------------------------


def test_a_write_without_a_token_never_replaces_a_leased_success(
    pairing: Pairing, app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """Celery's key-value path reads the state, then writes: a tokenless FAILURE
    that read "STARTED" just before the commit's SUCCESS landed must not replace
    it. The write itself refuses (here: the write after the read, on its own)."""
    backend = backend_of(app)
    tid = str(uuid.uuid4())
    backend.mark_as_done(tid, {"v": "owner"}, request=request_for(tid, 8))
    before = record(pairing.result_url, tid)
    key = backend.get_key_for_task(tid)
    failure = backend.encode({"status": states.FAILURE, "result": None, "task_id": tid})
    with caplog.at_level(logging.WARNING, logger="celery_lease.backend"):
        backend._set_with_state(key, failure, states.FAILURE)
    assert record(pairing.result_url, tid) == before
    assert f"refused the FAILURE write of {key} by token -" in caplog.text

    # A task that is not leased keeps Celery's behaviour exactly (its record has no token).
    plain = str(uuid.uuid4())
    backend.store_result(plain, 5, states.SUCCESS)
    backend._set_with_state(backend.get_key_for_task(plain), failure, states.FAILURE)
    row = record(pairing.result_url, plain)
    assert row is not None and (row["status"], row["token"]) == (states.FAILURE, None)


def test_a_header_cannot_pose_as_the_writer(pairing: Pairing, app: Celery) -> None:
    """Celery makes message headers request attributes: a header named like the
    writer's attribute is a string or a number, and counts for nothing."""
    backend = backend_of(app)
    tid = str(uuid.uuid4())
    req = request_for(tid, None, **{WRITER_ATTR: 10**12})
    backend.store_result(tid, {"pid": 1}, states.STARTED, request=req)
    row = record(pairing.result_url, tid)
    assert row is not None and (row["status"], row["token"]) == (states.STARTED, None)
