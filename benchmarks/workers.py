"""Real ``celery worker`` runs of the bench app: enqueue, start, drain, stop, read the times."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import benchapp
from benchmarks.cpu import CpuSampler
from benchmarks.env import ROOT, Env, log


@dataclass(frozen=True)
class Kind:
    """One per-task contender."""

    key: str
    label: str
    kind: str  # BENCH_KIND
    store: str | None = None  # "redis" | "pg" | "sqlite"
    results: str | None = None
    peer: bool = False
    ours: bool = False
    commit: bool = True  # LeasedTask's lease_commit
    lookup: bool = False  # floor: one more round trip (a SELECT by task id) before the body
    writes: int = 1  # floor: committed writes per task
    protocol: bool = False  # floor: celery-lease's own PostgreSQL statements, sent raw
    redis_hops: bool = False  # floor: the Redis + PostgreSQL commit order, trivial commands
    #: the result backend, every task's state stored: "db" (Celery's SQLAlchemy backend,
    #: PostgreSQL), "lease" (lease+, the PostgreSQL store's database), "redis"; None: none
    backend: str | None = None


KINDS = [
    Kind("plain", "plain `@app.task`", "plain"),
    Kind("once", "celery-once `QueueOnce`", "once", peer=True),
    Kind("singleton", "celery-singleton `Singleton`", "singleton", peer=True),
    Kind(
        "fencekit",
        "fencekit `idempotent_task` (IdempotencyGuard + DistributedLock)",
        "fencekit",
        peer=True,
    ),
    Kind("leased-redis-pg", "`LeasedTask`: Redis store + PostgreSQL results", "leased",
         "redis", "pg", ours=True),
    Kind("leased-pg-pg", "`LeasedTask`: PostgreSQL store + PostgreSQL results", "leased",
         "pg", "pg", ours=True),
    Kind("leased-sqlite", "`LeasedTask`: SQLite store + SQLite results", "leased",
         "sqlite", "sqlite", ours=True),
    Kind("leased-redis-nocommit", "`LeasedTask`: Redis store, `lease_commit=False` (lease "
         "only, no result; for comparison, not a target)", "leased", "redis", "pg",
         commit=False),
]  # fmt: skip

#: References for the full run (not targets, not peers): a plain task whose body writes
#: its result durably with one raw statement (no lease, no fencing), the cheapest a
#: design that records a result per task can do here. Separate from KINDS, so that
#: the round-trip count (section 3) does not run them.
FLOORS = [
    Kind("floor-pg", "floor: plain + one raw PostgreSQL `INSERT … ON CONFLICT DO NOTHING` "
         "per task (no lease; reference, not a target)", "floor", results="pg"),
    Kind("floor-pg-2rt", "floor: plain + a raw PostgreSQL `SELECT` by task id + the `INSERT` "
         "(2 round trips; reference, not a target)", "floor", results="pg", lookup=True),
    Kind("floor-sqlite", "floor: plain + one raw SQLite `INSERT`, committed "
         "(no lease; reference, not a target)", "floor", results="sqlite"),
    Kind("floor-sqlite-2tx", "floor: plain + two raw SQLite `INSERT`s, each committed "
         "(a claim's transaction and a commit's; reference, not a target)", "floor",
         results="sqlite", writes=2),
    Kind("floor-pg-protocol", "floor: plain + celery-lease's two PostgreSQL statements "
         "(claim-and-look-up, commit-and-release) sent with raw psycopg, no celery-lease "
         "code (reference, not a target)", "floor", results="pg", protocol=True),
    Kind("floor-redis-pg-5rt", "floor: plain + Redis `SET NX PX`, two PostgreSQL `SELECT`s "
         "by task id, Redis `DEL`, the PostgreSQL `INSERT` (5 round trips in the order of "
         "the Redis + PostgreSQL commit protocol; reference, not a target)", "floor",
         results="pg", lookup=True, redis_hops=True),
]  # fmt: skip


@dataclass
class Targets:
    """The stores one benchmark's runs use (shared by its runs, fresh per benchmark)."""

    env: Env
    db: int  # Redis database number: broker (broker server) and locks/leases (store server)
    pg_redis_results: str | None = None  # results for the Redis store
    pg_both: str | None = None  # PostgreSQL store + results
    sqlite: str | None = None
    floor_sqlite: str | None = None  # the floors' SQLite file (a sibling of ``sqlite``)
    pg_celery: str | None = None  # Celery's database backend (made at its first use)
    unavailable: dict[str, str] = field(default_factory=dict)
    _floors_ready: set[str] = field(default_factory=set)

    @classmethod
    def make(cls, env: Env, name: str) -> Targets:
        t = cls(env, env.redis_db())
        if env.has_pg:
            t.pg_redis_results = env.pg_database(f"{name}_rp")
            t.pg_both = env.pg_database(f"{name}_pp")
        t.sqlite = env.sqlite_url(name)
        t.floor_sqlite = env.sqlite_url(f"{name}_floor").removeprefix("sqlite:///")
        return t

    def close(self) -> None:
        for url in (self.pg_redis_results, self.pg_both, self.pg_celery):
            if url:
                with contextlib.suppress(Exception):
                    self.env.pg_drop(url)

    def available(self, k: Kind) -> str | None:
        """None if ``k`` can run here, else why not."""
        if ("pg" in (k.store, k.results) or k.backend in ("db", "lease")) and not self.env.has_pg:
            return "no PostgreSQL"
        if k.kind in ("once", "singleton", "fencekit"):
            return probe_peer(k.kind)
        return None

    def variables(self, k: Kind, queue: str, times_dir: Path) -> dict[str, str]:
        v = {
            "BENCH_KIND": k.kind,
            "BENCH_BROKER": self.env.broker_url(self.db),
            "BENCH_QUEUE": queue,
            "BENCH_LOCK_REDIS": self.env.store_url(self.db),
            "BENCH_TIMES_DIR": str(times_dir),
        }
        if k.kind == "leased":
            store = {
                "redis": self.env.store_url(self.db),
                "pg": self.pg_both,
                "sqlite": self.sqlite,
            }[k.store or ""]
            v["BENCH_STORE"] = str(store)
            if k.results:  # else lease_result_url is unset (its default)
                v["BENCH_RESULTS"] = str(
                    {
                        "pg": self.pg_redis_results if k.store == "redis" else self.pg_both,
                        "sqlite": self.sqlite,
                    }[k.results]
                )
            if not k.commit:
                v["BENCH_LEASE_COMMIT"] = "0"
        elif k.kind == "floor":
            self._prepare_floor(k)
            if k.results == "pg":
                assert self.pg_redis_results is not None
                v["BENCH_FLOOR_PG"] = self.env.pg_dsn(self.pg_redis_results.rsplit("/", 1)[1])
            else:
                v["BENCH_FLOOR_SQLITE"] = str(self.floor_sqlite)
            if k.lookup:
                v["BENCH_FLOOR_LOOKUP"] = "1"
            if k.writes != 1:
                v["BENCH_FLOOR_WRITES"] = str(k.writes)
            if k.redis_hops:
                v["BENCH_FLOOR_REDIS"] = self.env.store_url(self.db)
            if k.protocol:
                # celery-lease's tables and functions: the PG+PG LeasedTask's database
                assert self.pg_both is not None
                v["BENCH_FLOOR_PG"] = self.env.pg_dsn(self.pg_both.rsplit("/", 1)[1])
                v["BENCH_FLOOR_PROTOCOL"] = "1"
        if k.backend:
            v["BENCH_RESULT_BACKEND"] = self.backend_url(k.backend)
        return v

    def backend_url(self, backend: str) -> str:
        """``result_backend`` for a kind's backend: Celery's Redis backend (the lease
        store's Redis and database), lease+ (the PostgreSQL store's database), or
        Celery's database backend (a database of its own, its tables made here once)."""
        if backend == "redis":
            return self.env.store_url(self.db)
        assert self.pg_both is not None
        if backend == "lease":
            return f"lease+{self.pg_both}"
        if self.pg_celery is None:
            self.pg_celery = self.env.pg_database("celerydb", migrate=False)
            from celery import Celery

            # database_create_tables_at_setup (Celery's default): a backend makes its
            # tables when it is built; made here, no worker races another to it
            with Celery("bench-tables", set_as_current=False) as app:
                app.conf.result_backend = f"db+{self.pg_celery}"
                app.backend.ResultSession().close()
        return f"db+{self.pg_celery}"

    def _prepare_floor(self, k: Kind) -> None:
        """Create the floor's table before its worker starts (once per store)."""
        store = k.results or ""
        if store in self._floors_ready:
            return
        if store == "pg":
            import psycopg

            assert self.pg_redis_results is not None
            dsn = self.env.pg_dsn(self.pg_redis_results.rsplit("/", 1)[1])
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(benchapp.FLOOR_TABLE_PG)
        else:
            assert self.floor_sqlite is not None
            conn = benchapp.floor_sqlite_connect(self.floor_sqlite)
            try:
                conn.execute(benchapp.FLOOR_TABLE_SQLITE)
            finally:
                conn.close()
        self._floors_ready.add(store)


