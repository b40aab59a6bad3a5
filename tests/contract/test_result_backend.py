"""The ``lease+`` Celery result backend (celery_lease/backend.py) on PostgreSQL and SQLite.

Each test builds a Celery app whose ``result_backend`` is ``lease+<database>``
and drives the backend the way Celery's worker and clients do (``store_result``,
``AsyncResult``, ``GroupResult``, ``get_many``, chord counting), then reads the
table itself (``celery_lease_task_meta``) to check what was written. No worker
here: tests/acceptance/test_result_backend.py runs one.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, states
from celery.app.backends import by_url
from celery.exceptions import BackendGetMetaError, ImproperlyConfigured
from celery.result import AsyncResult, GroupResult
from kombu.exceptions import EncodeError
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

import celery_lease
from celery_lease import backend as backend_module
from celery_lease.backend import LeaseBackend, LeaseBackendConfigError
from celery_lease.exceptions import LeaseConfigError, StoreUnavailable
from celery_lease.sql import database
from tests.results_helpers import backend_of
from tests.servers import PostgresServer, free_port, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated database: the module's PostgreSQL one, or a new SQLite file."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'backend.sqlite3'}"  # migrated on first use
    url: str = request.getfixturevalue("pg_url")
    celery_lease.migrate(url)
    return url


def make_app(url: str, **settings: Any) -> Celery:
    app = Celery(
        "backend-contract", broker="memory://", backend=f"lease+{url}", set_as_current=False
    )
    app.conf.update(settings)
    return app


@pytest.fixture
def app(db_url: str) -> Iterator[Celery]:
    app = make_app(db_url)
    yield app
    app.close()


def task_id() -> str:
    return str(uuid.uuid4())


def row(url: str, key: str) -> dict[str, Any] | None:
    """``celery_lease_task_meta``'s row for ``key`` as stored (expired or not)."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            found = conn.execute(
                text("SELECT value, expires_at, token FROM celery_lease_task_meta WHERE key = :k"),
                {"k": key},
            ).first()
    finally:
        engine.dispose()
    return None if found is None else dict(found._mapping)


# -- the scheme ----------------------------------------------------------------


def test_the_lease_scheme_resolves_to_this_backend_with_the_database_url(
    pg_url: str, tmp_path: Path
) -> None:
    """Celery's by_url finds ``lease`` in the celery.result_backends entry points and
    hands the backend everything after ``lease+``."""
    for url in (pg_url, pg_url.replace("postgresql+psycopg://", "postgresql://", 1)):
        cls, rest = by_url(f"lease+{url}")
        assert cls is LeaseBackend and rest == url
    cls, rest = by_url(f"lease+sqlite:///{tmp_path / 'r.sqlite3'}")
    assert cls is LeaseBackend and rest == f"sqlite:///{tmp_path / 'r.sqlite3'}"


def test_lease_postgresql_without_a_driver_uses_psycopg(pg_url: str) -> None:
    celery_lease.migrate(pg_url)
    plain = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    app = make_app(plain)
    backend = backend_of(app)
    assert backend.db.url == pg_url
    tid = task_id()
    backend.store_result(tid, {"via": "postgresql://"}, states.SUCCESS)
    assert AsyncResult(tid, app=app).get(timeout=5) == {"via": "postgresql://"}
    assert backend.as_uri() == f"lease+{plain}"


# -- the key-value protocol ---------------------------------------------------------


def test_set_get_delete(app: Celery) -> None:
    backend = backend_of(app)
    key = f"k-{uuid.uuid4()}"
    assert backend.get(key) is None
    backend.set(key, '{"a": 1}')
    assert backend.get(key) == '{"a": 1}'
    backend.set(key, b'{"a": 2}')  # upsert; bytes are stored as text
    assert backend.get(key) == '{"a": 2}'
    backend.delete(key)
    assert backend.get(key) is None
    backend.delete(key)  # deleting an absent key is no error
    assert backend.get(key) is None


