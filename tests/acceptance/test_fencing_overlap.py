"""``fencing.guard`` refuses an old owner that resumes while the new owner works.

DESIGN.md: a fence that only compares with the highest token *written* is not
enough: an old owner that resumes while the new owner is still working (and
has not written yet) must be refused too. A lock-only task
(``lease_commit=False``) and ``store.hold()`` register nothing in a fence row
at the claim, so ``guard`` given the lease asks the lease store, while the
caller's transaction holds the fence row, whether the lease is still the
key's grant.

The timeline, for every store and for a guarded table in PostgreSQL or
SQLite (the leases' own database or another one)::

    A claims (token n), writes once through the guard: accepted
    A stalls; its lease lapses in store time (polled on the store's clock)
    B claims (token > n) and has NOT written
    A resumes, writes through the guard with its lease: StaleFencingToken
    B writes: accepted; A again: StaleFencingToken (now by the fence row too)

Then the same with a real prefork ``celery worker`` running a lock-only
``LeasedTask`` (Redis leases, guarded table in PostgreSQL), paused with
SIGSTOP past its TTL.
"""

from __future__ import annotations

import gc
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.pool import NullPool

import celery_lease
from celery_lease import HeldLease, Lease, LeaseConfigError, LeaseStore, StaleFencingToken, fencing
from tests.apps.fenceapp import CREATE_WRITES, INSERT_WRITE, build
from tests.etcd_cluster import etcd_cluster, etcd_url  # noqa: F401 - fixtures
from tests.results_helpers import migrated_pg_url, new_key, wait_for, wait_until_expired
from tests.servers import RedisServer
from tests.store_fixtures import store_url
from tests.workers import Worker, _state, read_log

pytestmark = pytest.mark.timeout(120)

TTL = 1.0
LONG_TTL = 60.0


# --------------------------------------------------------------------------
# the user's guarded table
# --------------------------------------------------------------------------


def user_engine(url: str) -> Engine:
    """The application's own engine (not celery-lease's). SQLite: BEGIN IMMEDIATE."""
    if not url.startswith("sqlite"):
        return create_engine(url, poolclass=NullPool)
    engine = create_engine(url, poolclass=NullPool, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None
        dbapi_connection.execute("PRAGMA busy_timeout=30000")

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def write(
    engine: Engine,
    resource: str,
    lease: int | HeldLease | Lease,
    writer: str,
    store: LeaseStore | None = None,
) -> None:
    """The user's guarded write: the fence first, then the row."""
    with engine.begin() as conn:
        if store is None:
            fencing.guard(conn, resource, lease)
        else:
            fencing.guard(conn, resource, lease, store=store)
        token = lease if isinstance(lease, int) else lease.token
        conn.execute(text(INSERT_WRITE), {"r": resource, "t": token, "w": writer})


def writes(engine: Engine, resource: str) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT writer, token FROM overlap_writes WHERE resource = :r ORDER BY token"),
            {"r": resource},
        ).all()
    return [(str(w), int(t)) for w, t in rows]


# --------------------------------------------------------------------------
# fixtures: a lease store and a guarded database, every pairing
# --------------------------------------------------------------------------


@dataclass
class Setup:
    kind: str
    store: LeaseStore
    engine: Engine


#: (lease store, guarded database); "same" means the store's own database.
PAIRS = [
    pytest.param(("redis", "postgres"), id="redis+pg"),
    pytest.param(("redis", "sqlite"), id="redis+sqlite"),
    pytest.param(("etcd", "postgres"), id="etcd+pg", marks=pytest.mark.etcd),
    pytest.param(("postgres", "same"), id="pg+same-pg"),
    pytest.param(("sqlite", "same"), id="sqlite+same-sqlite"),
    pytest.param(("postgres", "sqlite"), id="pg+sqlite"),
]


def guarded_url(request: pytest.FixtureRequest, kind: str) -> str:
    if kind == "postgres":
        return migrated_pg_url(request)
    url: str = request.getfixturevalue("sqlite_url")
    celery_lease.migrate(url)
    return url


@pytest.fixture(params=PAIRS)
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    store_kind, db_kind = request.param
    s_url = store_url(request, store_kind)
    if db_kind == "same":
        db_url = s_url
        celery_lease.migrate(db_url)
    else:
        db_url = guarded_url(request, db_kind)
    store = LeaseStore.from_url(s_url)
    engine = user_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text(CREATE_WRITES))
    yield Setup(request.node.callspec.id, store, engine)
    engine.dispose()
    store.close()


def claim_when_free(store: LeaseStore, key: str, owner: str) -> Lease:
    """B's claim, once the store frees the key (etcd: after its revocation loop)."""
    return wait_for(lambda: store.claim(key, ttl=LONG_TTL, owner_id=owner), 10, f"{owner} claims")


