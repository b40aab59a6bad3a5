"""A process's first use of its stores: nothing sent when they are made; a
new SQLite database opened by several processes at the same moment.

A worker's pool child makes its stores on its first task, before the claim,
where an error fails the task instead of deferring it: making the lease
store, the result table and the ``lease+`` backend must send nothing, for
every kind of store (the last test, against stores that do not answer).

The embedded default creates and migrates its SQLite file on first use, in
whichever process gets there first: a worker's pool children all reach it on
their first task, together. Every way in (the lease store, the result table,
the ``lease+`` result backend, ``migrate()``) must then work in each of them;
none may answer "database is locked" because another is setting the file up.

Two processes that open a new file together set it up together: each
switches it to the WAL journal, and SQLite answers one of them "locked" at
once, without waiting out the busy timeout, because one holds the lock the
other's switch needs. The first test makes that lock state every time (a
write transaction open on the new file while the first use comes); the
second makes the real interleaving, :data:`PROCESSES` spawned processes (as
many as the machine has cores: more would take turns) opening each of
:data:`ROUNDS` new files at the same instant, which meets it only now and
then (a few rounds in a hundred).
"""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import BackendGetMetaError

import celery_lease
from celery_lease import LeaseStore, StoreUnavailable
from celery_lease.config import config
from celery_lease.results import ResultTable
from celery_lease.runtime import Runtime
from tests.servers import free_port

pytestmark = pytest.mark.timeout(180)

PROCESSES = 2
ROUNDS = 20
#: Seconds between rounds: more than a round's work takes.
SPACING = 0.15


def _first_use(way: str, url: str) -> None:
    """One process's first use of the database at ``url``, by ``way``."""
    if way == "store":
        lease = LeaseStore.from_url(url).claim(f"first-use-{uuid.uuid4().hex}", ttl=30)
        assert lease is not None
    elif way == "results":
        assert ResultTable(url).accepted(f"first-use-{uuid.uuid4().hex}") is None
    elif way == "backend":
        app = Celery("first-use", broker="memory://", backend=f"lease+{url}", set_as_current=False)
        task_id = uuid.uuid4().hex
        app.backend.store_result(task_id, {"ok": 1}, "SUCCESS")
        assert app.backend.get_task_meta(task_id)["result"] == {"ok": 1}
    elif way == "migrate":
        celery_lease.migrate(url)
    else:
        raise AssertionError(way)


def _racer(way: str, urls: list[str], barrier: Any, start: Any, errors: Any) -> None:
    # What the first use loads is loaded before the first barrier, so that
    # the processes' first statements on each file coincide.
    import alembic.command  # noqa: F401  (migrate's)

    import celery_lease.backend  # noqa: F401  (the lease+ backend's)

    # A barrier releases its waiters one by one, milliseconds apart on a
    # loaded machine: enough for the first process to finish setting a file
    # up before the others look. The rounds start at instants agreed on
    # instead, each process waking for them by the same clock.
    if barrier.wait(60) == 0:
        start.value = time.time() + 0.2
    barrier.wait(60)
    for i, url in enumerate(urls):
        _until(start.value + i * SPACING)
        try:
            _first_use(way, url)
        except BaseException:  # noqa: BLE001 - any failure is reported to the test
            errors.put(f"{url}: {traceback.format_exc(limit=4)}")
    errors.put(None)


def _until(instant: float) -> None:
    while (left := instant - time.time()) > 0.002:
        time.sleep(left - 0.002)
    while time.time() < instant:
        pass


WAYS = ["store", "results", "backend", "migrate"]