def test_mget_answers_in_key_order_with_none_for_absent_keys_across_batches(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = backend_of(app)
    monkeypatch.setattr(backend_module, "MGET_BATCH", 4)  # 11 keys: three statements
    keys = [f"m-{i}-{uuid.uuid4()}" for i in range(11)]
    for i, key in enumerate(keys):
        if i % 3:
            backend.set(key, json.dumps(i))
    values = backend.mget(keys)
    assert values == [None if i % 3 == 0 else json.dumps(i) for i in range(len(keys))]
    assert backend.mget([]) == []


def test_incr_is_atomic_across_threads(app: Celery) -> None:
    """8 threads, 40 increments each, on one key: every value 1..320 handed out once."""
    backend = backend_of(app)
    key = f"chord-unlock-{uuid.uuid4()}"
    threads_n, per_thread = 8, 40
    barrier = threading.Barrier(threads_n)
    seen: list[list[int]] = [[] for _ in range(threads_n)]
    errors: list[BaseException] = []

    def bump(i: int) -> None:
        try:
            barrier.wait(30)
            for _ in range(per_thread):
                seen[i].append(backend.incr(key))
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=bump, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    values = sorted(v for s in seen for v in s)
    assert values == list(range(1, threads_n * per_thread + 1))
    assert backend.get(key) == str(threads_n * per_thread)


def test_store_result_then_state_info_and_forget(app: Celery) -> None:
    backend = backend_of(app)
    ok, bad = task_id(), task_id()
    backend.store_result(ok, {"suite": [1, 2]}, states.SUCCESS)
    backend.mark_as_failure(bad, RuntimeError("boom"))
    result = AsyncResult(ok, app=app)
    assert (result.state, result.info, result.get(timeout=5)) == (
        states.SUCCESS,
        {"suite": [1, 2]},
        {"suite": [1, 2]},
    )
    failed = AsyncResult(bad, app=app)
    assert failed.state == states.FAILURE
    assert isinstance(failed.info, RuntimeError) and str(failed.info) == "boom"
    with pytest.raises(RuntimeError, match="boom"):
        failed.get(timeout=5)
    result.forget()
    assert AsyncResult(ok, app=app).state == states.PENDING
    assert backend.get(backend.get_key_for_task(ok)) is None


def test_a_success_is_not_overwritten_by_a_later_state(app: Celery) -> None:
    """Celery's key-value rule (a redelivered copy must not undo a SUCCESS) holds here."""
    backend = backend_of(app)
    tid = task_id()
    backend.store_result(tid, 1, states.SUCCESS)
    backend.store_result(tid, None, states.STARTED)
    assert AsyncResult(tid, app=app).state == states.SUCCESS


def test_groups_save_restore_and_get_many(app: Celery) -> None:
    backend = backend_of(app)
    ids = [task_id() for _ in range(3)]
    for i, tid in enumerate(ids):
        backend.store_result(tid, i * 10, states.SUCCESS)
    saved = GroupResult(str(uuid.uuid4()), [AsyncResult(t, app=app) for t in ids], app=app)
    saved.save()
    restored = GroupResult.restore(saved.id, app=app)
    assert restored is not None and [r.id for r in restored.results] == ids
    assert restored.join_native(timeout=5) == [0, 10, 20]
    many = dict(backend.get_many(ids, timeout=5))
    assert {t: m["result"] for t, m in many.items()} == dict(zip(ids, [0, 10, 20]))
    saved.delete()
    assert GroupResult.restore(saved.id, app=app) is None


def test_a_chord_counts_its_header_and_sends_the_callback_once(app: Celery) -> None:
    """Celery's chord protocol on this backend, as the worker runs it: the header is
    saved, each member's end calls on_chord_part_return, whose atomic incr lets the
    third (and only the third) send the callback; the counter and the saved
    header are removed after."""
    from celery.app.task import Context

    backend = backend_of(app)

    @app.task(name="contract.collect", shared=False)
    def collect(values: list[Any]) -> list[Any]:
        return values

    group_id, ids = str(uuid.uuid4()), [task_id() for _ in range(3)]
    callback = collect.s()
    backend.apply_chord((group_id, [AsyncResult(t, app=app) for t in ids]), callback)
    counter = backend.get_key_for_chord(group_id)
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        for i, tid in enumerate(ids):
            request = Context(id=tid, group=group_id, chord=callback, task="contract.member")
            backend.store_result(tid, i, states.SUCCESS, request=request)
            backend.on_chord_part_return(request, states.SUCCESS, i)
            assert backend.get(counter) == (None if i == 2 else str(i + 1))
        message = queue.get(timeout=5)
        assert (message.headers["task"], message.payload[0]) == ("contract.collect", [[0, 1, 2]])
        message.ack()
        with pytest.raises(queue.Empty):
            queue.get_nowait()  # sent once (synchronously, by the third member)
        queue.close()
    assert row(backend.db.url, counter) is None
    assert GroupResult.restore(group_id, app=app) is None


def test_result_extended_fields_are_stored(db_url: str) -> None:
    from celery.app.task import Context

    app = make_app(db_url, result_extended=True)
    backend = backend_of(app)
    tid = task_id()
    request = Context(id=tid, task="proj.add", args=[2, 3], kwargs={"z": 1}, retries=0)
    backend.store_result(tid, 5, states.SUCCESS, request=request)
    result = AsyncResult(tid, app=app)
    assert (result.name, result.args, result.kwargs, result.result) == (
        "proj.add",
        [2, 3],
        {"z": 1},
        5,
    )
    app.close()


# -- JSON only ------------------------------------------------------------------


def test_the_record_is_json_with_an_expiry_in_the_database_clock(app: Celery, db_url: str) -> None:
    backend = backend_of(app)
    tid = task_id()
    before = database(db_url).now()
    backend.store_result(tid, {"n": 1}, states.SUCCESS)
    after = database(db_url).now()
    stored = row(db_url, backend.get_key_for_task(tid))
    assert stored is not None
    meta = json.loads(stored["value"])
    assert (meta["status"], meta["result"], meta["task_id"]) == (states.SUCCESS, {"n": 1}, tid)
    assert stored["token"] is None  # reserved: nothing writes it yet
    expires = app.conf.result_expires.total_seconds()  # Celery's default: one day
    assert before + expires <= stored["expires_at"] <= after + expires


def test_a_value_json_cannot_hold_is_refused_and_nothing_is_written(app: Celery) -> None:
    backend = backend_of(app)
    tid = task_id()
    with pytest.raises(EncodeError):
        backend.store_result(tid, {1, 2}, states.SUCCESS)
    assert backend.get(backend.get_key_for_task(tid)) is None


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (
            {"result_serializer": "pickle", "accept_content": ["json", "pickle"]},
            "result_serializer",
        ),
        ({"result_accept_content": ["pickle"]}, "result_accept_content"),
    ],
)
def test_a_serializer_other_than_json_fails_when_the_backend_is_built(
    db_url: str, settings: dict[str, Any], named: str
) -> None:
    app = make_app(db_url, **settings)
    with pytest.raises(LeaseBackendConfigError) as caught:
        app.backend  # noqa: B018 - building it is the test
    message = str(caught.value)
    assert message.startswith(f"{named} must ") and "JSON only" in message, message
    assert "\n" not in message
    assert isinstance(caught.value, LeaseConfigError)
    assert isinstance(caught.value, ImproperlyConfigured)
    app.close()


