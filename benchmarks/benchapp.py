"""The Celery app the per-task benchmarks run in real workers, configured from env vars.

``BENCH_KIND`` picks the contender; every kind registers one task,
``bench.noop(i)``, whose body does nothing. A ``task_postrun`` handler (which
runs after the contender's own bookkeeping: commit, unlock, ...) appends the
completion time to ``$BENCH_TIMES_DIR/times-<pid>`` as a fixed-width line, so
the driver counts completions with ``stat`` and reads timestamps at the end.

Variables:

- ``BENCH_BROKER``: broker URL (Redis)
- ``BENCH_QUEUE``: queue name (one per run)
- ``BENCH_KIND``: ``plain`` | ``once`` | ``singleton`` | ``fencekit`` | ``leased`` |
  ``floor`` (a plain task whose body writes its result row with one raw statement:
  the cheapest durable result, for reference)
- ``BENCH_LOCK_REDIS``: the Redis the peers keep their locks in
- ``BENCH_STORE`` / ``BENCH_RESULTS``: ``lease_store_url`` / ``lease_result_url`` (leased);
  ``BENCH_LEASE_COMMIT=0``: ``lease_commit=False``
- ``BENCH_FLOOR_PG`` (libpq DSN) or ``BENCH_FLOOR_SQLITE`` (a file): where ``floor``
  writes; ``BENCH_FLOOR_LOOKUP=1``: one more round trip first (a ``SELECT`` by task id);
  ``BENCH_FLOOR_WRITES=2``: two committed writes (SQLite: a claim's transaction and a
  commit's); ``BENCH_FLOOR_PROTOCOL=1`` (PostgreSQL, a migrated celery-lease database):
  celery-lease's own two statements for one key (the claim-and-look-up call, the
  commit-and-release) sent with raw psycopg, no celery-lease code around them
- ``BENCH_RESULT_BACKEND``: ``result_backend``, and every task's state stored
  (``task_ignore_result`` off); unset: no result backend, nothing stored
- ``BENCH_TIMES_DIR``: where completion times go
- ``BENCH_SQL_TRACE``: count SQLite statements (the count is written with each time),
  and PostgreSQL round trips and statements as celery-lease's driver layer sends them
  (``celery_lease.sql.PG_TRAFFIC``: pipelining sends several statements per round trip)
- ``BENCH_CENSUS_EVERY``: every that many tasks, append tests/census.py's census of
  the process (celery-lease's live objects and reference cycles, glibc's heap) to
  ``census-<pid>.jsonl`` in ``BENCH_CENSUS_DIR`` (default: ``BENCH_TIMES_DIR``);
  ``BENCH_CENSUS_GARBAGE=1``: also every type left in reference cycles, by count;
  ``BENCH_TRACEMALLOC=1``: trace allocations from the first task, so the census
  includes celery-lease's traced bytes
- ``BENCH_PROFILE``: cProfile the tasks of a solo worker, dump stats there at shutdown
  (``BENCH_PROFILE_SKIP``: after that many warm-up tasks; ``BENCH_PROFILE_UNTIL``: stop
  after that many tasks)
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from celery import Celery
from celery.signals import task_postrun, task_prerun, worker_shutdown

#: bytes per line in the times files: "%17.6f %9d\n"
LINE = 28
_fd: dict[int, int] = {}
_sql_statements = [0]
_LITERAL = re.compile(r"'(?:[^']|'')*'|(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?(?![\w.])")
_sql_by_statement: dict[str, int] = {}
_completed = [0]

#: The floors' result table: a primary key on the task id and the result, nothing else.
FLOOR_TABLE_PG = (
    "CREATE TABLE IF NOT EXISTS bench_floor_results (task_id text PRIMARY KEY, result jsonb)"
)
FLOOR_TABLE_SQLITE = (
    "CREATE TABLE IF NOT EXISTS bench_floor_results (task_id TEXT PRIMARY KEY, result TEXT)"
)
#: Copied from celery-lease's SQLite connections (celery_lease/sql/driver.py: ``Database`` passes
#: ``timeout=30.0``; its connect listener sets autocommit (``isolation_level = None``),
#: ``journal_mode=WAL`` and ``busy_timeout=30000``; ``synchronous`` is left at the
#: default, FULL).
FLOOR_SQLITE_PRAGMAS = ("PRAGMA journal_mode=WAL", "PRAGMA busy_timeout=30000")


def floor_sqlite_connect(path: str) -> Any:
    import sqlite3

    conn = sqlite3.connect(path, timeout=30.0, check_same_thread=False, isolation_level=None)
    for pragma in FLOOR_SQLITE_PRAGMAS:
        conn.execute(pragma)
    return conn


class _Floor:
    """One connection per worker process (opened at its first task: prefork forks
    after import), autocommit: a statement is one round trip (PostgreSQL) or one
    committed transaction (SQLite)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.pg = environ.get("BENCH_FLOOR_PG")
        self.sqlite = environ.get("BENCH_FLOOR_SQLITE")
        if not (self.pg or self.sqlite):
            raise ValueError("BENCH_KIND=floor needs BENCH_FLOOR_PG or BENCH_FLOOR_SQLITE")
        self.lookup_first = environ.get("BENCH_FLOOR_LOOKUP") == "1"
        self.writes = int(environ.get("BENCH_FLOOR_WRITES", "1"))
        self.protocol = environ.get("BENCH_FLOOR_PROTOCOL") == "1"
        self.redis_url = environ.get("BENCH_FLOOR_REDIS")
        self.redis: Any = None
        mark = "%s" if self.pg else "?"
        self.insert = (
            f"INSERT INTO bench_floor_results (task_id, result) VALUES ({mark}, {mark}) "
            "ON CONFLICT DO NOTHING"
        )
        self.select = f"SELECT result FROM bench_floor_results WHERE task_id = {mark}"
        self.pid = -1
        self.cursor: Any = None

    def _cursor(self) -> Any:
        if self.pid != os.getpid():
            if self.pg:
                import psycopg

                self.cursor = psycopg.connect(self.pg, autocommit=True).cursor()
            else:
                self.cursor = floor_sqlite_connect(str(self.sqlite)).cursor()
            self.pid = os.getpid()
        return self.cursor

    def redis_hop(self, task_id: str, claim: bool) -> None:
        """One Redis round trip: ``SET NX PX`` (a claim) or ``DEL`` (a release)."""
        if self.redis is None or self.pid != os.getpid():
            import redis

            self._cursor()  # (re)opens the SQL connection and records the pid
            self.redis = redis.Redis.from_url(str(self.redis_url))
        key = f"floor-{task_id}"
        if claim:
            self.redis.set(key, task_id, nx=True, px=30000)
        else:
            self.redis.delete(key)

    def lookup(self, task_id: str) -> Any:
        cursor = self._cursor()
        cursor.execute(self.select, (task_id,))
        return cursor.fetchone()

    def write(self, task_id: str, result: Any) -> None:
        cursor = self._cursor()
        if self.writes == 2:  # the claim's transaction, then the commit's
            cursor.execute(self.insert, (f"claim-{task_id}", "null"))
        cursor.execute(self.insert, (task_id, json.dumps(result)))

    def claim_and_commit(self, task_id: str, result: Any) -> None:
        """celery-lease's PostgreSQL statements for one key, sent raw (leases and
        results in one database): what ``LeasedTask`` sends, without its code."""
        from celery_lease.sql import queries as q

        cursor = self._cursor()
        key = f"floor-{task_id}"
        cursor.execute(
            q.PG_CLAIM_LOOKUP_PY,
            {"key": key, "owner_id": task_id, "ttl": 30.0, "task_id": task_id,
             "task_name": "bench.noop", "root_id": None, "tenant": None, "once": False},
        )  # fmt: skip
        token = cursor.fetchone()[0]
        cursor.execute(
            q.PG_COMMIT_COLOCATED_PY[True, False, True],  # release, not once, one key
            {"key": key, "token": token, "task_id": task_id, "task_name": "bench.noop",
             "owner_id": task_id, "tenant": None, "root_id": None,
             "result": json.dumps(result)},
        )  # fmt: skip
        cursor.fetchone()