# --------------------------------------------------------------------------
# the overlap, in one process, for every store
# --------------------------------------------------------------------------


@pytest.mark.parametrize("holder", ["hold", "claim"])
def test_resumed_owner_refused_while_the_new_owner_has_not_written(
    setup: Setup, holder: str
) -> None:
    store, engine = setup.store, setup.engine
    key = new_key("overlap")
    resource = f"account:{key}"  # not the key: no claim registers anything here
    with store.hold(key, ttl=TTL, owner_id="worker-A") as held:
        a: HeldLease | Lease = held if holder == "hold" else held.lease
        a_store = None if holder == "hold" else store
        write(engine, resource, a, "A", a_store)  # A owns the key: accepted
        # A stalls: nothing renews its lease, which lapses in store time.
        held.detach()
        wait_until_expired(store, held.lease)
        b = claim_when_free(store, key, "worker-B")
        assert b.token > held.token
        assert writes(engine, resource) == [("A", held.token)], "B has not written yet"

        with pytest.raises(StaleFencingToken) as refused:
            write(engine, resource, a, "A", a_store)
        assert refused.value.key == resource and refused.value.token == held.token
        assert writes(engine, resource) == [("A", held.token)], "A's late write must not land"

        write(engine, resource, b, "B", store)
        with pytest.raises(StaleFencingToken) as again:
            write(engine, resource, a, "A", a_store)
        assert again.value.token == held.token
        with engine.connect() as conn:
            assert fencing.current(conn, resource) == b.token
    assert writes(engine, resource) == [("A", held.token), ("B", b.token)]


def test_evicted_owner_refused_while_its_local_view_still_holds(setup: Setup) -> None:
    """The store's answer decides, not the local view: A's renewals and local
    validity still say held when the key is force-released and claimed again."""
    store, engine = setup.store, setup.engine
    key = new_key("evicted")
    resource = f"account:{key}"  # not the key: the SQL stores' evict raises the key's fence
    with store.hold(key, ttl=LONG_TTL, owner_id="worker-A") as a:
        write(engine, resource, a, "A")
        assert store.evict(key) is not None
        b = claim_when_free(store, key, "worker-B")
        assert b.token > a.token
        assert a.held, "A's local view must still say held (the store alone refuses it)"
        with pytest.raises(StaleFencingToken) as refused:
            write(engine, resource, a, "A")
        assert "no longer grants" in refused.value.reason, refused.value.reason
        write(engine, resource, b, "B", store)
    assert writes(engine, resource) == [("A", a.token), ("B", b.token)]


def test_a_lease_on_several_keys_is_refused_once_any_of_them_is_lost(setup: Setup) -> None:
    store, engine = setup.store, setup.engine
    first, second = new_key("multi-a"), new_key("multi-b")
    resource = f"account:{first}"
    with store.hold([first, second], ttl=LONG_TTL, owner_id="worker-A") as a:
        write(engine, resource, a, "A")
        assert store.evict(second) is not None
        b = claim_when_free(store, second, "worker-B")
        # etcd revokes the one etcd lease all of A's keys share; the others keep
        # A's first key, so there the second key alone must refuse A.
        record = store.inspect(first)
        first_kept = record is not None and record.live and record.owner_id == "worker-A"
        with pytest.raises(StaleFencingToken) as refused:
            write(engine, resource, a, "A")
        assert "no longer grants" in refused.value.reason, refused.value.reason
        if first_kept:
            assert repr(second) in refused.value.reason, refused.value.reason
        assert b.token > a.token
    assert writes(engine, resource) == [("A", a.token)]