_probe_cache: dict[str, str | None] = {}


def probe_peer(kind: str) -> str | None:
    """Import the peer and build its app: None if it works with the installed Celery/redis-py."""
    if kind not in _probe_cache:
        try:
            benchapp.build({"BENCH_KIND": kind, "BENCH_QUEUE": "probe"})
            _probe_cache[kind] = None
        except Exception as e:  # noqa: BLE001 - reported as a skipped contender
            _probe_cache[kind] = f"{type(e).__name__}: {e}"
    return _probe_cache[kind]


_runs = itertools.count()


@dataclass
class RunResult:
    n: int
    completed: int
    rate: float  # tasks per second, first to last completion
    enqueue_rate: float
    drain_seconds: float
    times: list[tuple[float, int]]
    error: str | None = None
    #: CPU ms per task from the first to the last completion, by process group
    #: (``worker``: the worker and its pool processes, ``worker main``: its main
    #: process alone; ``PostgreSQL``; ``Redis``:
    #: broker and store; ``machine``: every process; ``iowait``); None if unknown
    cpu: dict[str, float] | None = None
    #: the state the result backend holds for the first and the last task sent, by
    #: task id (kinds with a backend, after a complete drain); None otherwise
    stored: dict[str, str] | None = None


class WorkerRun:
    """One worker of the bench app over one queue."""

    def __init__(
        self,
        targets: Targets,
        kind: Kind,
        pool: str,
        *,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.targets = targets
        self.kind = kind
        self.pool = pool
        self.id = f"{os.getpid()}-{next(_runs)}"
        self.queue = f"bench-{self.id}"
        self.dir = targets.env.tmpdir / f"run-{self.id}"
        self.times_dir = self.dir / "times"
        self.times_dir.mkdir(parents=True)
        self.vars = targets.variables(kind, self.queue, self.times_dir)
        self.vars.update(extra_env or {})
        # The publisher has no result backend (the workers have it): Celery's Redis
        # backend would subscribe it to every task's result channel (``on_task_call``).
        self.app, self.task = benchapp.build(self.vars, backend=False)
        self.first_id: str | None = None
        self.last_id: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.dir / "worker.log"
        self._arg = itertools.count()

    def enqueue(self, n: int) -> float:
        """Publish n tasks with distinct arguments (so distinct keys); returns tasks/s."""
        t0 = time.perf_counter()
        with self.app.producer_or_acquire() as producer:
            for _ in range(n):
                sent = self.task.apply_async((f"{self.id}-{next(self._arg)}",), producer=producer)
                self.first_id = self.first_id or sent.id
                self.last_id = sent.id
        return n / (time.perf_counter() - t0)

    def stored_states(self) -> dict[str, str]:
        """The state the workers' result backend holds for the first and the last task
        sent, read with an app configured as theirs."""
        app, _ = benchapp.build(self.vars)
        try:
            return {t: str(app.AsyncResult(t).state) for t in (self.first_id, self.last_id) if t}
        finally:
            app.close()

    def start(self) -> None:
        from tests.servers import spawn

        argv = [
            sys.executable, "-m", "celery", "-A", "benchmarks.benchapp", "worker",
            "-P", self.pool, "-c", "2" if self.pool == "prefork" else "1",
            "-Q", self.queue, "-n", f"bench-{self.id}@localhost", "-l", "WARNING",
            "--without-mingle", "--without-gossip", "--without-heartbeat",
        ]  # fmt: skip
        environ = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
        # The run's own TMPDIR, deleted with it: a worker stopped by SIGKILL
        # leaves billiard's temporary directory behind.
        tmp = self.dir / "tmp"
        tmp.mkdir(exist_ok=True)
        environ.update(PYTHONPATH=str(ROOT), TMPDIR=str(tmp), **self.vars)
        with open(self.log_path, "ab") as fh:
            self.proc = spawn(argv, log=fh, env=environ, cwd=str(ROOT))

    def completed(self) -> int:
        total = 0
        for f in self.times_dir.glob("times-*"):
            with contextlib.suppress(OSError):
                total += f.stat().st_size
        return total // benchapp.LINE

    def wait(self, n: int, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while True:
            done = self.completed()
            if done >= n:
                return None
            if self.proc is not None and self.proc.poll() is not None:
                return f"worker exited with {self.proc.returncode}: {self.log_tail()}"
            if time.monotonic() > deadline:
                return f"timed out after {timeout:.0f} s with {done}/{n} done: {self.log_tail()}"
            time.sleep(0.1)  # the rate comes from the workers' timestamps, not from this poll

    def stop(self, *, warm: bool = False) -> None:
        """SIGKILL the worker's process group; ``warm``: SIGTERM first and wait
        (a warm shutdown runs the shutdown signals, e.g. to dump a profile)."""
        proc = self.proc
        if proc is None:
            return
        if warm and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        self.proc = None

    def times(self) -> list[tuple[float, int]]:
        out: list[tuple[float, int]] = []
        for f in self.times_dir.glob("times-*"):
            for line in f.read_text().splitlines():
                t, c = line.split()
                out.append((float(t), int(c)))
        out.sort()
        return out

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def cleanup(self) -> None:
        self.stop()
        with contextlib.suppress(Exception):
            self.app.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def drain(targets: Targets, kind: Kind, pool: str, n: int, **kwargs: Any) -> RunResult:
    """Enqueue n tasks, then start a worker and time it from first to last completion."""
    run = WorkerRun(targets, kind, pool, **kwargs)
    try:
        t0 = time.monotonic()
        enq = run.enqueue(n)
        t1 = time.monotonic()
        sampler = CpuSampler(targets.env.server_groups()).start()
        try:
            run.start()
            assert run.proc is not None
            sampler.watch("worker", run.proc.pid)  # its own session: pgid = pid
            sampler.watch_alone("worker main", run.proc.pid)
            error = run.wait(n, timeout=max(90.0, n / 20))
        finally:
            sampler.stop()
        t2 = time.monotonic()
        run.stop()
        log(
            f"{kind.key}/{pool}: enqueue {t1 - t0:.2f} s, start+drain {t2 - t1:.2f} s, "
            f"stop {time.monotonic() - t2:.2f} s"
        )
        stored = run.stored_states() if kind.backend and not error else None
        times = run.times()
        if error:
            log(f"{kind.key}/{pool}: {error}")
        if len(times) >= 2 and times[-1][0] > times[0][0]:
            span = times[-1][0] - times[0][0]
            rate = (len(times) - 1) / span
        else:
            span, rate = float("nan"), float("nan")
        cpu = None
        if rate == rate:
            spent = sampler.between(times[0][0], times[-1][0])
            if spent is not None:
                cpu = {name: s * 1000 / (len(times) - 1) for name, s in spent.items()}
        return RunResult(n, len(times), rate, enq, span, times, error, cpu, stored)
    finally:
        run.cleanup()