def build(environ: Mapping[str, str], *, backend: bool = True) -> tuple[Celery, Any]:
    """The app and its task; ``backend=False``: publish as the workers' app would (the
    messages ask for the result to be stored) but with no result backend of its own."""
    env = environ.get
    kind = env("BENCH_KIND", "plain")
    queue = env("BENCH_QUEUE", "bench")
    app = Celery(f"bench_{kind}", broker=env("BENCH_BROKER", "redis://127.0.0.1:6379/0"))
    stored = env("BENCH_RESULT_BACKEND")
    app.conf.update(
        result_backend=stored if stored and backend else None,
        task_ignore_result=not stored,  # apply_async puts it in the message
        task_default_queue=queue,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=4,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        task_send_sent_event=False,
        worker_send_task_events=False,
    )
    lock_redis = env("BENCH_LOCK_REDIS", "redis://127.0.0.1:6379/1")
    name = "bench.noop"

    if kind == "plain":

        @app.task(name=name, shared=False)
        def noop(i: int) -> None:
            return None

    elif kind == "once":
        import celery_once.backends.redis as once_redis
        from celery_once import QueueOnce

        once_redis.redis = None  # it caches the first URL's client for the whole process

        app.conf.ONCE = {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": lock_redis, "default_timeout": 3600},
        }

        @app.task(name=name, shared=False, base=QueueOnce, once={"graceful": False})
        def noop(i: int) -> None:
            return None

    elif kind == "singleton":
        import celery_singleton.backends as singleton_backends
        from celery_singleton import Singleton

        singleton_backends._backend = None  # it caches the first URL's backend per process

        app.conf.singleton_backend_url = lock_redis
        app.conf.singleton_lock_expiry = 3600

        @app.task(name=name, shared=False, base=Singleton)
        def noop(i: int) -> None:
            return None

    elif kind == "fencekit":
        import redis
        from fencekit import DistributedLock, IdempotencyGuard
        from fencekit.celery import idempotent_task

        client = redis.Redis.from_url(lock_redis, decode_responses=True)
        guard = IdempotencyGuard(client)
        lock = DistributedLock(client)

        @app.task(name=name, shared=False, bind=True)
        @idempotent_task(
            guard,
            lock,
            key=lambda i: f"bench-{i}",
            lock_resource=lambda i: f"bench-{i}",
            idempotency_ttl=timedelta(hours=1),
            lock_ttl=timedelta(seconds=30),
        )
        def noop(self: Any, i: int) -> None:
            return None

    elif kind == "leased":
        from celery_lease import LeasedTask

        app.conf.update(
            lease_store_url=env("BENCH_STORE"),
            lease_result_url=env("BENCH_RESULTS"),
            lease_ttl=30,
        )

        # bench.noop(i) -> key "bench-<i>": a distinct key per task
        @app.task(
            name=name,
            shared=False,
            base=LeasedTask,
            bind=True,
            lease_key="bench-{i}",
            lease_commit=env("BENCH_LEASE_COMMIT", "1") != "0",
        )
        def noop(self: Any, i: int) -> None:
            return None

    elif kind == "floor":
        floor = _Floor(environ)

        # the lookup stands for the claim a lease needs at minimum; the write for the commit
        @app.task(name=name, shared=False, bind=True)
        def noop(self: Any, i: int) -> None:
            result = None
            if floor.protocol:
                floor.claim_and_commit(self.request.id, result)
                return result
            if floor.redis_url:
                # the Redis + SQL commit order: claim in Redis; register and look up;
                # at the commit, lock the fence row, check and release in Redis, write
                floor.redis_hop(self.request.id, claim=True)
                floor.lookup(self.request.id)
                floor.lookup(self.request.id)
                floor.redis_hop(self.request.id, claim=False)
            elif floor.lookup_first:
                floor.lookup(self.request.id)
            floor.write(self.request.id, result)
            return result

    else:
        raise ValueError(f"unknown BENCH_KIND {kind!r}")

    if env("BENCH_SQL_TRACE"):
        _install_sql_trace()
    if env("BENCH_SQLITE_CACHE_KIB"):
        _bound_sqlite_cache(int(str(env("BENCH_SQLITE_CACHE_KIB"))))
    return app, noop