# -- expiry and cleanup ---------------------------------------------------------------


def test_expired_rows_read_as_absent_and_cleanup_deletes_them(db_url: str) -> None:
    app = make_app(db_url, result_expires=0.5)
    backend = backend_of(app)
    short, kept, counter = task_id(), task_id(), f"chord-unlock-{uuid.uuid4()}"
    backend.store_result(short, "short", states.SUCCESS)
    backend.store_result(kept, "kept", states.SUCCESS)
    backend.expire(backend.get_key_for_task(kept), None)  # None (or 0): never expires
    assert backend.incr(counter) == 1
    backend.expire(counter, 0.5)
    short_key, kept_key = backend.get_key_for_task(short), backend.get_key_for_task(kept)

    wait_for(lambda: backend.get(short_key) is None, 10, "the short result to expire")
    wait_for(lambda: backend.get(counter) is None, 10, "the counter to expire")
    assert AsyncResult(short, app=app).state == states.PENDING
    assert row(db_url, short_key) is not None  # still there, read as absent
    assert backend.mget([short_key, kept_key]) == [None, backend.get(kept_key)]
    backend.expire(short_key, None)  # an expired row is not brought back
    assert backend.get(short_key) is None
    assert backend.incr(counter) == 1  # an expired counter starts again, with no expiry
    assert row(db_url, counter) == {"value": "1", "expires_at": None, "token": None}

    # Celery beat's celery.backend_cleanup task is a call to backend.cleanup().
    app.tasks["celery.backend_cleanup"]()
    assert row(db_url, short_key) is None
    assert AsyncResult(kept, app=app).result == "kept"
    assert row(db_url, counter) is not None
    app.close()


def test_cleanup_returns_what_it_deleted(db_url: str) -> None:
    app = make_app(db_url, result_expires=0.2)
    backend = backend_of(app)
    keys = [f"c-{uuid.uuid4()}" for _ in range(3)]
    for key in keys:
        backend.set(key, "1")
    wait_for(lambda: backend.mget(keys) == [None] * 3, 10, "the rows to expire")
    assert backend.cleanup() >= 3  # the module's database may hold other expired rows
    assert [row(db_url, k) for k in keys] == [None] * 3
    assert backend.cleanup() == 0
    app.close()