@pytest.mark.parametrize("way", WAYS)
def test_a_first_use_that_meets_a_write_in_progress_waits_for_it(way: str, tmp_path: Path) -> None:
    path = tmp_path / "new.sqlite3"
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("CREATE TABLE an_application_table (x)")
    assert writer.in_transaction  # the write lock is held: the fault is in place
    held = 0.5
    commit = threading.Timer(held, writer.execute, ("COMMIT",))
    commit.start()
    try:
        began = time.monotonic()
        _first_use(way, f"sqlite:///{path}")
        waited = time.monotonic() - began
    finally:
        commit.join()
        writer.close()
    # It met the lock (waited for the commit), and then got in.
    assert waited >= held - 0.1, f"the first use did not meet the write lock ({waited:.3f}s)"
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone() == ("wal",)


@pytest.mark.parametrize("way", WAYS)
def test_processes_opening_a_new_sqlite_database_together_all_get_in(
    way: str, tmp_path: Path
) -> None:
    urls = [f"sqlite:///{tmp_path / f'new-{i}.sqlite3'}" for i in range(ROUNDS)]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES)
    start = ctx.Value("d", 0.0)
    errors = ctx.Queue()
    procs = [
        ctx.Process(target=_racer, args=(way, urls, barrier, start, errors))
        for _ in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    failures: list[str] = []
    done = 0
    while done < PROCESSES:
        item = errors.get(timeout=150)
        if item is None:
            done += 1
        else:
            failures.append(item)
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    # Proof the processes met on new files: each file exists, set up once.
    assert all(Path(u.removeprefix("sqlite:///")).exists() for u in urls)
    assert not failures, f"{len(failures)} of {PROCESSES * ROUNDS} first uses failed:\n" + (
        "\n".join(failures[:3])
    )


# Every kind of store and result database, none of them answering: a port
# nothing listens on, or (SQLite) a directory where the file should be.
def _unreachable(kind: str, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    port = free_port()
    urls: dict[str, tuple[str, dict[str, Any]]] = {
        "redis": (f"redis://127.0.0.1:{port}/0", {}),
        "sentinel": (f"sentinel://127.0.0.1:{port}/0", {"master_name": "mymaster"}),
        "redis+cluster": (f"redis+cluster://127.0.0.1:{port}/0", {}),
        "etcd": (f"etcd://127.0.0.1:{port}", {}),
        "postgresql": (f"postgresql+psycopg://nobody@127.0.0.1:{port}/none", {}),
        "sqlite": (f"sqlite:///{tmp_path / 'a-directory.sqlite3'}", {}),
    }
    (tmp_path / "a-directory.sqlite3").mkdir(exist_ok=True)
    return urls[kind]


@pytest.mark.parametrize("results", ["postgresql", "sqlite"])
@pytest.mark.parametrize(
    "store", ["redis", "sentinel", "redis+cluster", "etcd", "postgresql", "sqlite"]
)
def test_making_a_processs_stores_sends_nothing(store: str, results: str, tmp_path: Path) -> None:
    """A pool child makes its stores on its first task, before the claim: what
    fails there fails the task instead of deferring it, so making them (the
    lease store, the result table, the ``lease+`` backend) must not send
    anything. Their first statements then meet the outage, and raise the
    error the claim and the look-up retry and defer on."""
    store_url, options = _unreachable(store, tmp_path)
    results_url, _ = _unreachable(results, tmp_path)
    app = Celery(
        "first-use", broker="memory://", backend=f"lease+{results_url}", set_as_current=False
    )
    app.conf.update(
        lease_store_url=store_url, lease_result_url=results_url, lease_store_options=options
    )
    rt = Runtime(config(app))  # what runtime() makes in each process
    backend = app.backend
    # The outage is real: each one's first statement meets it.
    with pytest.raises(StoreUnavailable):
        rt.store.claim(f"first-use-{uuid.uuid4().hex}", ttl=5)
    with pytest.raises(StoreUnavailable):
        rt.results.accepted(f"first-use-{uuid.uuid4().hex}")
    # (Celery retries a backend's read, then raises its own error from ours.)
    with pytest.raises(BackendGetMetaError) as raised:
        backend.get_task_meta(uuid.uuid4().hex)
    assert isinstance(raised.value.__cause__, StoreUnavailable)