def _bound_sqlite_cache(kib: int) -> None:
    """Every SQLite connection's page cache at ``kib`` KiB (the memory soak's
    check that the SQLite row's growth is its page cache filling up)."""
    import sqlite3

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    @event.listens_for(Engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        if isinstance(dbapi_connection, sqlite3.Connection):
            dbapi_connection.execute(f"PRAGMA cache_size=-{kib}")


def _install_sql_trace() -> None:
    """Count every statement SQLite runs (BEGIN and COMMIT included), and
    PostgreSQL's round trips in celery-lease's driver layer (off by default)."""
    import sqlite3

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from celery_lease.sql import count_pg_traffic

    count_pg_traffic()

    def count(stmt: str) -> None:
        _sql_statements[0] += 1
        # the trace callback sees the SQL with its parameters expanded: fold them back
        head = _LITERAL.sub("?", " ".join(stmt.split()))[:120]
        _sql_by_statement[head] = _sql_by_statement.get(head, 0) + 1

    @event.listens_for(Engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        if isinstance(dbapi_connection, sqlite3.Connection):
            dbapi_connection.set_trace_callback(count)


def _write_time(**_: Any) -> None:
    pid = os.getpid()
    fd = _fd.get(pid)
    if fd is None:
        path = os.path.join(os.environ["BENCH_TIMES_DIR"], f"times-{pid}")
        fd = _fd[pid] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, b"%17.6f %9d\n" % (time.time(), _sql_statements[0]))
    if os.environ.get("BENCH_SQL_TRACE"):
        # counting runs only: the per-statement histogram after warm-up and at the end
        _completed[0] += 1
        directory = os.environ["BENCH_TIMES_DIR"]
        from celery_lease.sql import PG_TRAFFIC

        for name, data in (
            ("sqlhist", json.dumps(_sql_by_statement)),
            ("pgtraffic", json.dumps(PG_TRAFFIC)),
        ):
            if _completed[0] == int(os.environ.get("BENCH_SQL_WARM", "0")):
                with open(os.path.join(directory, f"{name}-warm-{pid}.json"), "w") as fh:
                    fh.write(data)
            with open(os.path.join(directory, f"{name}-last-{pid}.json"), "w") as fh:
                fh.write(data)


_profiler: Any = None


_prerun = [0]


def _start_profile(**_: Any) -> None:
    """Start profiling at the task after ``BENCH_PROFILE_SKIP`` warm-up tasks."""
    global _profiler
    _prerun[0] += 1
    if _prerun[0] <= int(os.environ.get("BENCH_PROFILE_SKIP", "0")):
        return
    if _profiler is None and os.environ.get("BENCH_PROFILE"):
        import cProfile

        _profiler = cProfile.Profile()
        _profiler.enable()


_postrun = [0]


def _dump_profile(**_: Any) -> None:
    global _profiler
    if _profiler is not None:
        _profiler.disable()
        _profiler.dump_stats(os.environ["BENCH_PROFILE"])
        _profiler = None


def _stop_profile(**_: Any) -> None:
    """Stop and dump after task ``BENCH_PROFILE_UNTIL`` (so idle time is not profiled)."""
    _postrun[0] += 1
    if _postrun[0] == int(os.environ.get("BENCH_PROFILE_UNTIL", "0")):
        _dump_profile()


_census_count = [0]


def _garbage() -> dict[str, int]:
    """The types of the objects only the cycle collector can free, by count (what
    reference counting left behind since the last collection)."""
    import gc
    from collections import Counter

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
    return dict(found.most_common(40))


def _census(**_: Any) -> None:
    """A census of this process every ``BENCH_CENSUS_EVERY`` tasks (memory soaks)."""
    _census_count[0] += 1
    if _census_count[0] == 1 and os.environ.get("BENCH_TRACEMALLOC") == "1":
        import tracemalloc

        tracemalloc.start(1)
    if _census_count[0] % int(os.environ["BENCH_CENSUS_EVERY"]):
        return
    from tests.census import take

    garbage = _garbage() if os.environ.get("BENCH_CENSUS_GARBAGE") == "1" else None
    record = {"done": _census_count[0], **take(), "garbage": garbage}
    record.pop("packages", None)
    directory = os.environ.get("BENCH_CENSUS_DIR") or os.environ["BENCH_TIMES_DIR"]
    path = os.path.join(directory, f"census-{os.getpid()}.jsonl")
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


if os.environ.get("BENCH_TIMES_DIR"):
    task_postrun.connect(_write_time, weak=False, dispatch_uid="bench.times")
if os.environ.get("BENCH_CENSUS_EVERY"):
    task_postrun.connect(_census, weak=False, dispatch_uid="bench.census")
if os.environ.get("BENCH_PROFILE"):
    task_prerun.connect(_start_profile, weak=False, dispatch_uid="bench.profile")
    task_postrun.connect(_stop_profile, weak=False, dispatch_uid="bench.profile.stop")
    worker_shutdown.connect(_dump_profile, weak=False, dispatch_uid="bench.profile.dump")

app, noop = build(os.environ) if os.environ.get("BENCH_KIND") else (None, None)