def test_failures_expire_after_result_failure_expires(db_url: str) -> None:
    app = make_app(db_url, result_expires=3600, result_failure_expires=60)
    backend = backend_of(app)
    ok, bad = task_id(), task_id()
    backend.store_result(ok, 1, states.SUCCESS)
    backend.mark_as_failure(bad, ValueError("x"))
    now = database(db_url).now()
    ok_row = row(db_url, backend.get_key_for_task(ok))
    bad_row = row(db_url, backend.get_key_for_task(bad))
    assert ok_row is not None and bad_row is not None
    assert now + 3500 < ok_row["expires_at"] <= now + 3600
    assert now < bad_row["expires_at"] <= now + 60
    app.close()


def test_no_result_expires_means_rows_never_expire(db_url: str) -> None:
    app = make_app(db_url, result_expires=None)
    backend = backend_of(app)
    tid = task_id()
    backend.store_result(tid, 1, states.SUCCESS)
    stored = row(db_url, backend.get_key_for_task(tid))
    assert stored is not None and stored["expires_at"] is None
    app.close()


# -- URLs, schema ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("lease://127.0.0.1/db", "is not a PostgreSQL or SQLite database URL"),
        ("lease+redis://127.0.0.1:6379/0", "is not a PostgreSQL or SQLite database URL"),
        ("lease+postgresql+asyncpg://127.0.0.1/db", "is not a PostgreSQL or SQLite database URL"),
        ("lease+sqlite://", "names no file"),
        ("lease+postgresql://u:hunter2@127.0.0.1:99999/db", "is not a TCP port"),
        ("lease+postgresql://u:hunter2@127.0.0.1:notaport/db", "cannot parse"),
    ],
)
def test_a_bad_url_fails_when_the_backend_is_built(setting: str, says: str) -> None:
    app = Celery("bad-url", broker="memory://", backend=setting, set_as_current=False)
    with pytest.raises(LeaseBackendConfigError) as caught:
        app.backend  # noqa: B018 - building it is the test
    message = str(caught.value)
    assert message.startswith("result_backend: ") and says in message, message
    assert "\n" not in message and "hunter2" not in message
    app.close()


def test_as_uri_masks_the_password(pg_url: str) -> None:
    secret = pg_url.replace("postgres@", "postgres:hunter2@", 1)
    app = make_app(secret)
    backend = backend_of(app)
    assert "hunter2" not in backend.as_uri() and backend.as_uri().startswith("lease+postgresql")
    assert backend.as_uri(include_password=True) == f"lease+{secret}"
    _, (cls, _, kwargs) = backend.__reduce__()
    assert cls is LeaseBackend and kwargs["url"] == secret  # a copy rebuilt elsewhere
    app.close()


@pytest.mark.parametrize("always_retry", [None, False])
def test_an_unreachable_database_is_store_unavailable_retried_three_times_by_default(
    always_retry: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like Celery's own database backend: transient errors are retried (3 times,
    with backoff) unless result_backend_always_retry says no; the error a reader
    finally gets (StoreUnavailable, or Celery's BackendGetMetaError once the
    retries are spent) is one of the backend's connection_errors, which the
    task layer reads as "the backend is unreadable"."""
    nowhere = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/db"  # nothing listens
    settings = {} if always_retry is None else {"result_backend_always_retry": always_retry}
    app = make_app(nowhere, **settings)
    backend = backend_of(app)
    backoffs: list[float] = []  # Celery sleeps once before each retry
    real_sleep = backend._sleep
    monkeypatch.setattr(backend, "_sleep", lambda s: (backoffs.append(s), real_sleep(s)))
    with pytest.raises(backend.connection_errors) as caught:
        backend.get_task_meta(task_id(), cache=False)
    fault = caught.value if always_retry is False else caught.value.__context__
    assert isinstance(fault, StoreUnavailable) and "Connection refused" in str(fault)
    if always_retry is None:
        assert isinstance(caught.value, BackendGetMetaError)
    assert len(backoffs) == (3 if always_retry is None else 0)
    app.close()


def test_postgresql_needs_lease_migrate_and_sqlite_migrates_itself(
    pg_server: PostgresServer, tmp_path: Path
) -> None:
    name = f"backend_bare_{uuid.uuid4().hex[:8]}"
    bare = pg_server.create_database(name)
    app = make_app(bare)
    try:
        with pytest.raises(LeaseConfigError, match="lease migrate"):
            backend_of(app).get("celery-task-meta-x")
        celery_lease.migrate(bare)
        backend_of(app).set("celery-task-meta-x", "1")
        assert backend_of(app).get("celery-task-meta-x") == "1"
    finally:
        app.close()
        database(bare).dispose()
        pg_server.drop_database(name)
    sqlite = make_app(f"sqlite:///{tmp_path / 'fresh.sqlite3'}")
    backend_of(sqlite).set("celery-task-meta-y", "2")  # a new file, migrated on first use
    assert backend_of(sqlite).get("celery-task-meta-y") == "2"
    sqlite.close()
