"""A LeasedTask with ``result_backend = "lease+<database>"``: real prefork workers.

The backend's database is the fenced result table's (``lease_result_url`` is
not set: it defaults to the backend's database), with the leases in Redis
(``redis+pg``) or in the same PostgreSQL database (``pg+pg``).

1. The task's SUCCESS is written by the fenced commit's transaction: the
   backend's row has SUCCESS, the accepted value and the accepted row's
   token, and the same ``xmin`` (PostgreSQL's writing transaction) as the
   accepted row; the worker's PostgreSQL round trips per task, counted in its
   pool process (``celery_lease.sql.PG_TRAFFIC``), are 2 with the leases in
   the database (claim; commit + state + release) and 3 with them in Redis.
   A link's child, which Celery adds after the body, is in the record too.
2. A stale copy (paused with SIGSTOP past its TTL while a newer copy of the
   same task id claimed the key) writes nothing over the newer owner's state:
   its write is attempted (the body logs it, the worker logs the refusal) and
   the row is unchanged, while the newer owner still works (STARTED, its
   token) and after it committed (SUCCESS, its value and token). Also for a
   ``lease_commit=False`` task, whose stale SUCCESS Celery itself would have
   written over the newer owner's STARTED (and then kept over its SUCCESS).
   Both with ``task_track_started`` on and off: off, the newer copy has
   written nothing, and its registered grant refuses the stale write (with
   the leases in Redis: its task id's registration, for a final state). A
   lock-only task with the leases in Redis registers nothing, so its stale
   SUCCESS still lands then: a documented gap, strict xfail.
3. One truth for every reader, with the workers sending events to a real
   Flower: for a chord over leased tasks and for a task id whose first copy
   went stale, ``AsyncResult.get()``, the backend's row, ``celery -A ... lease
   results KEY --json`` and Flower's ``/api/task/info`` give the accepted
   value and token, and the chord's callback got exactly those values.
"""

from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chord, states
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

import celery_lease
from celery_lease import LeaseStore, events
from tests.apps.leaseapp import build
from tests.flower import Flower
from tests.servers import PostgresServer, RedisServer, wait_for
from tests.workers import Worker, _state, celery_cli, read_log

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis]

STORES = ["redis", "pg"]
IDS = ["redis+pg", "pg+pg"]


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The module's Redis: brokers and lease stores, one database each per deployment."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False)
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def pg_db(pg_server: PostgresServer, pg_url: str) -> str:
    celery_lease.migrate(pg_url)
    return pg_url


@dataclass
class Deployment:
    env: dict[str, str]
    app: Celery
    tasks: Any
    db: str
    store_url: str
    exec_log: Path
    workers: dict[str, Worker]

    def rows(self, event: str, task_id: str, tag: str | None = None) -> list[dict[str, Any]]:
        return [
            r
            for r in read_log(self.exec_log)
            if r["event"] == event and r["task_id"] == task_id and tag in (None, r.get("tag"))
        ]

    def wait_row(self, event: str, task_id: str, tag: str, timeout: float = 30.0) -> dict[str, Any]:
        rows = wait_for(
            lambda: self.rows(event, task_id, tag) or None, timeout, f"{event} of {task_id} {tag}"
        )
        return rows[0]

    def start(self, tmp_path: Path, *names: str, args: tuple[str, ...] = ()) -> None:
        """Start workers ``names``, each consuming queue ``q<name>``."""
        for name in names:
            worker = Worker(name, self.env, tmp_path, extra_args=("-Q", f"q{name}", *args))
            self.workers[name] = worker.start()

    def close(self) -> None:
        for w in self.workers.values():
            w.kill()
        self.app.close()