@pytest.mark.parametrize(
    "kind", [pytest.param("postgres", id="pg"), pytest.param("sqlite", id="sqlite")]
)
def test_bare_token_is_refused_after_a_claim_on_the_sql_store_of_that_database(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """The SQL stores register every claim in the key's fence row: with the key
    as the resource in the leases' own database, a bare token is refused as
    soon as a newer owner claimed, before it writes (unchanged behaviour)."""
    url = store_url(request, kind)
    celery_lease.migrate(url)
    store = LeaseStore.from_url(url)
    engine = user_engine(url)
    with engine.begin() as conn:
        conn.execute(text(CREATE_WRITES))
    key = new_key("colocated")
    try:
        a = store.claim(key, ttl=TTL, owner_id="worker-A")
        assert a is not None
        write(engine, key, a.token, "A")
        wait_until_expired(store, a)
        b = claim_when_free(store, key, "worker-B")
        with engine.connect() as conn:
            assert fencing.current(conn, key) == b.token, "the claim registered B's token"
        with pytest.raises(StaleFencingToken) as refused:
            write(engine, key, a.token, "A")
        assert refused.value.current == b.token
        write(engine, key, b.token, "B")
        assert writes(engine, key) == [("A", a.token), ("B", b.token)]
    finally:
        engine.dispose()
        store.close()


def test_a_lease_without_its_store_is_a_config_error(request: pytest.FixtureRequest) -> None:
    url = guarded_url(request, "sqlite")
    store = LeaseStore.from_url(url)
    engine = user_engine(url)
    try:
        lease = store.claim(new_key(), ttl=LONG_TTL)
        assert lease is not None
        with engine.begin() as conn:
            with pytest.raises(LeaseConfigError, match="store="):
                fencing.guard(conn, "r", lease)
            with pytest.raises(LeaseConfigError, match="store="):
                fencing.guard(conn, "r", 3, store=store)
            assert fencing.current(conn, "r") is None, "nothing recorded"
    finally:
        engine.dispose()
        store.close()


# --------------------------------------------------------------------------
# a lock-only LeasedTask in real prefork workers, paused with SIGSTOP
# --------------------------------------------------------------------------


@pytest.fixture
def worker_env(
    tmp_path: Path, make_redis_server: Callable[..., RedisServer], request: pytest.FixtureRequest
) -> dict[str, str]:
    redis = make_redis_server(appendonly=False)
    pg = migrated_pg_url(request)
    return {
        "CL_BROKER": redis.url(0),
        "CL_BACKEND": redis.url(1),
        "CL_STORE": redis.url(2),
        "CL_RESULTS": pg,
        "CL_GUARD_DB": pg,
        "CL_TTL": "2",
        "CL_LOG": str(tmp_path / f"exec-{uuid.uuid4().hex[:8]}.log"),
    }


def test_lock_only_task_stalled_owner_refused_while_the_new_owner_works(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    app, task = build(worker_env)
    engine = user_engine(worker_env["CL_GUARD_DB"])
    with engine.begin() as conn:
        conn.execute(text(CREATE_WRITES))
    store = LeaseStore.from_url(worker_env["CL_STORE"])
    log = Path(worker_env["CL_LOG"])
    a = Worker("a", worker_env, tmp_path, app="tests.apps.fenceapp", extra_args=("-Q", "qa"))
    b = Worker("b", worker_env, tmp_path, app="tests.apps.fenceapp", extra_args=("-Q", "qb"))

    def row(event: str, task_id: str) -> dict[str, Any] | None:
        found = [r for r in read_log(log) if r["event"] == event and r["task_id"] == task_id]
        return found[0] if found else None

    def state(task_id: str) -> tuple[str, Any]:
        meta = app.backend.get_task_meta(task_id, cache=False)
        result = meta.get("result")
        if meta.get("status") == "FAILURE":
            result = app.backend.exception_to_python(result)
        return meta.get("status"), result

    try:
        a.start()
        b.start()
        key = new_key("lock-only")
        go_a, go_b = tmp_path / "go-a", tmp_path / "go-b"

        # A claims the key and waits in its body, then is paused (state T).
        t1 = task.apply_async((key, "A", str(go_a)), queue="qa")
        s1 = wait_for(lambda: row("start", t1.id), 30, "A's body start")
        assert s1["pid"] in a.children()
        a.stop_group()
        wait_for(lambda: _state(s1["pid"]) == "T", 10, "A's child stopped")

        # A's lease lapses in store time while A is paused.
        wait_for(
            lambda: (lambda r: r is not None and not r.live)(store.inspect(key)),
            15,
            "A's lease to lapse",
        )
        assert _state(s1["pid"]) == "T"

        # B claims with a larger token and works, without writing yet.
        t2 = task.apply_async((key, "B", str(go_b)), queue="qb")
        s2 = wait_for(lambda: row("start", t2.id), 30, "B's body start")
        assert s2["token"] > s1["token"]
        record = store.inspect(key)
        assert record is not None and record.live and record.token == s2["token"]

        # A resumes and writes: refused, though B has not written.
        go_a.touch()
        a.cont_group()
        refused = wait_for(lambda: row("refused", t1.id), 30, "A's guarded write to be refused")
        assert refused["token"] == s1["token"]
        assert row("wrote", t1.id) is None
        _, exc = wait_for(
            lambda: (lambda s: s if s[0] == "FAILURE" else None)(state(t1.id)), 30, "A's FAILURE"
        )
        assert isinstance(exc, StaleFencingToken), exc
        assert writes(engine, key) == [], "A's write must not land"
        assert row("wrote", t2.id) is None, "B had not written when A was refused"

        # B writes: accepted.
        go_b.touch()
        assert t2.get(timeout=30) == {"token": s2["token"], "tag": "B"}
        assert writes(engine, key) == [("B", s2["token"])]
    finally:
        a.kill()
        b.kill()
        gc.collect()
        app.close()
        engine.dispose()
        store.close()