@pytest.fixture(scope="module")
def deploy(
    redis: RedisServer, pg_db: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Deployment]]:
    """``deploy(store, *workers, args=(), **env)``: a deployment of its own (broker
    and lease store in Redis databases of their own), its workers started (with
    ``args`` on their command lines)."""
    made: list[Deployment] = []

    def make(store: str, *workers: str, args: tuple[str, ...] = (), **env: str) -> Deployment:
        n = len(made) + 1
        tmp_path = tmp_path_factory.mktemp(f"deployment-{n}")
        exec_log = tmp_path / "exec.log"
        store_url = redis.url(2 * n + 1) if store == "redis" else pg_db
        environ = {
            "CL_BROKER": redis.url(2 * n),
            "CL_BACKEND": f"lease+{pg_db}",  # and no CL_RESULTS: lease_result_url defaults to it
            "CL_STORE": store_url,
            "CL_LOG": str(exec_log),
            **env,
        }
        app, tasks = build(environ)
        d = Deployment(environ, app, tasks, pg_db, store_url, exec_log, {})
        made.append(d)
        d.start(tmp_path, *workers, args=args)
        return d

    yield make
    for d in made:
        d.close()


def meta_row(db: str, task_id: str) -> dict[str, Any] | None:
    """The task's row in celery_lease_task_meta: its JSON, token and writing transaction."""
    engine = create_engine(db, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            found = conn.execute(
                text(
                    "SELECT value, token, xmin::text AS xid FROM celery_lease_task_meta "
                    "WHERE key = :k"
                ),
                {"k": f"celery-task-meta-{task_id}"},
            ).first()
            accepted = conn.execute(
                text("SELECT xmin::text FROM celery_lease_results WHERE task_id = :t"),
                {"t": task_id},
            ).scalar()
    finally:
        engine.dispose()
    if found is None:
        return None
    return {**json.loads(found.value), "token": found.token, "xid": found.xid, "ac": accepted}


# -- 1. the SUCCESS in the commit's transaction, round trips counted ----------------


@pytest.fixture(scope="module", params=STORES, ids=IDS)
def counted(
    request: pytest.FixtureRequest, deploy: Callable[..., Deployment]
) -> tuple[str, Deployment]:
    """One worker, one pool process, counting its PostgreSQL round trips; no
    STARTED (task_track_started off: the round trips a task needs, no more)."""
    store = request.param
    env = {"CL_TTL": "30", "CL_TRACK_STARTED": "0", "CL_COUNT_PG": "1"}
    return store, deploy(store, "c", **env)


def test_the_success_is_written_by_the_commits_transaction(
    counted: tuple[str, Deployment],
) -> None:
    store, d = counted
    runs = []
    for i in range(8):  # one after the other, each in the one pool process
        key = f"rt-{uuid.uuid4().hex}"
        done = d.tasks.work.apply_async((key,), {"tag": f"t{i}"}, queue="qc")
        value = done.get(timeout=60)
        runs.append((key, done.id, value))
    for key, task_id, value in runs:
        accepted = d.tasks.work.accepted(key=key)
        assert accepted is not None and accepted.task_id == task_id
        row = meta_row(d.db, task_id)
        assert row is not None
        assert (row["status"], row["result"], row["token"]) == (
            states.SUCCESS,
            value,
            accepted.token,
        )
        assert row["xid"] == row["ac"], "the SUCCESS and the accepted row: one transaction"
    starts = [d.rows("start", task_id)[0] for _, task_id, _ in runs]
    per_task = [b["pg_round_trips"] - a["pg_round_trips"] for a, b in pairwise(starts)]
    # Between two body starts: one commit (+ the tracer's SUCCESS: nothing) and one claim.
    expected = 2 if store == "pg" else 3
    assert per_task[1:] == [expected] * (len(per_task) - 1), per_task


def test_canvas_on_success_records_written_by_the_commit(
    counted: tuple[str, Deployment],
) -> None:
    """Celery sends a link after the body and records it in the SUCCESS's
    children: the tracer's write adds it (one fenced write, the same token).
    A chord of leased header tasks counts its members (their SUCCESS records
    written by the tracer, fenced by their tokens: see test_chord_crash.py for
    why not by the commit), and sends its callback once."""
    _, d = counted
    key = f"link-{uuid.uuid4().hex}"
    done = d.tasks.work.apply_async((key,), queue="qc", link=d.tasks.add.si(2, 3).set(queue="qc"))
    value = done.get(timeout=60)
    row = meta_row(d.db, done.id)
    assert row is not None and (row["status"], row["result"]) == (states.SUCCESS, value)
    assert row["token"] == value["token"]
    # The commit's SUCCESS is visible first; the tracer's write adds the link a
    # moment later (it is sent after the body): wait for that write.
    row = wait_for(
        lambda: (lambda r: r if r and r["children"] else None)(meta_row(d.db, done.id)),
        30,
        "the tracer's write of the link into the SUCCESS's children",
    )
    assert (row["status"], row["result"], row["token"]) == (
        states.SUCCESS,
        value,
        value["token"],
    )
    (child,) = row["children"]
    assert d.app.AsyncResult(child[0][0]).get(timeout=60) == 5

    keys = [f"chord-{uuid.uuid4().hex}" for _ in range(3)]
    header = [d.tasks.work.s(k, 0.0, f"c{i}").set(queue="qc") for i, k in enumerate(keys)]
    joined = chord(header, d.tasks.collect.s().set(queue="qc")).apply_async()
    values = joined.get(timeout=60)
    assert [(v["key"], v["tag"]) for v in values] == [(k, f"c{i}") for i, k in enumerate(keys)]
    assert joined.parent is not None
    for member, v in zip(joined.parent.results, values):
        # (Not the xmin: Celery's chord code then updates each member's expiry.)
        row = meta_row(d.db, member.id)
        assert row is not None and (row["status"], row["result"]) == (states.SUCCESS, v)
        assert row["token"] == v["token"] and row["group_id"] == joined.parent.id


# -- 2. a stale copy writes nothing over the newer owner -----------------------------


@pytest.fixture(
    scope="module",
    params=[(s, t) for s in STORES for t in ("1", "0")],
    ids=[f"{i}-track{t}" for i in IDS for t in ("1", "0")],
)
def pair_workers(request: pytest.FixtureRequest, deploy: Callable[..., Deployment]) -> Deployment:
    """Workers ``a`` (queue ``qa``) and ``b`` (``qb``), 2 s leases, with
    ``task_track_started`` on and off: off (Celery's default), the newer copy
    writes nothing before its commit, and no record of its is there to fence by."""
    store, track = request.param
    return deploy(store, "a", "b", CL_TTL="2", CL_TRACK_STARTED=track)


def tracks_started(d: Deployment) -> bool:
    return d.env.get("CL_TRACK_STARTED", "1") == "1"


def lock_only_gap(d: Deployment, request: pytest.FixtureRequest) -> None:
    """docs/result-backend.md, "What is not fenced": a lock-only task with the
    leases outside the result database registers nothing, so with no STARTED a
    lapsed copy's SUCCESS still lands until the newer copy writes (strict: this
    fails loudly once it is closed)."""
    if not tracks_started(d) and d.store_url.startswith("redis"):
        request.applymarker(pytest.mark.xfail(strict=True, reason="documented gap"))


@pytest.fixture
def pair(pair_workers: Deployment) -> Iterator[Deployment]:
    """The module's pair; ``a`` running again after each test, whatever happened."""
    yield pair_workers
    pair_workers.workers["a"].cont_group()


def a_pauses_b_takes_over(d: Deployment, task: Any, key: str, b_sleep: float) -> str:
    """A runs the task id and is paused (SIGSTOP) past its TTL; B runs the same
    task id with a newer token. Returns the task id, with B working."""
    a = d.workers["a"]
    task_id = str(uuid.uuid4())
    task.apply_async((key,), {"sleep": 3.0, "tag": "A"}, task_id=task_id, queue="qa")
    s1 = d.wait_row("start", task_id, "A")
    a.stop_group()
    wait_for(lambda: _state(s1["pid"]) == "T", 10, "A's child stopped")
    store = LeaseStore.from_url(d.store_url)
    try:
        wait_for(
            lambda: (lambda r: r is not None and not r.live)(store.inspect(key)),
            10,
            "A's lease to lapse in store time",
        )
    finally:
        store.close()
    # The same task id again (a redelivery, or a caller submitting it twice).
    task.apply_async((key,), {"sleep": b_sleep, "tag": "B"}, task_id=task_id, queue="qb")
    s2 = d.wait_row("start", task_id, "B")
    assert s2["token"] > s1["token"]
    row = meta_row(d.db, task_id)
    if tracks_started(d):
        assert row is not None and (row["status"], row["token"]) == (states.STARTED, s2["token"])
    else:
        assert row is None, "B writes nothing before its commit"
    assert _state(a.pid) == "T"
    return task_id


def refusal(d: Deployment, task_id: str, state: str) -> Callable[[], bool]:
    line = f"refused the {state} write of celery-task-meta-{task_id} by token"
    return lambda: line in d.workers["a"].log_text()


@pytest.mark.parametrize("resume", ["while-B-works", "after-B-commits"])
def test_a_stale_copy_writes_nothing_over_the_newer_owner(pair: Deployment, resume: str) -> None:
    d = pair
    key = f"stale-{uuid.uuid4().hex}"
    task_id = a_pauses_b_takes_over(
        d, d.tasks.report, key, 6.0 if resume == "while-B-works" else 0.5
    )
    b_token = d.rows("start", task_id, "B")[0]["token"]
    if resume == "after-B-commits":
        value = d.app.AsyncResult(task_id).get(timeout=30)
        assert value["tag"] == "B"
    before = meta_row(d.db, task_id)
    d.workers["a"].cont_group()

    # A resumes, finds its lease gone and reports FAILURE: the write is attempted...
    d.wait_row("reported", task_id, "A")
    # ... the newer owner's record is unchanged, and A's worker says it refused the write.
    assert meta_row(d.db, task_id) == before
    wait_for(refusal(d, task_id, states.FAILURE), 10, "A's worker to log the refusal")
    if resume == "while-B-works":
        assert not d.rows("end", task_id, "B"), "B must still be working"
        if tracks_started(d):
            assert before is not None and (before["status"], before["token"]) == (
                states.STARTED,
                b_token,
            )
        else:
            assert before is None
        value = d.app.AsyncResult(task_id).get(timeout=30)
    row = meta_row(d.db, task_id)
    assert row is not None
    assert (row["status"], row["result"], row["token"]) == (states.SUCCESS, value, b_token)
    accepted = d.tasks.report.accepted(key=key)
    assert accepted is not None and (accepted.token, accepted.value) == (b_token, value)


def test_a_stale_lock_only_copy_cannot_replace_the_newer_owners_result(
    pair: Deployment, request: pytest.FixtureRequest
) -> None:
    """``lease_commit=False``: no commit, the tracer writes SUCCESS. A stale copy's
    SUCCESS over the newer owner's STARTED would then also keep the newer
    owner's own SUCCESS out (Celery never overwrites a SUCCESS)."""
    d = pair
    lock_only_gap(d, request)
    key = f"lock-{uuid.uuid4().hex}"
    task_id = a_pauses_b_takes_over(d, d.tasks.lock_only, key, 6.0)
    b_token = d.rows("start", task_id, "B")[0]["token"]
    before = meta_row(d.db, task_id)
    d.workers["a"].cont_group()
    # A's body ends and the tracer writes its (stale) SUCCESS: refused, or the row changes.
    refused = refusal(d, task_id, states.SUCCESS)
    wait_for(lambda: refused() or meta_row(d.db, task_id) != before, 10, "A's SUCCESS write")
    row = meta_row(d.db, task_id)
    assert row == before
    if tracks_started(d):
        assert row is not None and (row["status"], row["token"]) == (states.STARTED, b_token)
    assert refused(), "A's worker logs the refusal"
    assert not d.rows("end", task_id, "B"), "B must still be working"
    value = d.app.AsyncResult(task_id).get(timeout=30)
    assert value["tag"] == "B"
    row = meta_row(d.db, task_id)
    assert row is not None and (row["result"]["tag"], row["token"]) == ("B", b_token)


# -- 3. Flower, AsyncResult, a chord and the CLI read one truth -----------------------


@pytest.fixture(scope="module", params=STORES, ids=IDS)
def watched(
    request: pytest.FixtureRequest,
    deploy: Callable[..., Deployment],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Deployment, Flower]]:
    """The pair of workers sending task events (``-E``), and a Flower watching them."""
    d = deploy(request.param, "a", "b", args=("-E",), CL_TTL="2")
    flower = Flower(d.env, tmp_path_factory.mktemp("flower"))
    try:
        flower.start()

        # Flower receives the workers' events before the test sends anything.
        def add_one() -> str:
            warmup = d.tasks.add.apply_async((1, 1), queue="qb")
            assert warmup.get(timeout=30) == 2
            return str(warmup.id)

        flower.warm_up(add_one)
        yield d, flower
    finally:
        d.workers["a"].cont_group()
        flower.stop()


def one_truth(d: Deployment, flower: Flower, task_id: str, key: str) -> Any:
    """The accepted value of ``key`` as ``AsyncResult.get()``, the backend's row,
    ``celery -A ... lease results KEY --json`` and Flower each give it; all equal."""
    value = d.app.AsyncResult(task_id).get(timeout=60)
    row = meta_row(d.db, task_id)
    assert row is not None and (row["status"], row["result"], row["token"]) == (
        states.SUCCESS,
        value,
        value["token"],
    )
    listed = celery_cli(d.env, "lease", "results", key, "--json")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    (accepted,) = json.loads(listed.stdout)  # one accepted result for the key
    assert (accepted["task_id"], accepted["token"], accepted["value"]) == (
        task_id,
        value["token"],
        value,
    )
    flower.wait_state(task_id, states.SUCCESS, 30, "a leased task")
    seen = flower.get(f"/api/task/info/{task_id}")
    assert ast.literal_eval(seen["result"]) == value  # Flower keeps the result's repr
    return value


def test_flower_asyncresult_a_chord_and_the_cli_read_one_truth(
    watched: tuple[Deployment, Flower],
) -> None:
    """A chord over leased tasks, and one task id whose first copy went stale: the
    stale copy's FENCED reached Flower (the backend kept the newer owner's
    state), and every reader ends on the value the fenced table accepted."""
    d, flower = watched
    keys = [f"truth-{uuid.uuid4().hex}" for _ in range(3)]
    header = [d.tasks.work.s(k, 0.0, f"c{i}").set(queue="qb") for i, k in enumerate(keys)]
    joined = chord(header, d.tasks.collect.s().set(queue="qb")).apply_async()
    collected = joined.get(timeout=60)
    assert joined.parent is not None
    members = [m.id for m in joined.parent.results]
    assert collected == [one_truth(d, flower, m, k) for m, k in zip(members, keys)]

    key = f"truth-{uuid.uuid4().hex}"
    task_id = a_pauses_b_takes_over(d, d.tasks.work, key, 8.0)
    before = meta_row(d.db, task_id)
    d.workers["a"].cont_group()
    # A resumes and ends its body; its commit is refused (B holds a newer token)
    # and it leaves the outcome to B: FENCED, then a deferred copy, in Flower...
    fenced = f"FENCED {task_id} key={key}"
    wait_for(lambda: fenced in d.workers["a"].log_text(), 20, "A's commit to be refused")
    stale_states = (events.FENCED, events.LEASE_DEFERRED)
    wait_for(lambda: flower.state(task_id) in stale_states, 20, "Flower to see the stale copy")
    # ... while the backend still holds B's STARTED and B still works.
    assert meta_row(d.db, task_id) == before
    assert before is not None and before["status"] == states.STARTED
    assert not d.rows("end", task_id, "B"), "B must still be working"
    # Then B commits, and every reader says B's value.
    value = one_truth(d, flower, task_id, key)
    assert (value["tag"], value["token"]) == ("B", before["token"])
