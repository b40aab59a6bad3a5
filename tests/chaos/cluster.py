"""The chaos suite's cluster: private servers and supervised ``celery worker`` processes.

* a Redis for the broker (AOF, ``appendfsync always``, automatic rewrites
  off, so its AOF is the complete record :mod:`tests.chaos.aof` reads), or
  RabbitMQ with ``--broker amqp``;
* a Redis for the leases (AOF, ``appendfsync always``), or with
  ``store="pg"`` the leases in the result database below;
* a Redis for Celery's result backend (never faulted), or with
  ``backend="lease"`` no such Redis: the ``lease+`` backend on the result
  database below (faulted with it), its every write copied by a trigger into
  ``chaos_meta_history`` (:mod:`tests.chaos.backends`);
* a PostgreSQL cluster for the fenced result table and ``chaos_protected``;
* a spare Redis, a replica of the lease store, so that ``store_readonly`` can
  fail the store over to it (``FAILOVER``) and back, and no data is lost;
* N workers of :mod:`tests.chaos.app` (the first with ``-P threads``, the
  others prefork), each in its own process group, optionally started under
  ``faketime -f '+1h'`` (``FAKETIME_DONT_FAKE_MONOTONIC=1``), and
  restarted by a supervisor thread whenever one exits by itself (kombu's
  Redis transport can make a worker exit when the broker restarts) or stops
  starting the tasks its queue holds (:mod:`tests.chaos.liveness`);
* one more worker, ``probe`` (prefork, two children: one per concurrent long
  outage, store and result database), alone on the queue
  ``chaos.probe`` and with a small ``lease_defer_max`` (``DEFER_MAX``), for
  the long-outage faults' probe tasks; no fault targets it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from tests import faketime
from tests.chaos import liveness, stacks
from tests.chaos.app import PROBE_QUEUE, PROTECTED_DDL
from tests.chaos.backends import META_HISTORY_DDL
from tests.servers import (
    PostgresServer,
    RabbitMQServer,
    RedisServer,
    signal_group,
    spawn,
    wait_for,
)
from tests.workers import Worker, _state

__all__ = ["DEFER_MAX", "STORE_RETRY", "ChaosWorker", "Cluster"]

#: the probe worker's ``lease_defer_max``: a long outage outlasts this many deferrals
DEFER_MAX = 3
#: pool slots of the probe worker (the long outages' probes)
PROBE_CONCURRENCY = 4
#: every worker's ``lease_store_retry`` (seconds)
STORE_RETRY = 1.0


class ChaosWorker(Worker):
    """A supervised worker of the chaos app; ``skew`` is a faketime offset or None."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        logdir: Path,
        *,
        pool: str,
        concurrency: int,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        super().__init__(
            name,
            env,
            logdir,
            concurrency=concurrency,
            pool=pool,
            app="tests.chaos.app",
            extra_args=extra_args,
        )
        self.pool = pool
        self.base_argv = list(self.argv)
        self.base_env = dict(self.env)
        self.skew: str | None = None
        self.lock = threading.Lock()  # held by a fault (or the supervisor) acting on it
        self.launches = 0
        self.exits = 0  # exits the supervisor noticed (not caused by a fault)

    def launch(self, skew: str | None = None) -> None:
        """Start (without waiting for readiness), under faketime if ``skew``."""
        self.skew = skew
        self.argv = list(self.base_argv)
        self.env = dict(self.base_env)
        self.env.pop("LD_PRELOAD", None)
        self.env["CHAOS_SKEW"] = skew or ""
        if skew:
            self.argv = faketime.command(skew, self.base_argv)
            self.env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
            # see faketime_site/sitecustomize.py: time.sleep under libfaketime 0.9.10
            self.env["PYTHONPATH"] = os.pathsep.join(
                [str(Path(__file__).resolve().parent / "faketime_site"), self.env["PYTHONPATH"]]
            )
        self._log = open(self.log_path, "ab")
        self._log.write(f"\n=== chaos: launching {self.name} skew={skew or 'none'} ===\n".encode())
        self._log.flush()
        self.proc = spawn(self.argv, log=self._log, env=self.env, cwd=str(self._cwd()))
        self.launches += 1

    @staticmethod
    def _cwd() -> Path:
        return Path(__file__).resolve().parent.parent.parent

    def wait_ready(self, timeout: float = 90.0) -> None:
        offset = 0
        wait_for(
            lambda: self.log_text(offset).count(" ready.") >= self.launches,
            timeout,
            f"worker {self.name} ready",
        )

    def main_pid(self) -> int | None:
        """The celery main process (the faketime wrapper's child when skewed)."""
        if not self.alive():
            return None
        if not self.skew:
            return self.pid
        kids = _children(self.pid)
        return kids[0] if kids else None

    def pool_children(self) -> list[int]:
        main = self.main_pid()
        return _children(main) if main else []

    def stopped(self) -> bool:
        return self.alive() and _state(self.pid) == "T"

    def terminate(self, grace: float = 10.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL of the group after ``grace``."""
        if not self.alive():
            self.kill()
            return
        signal_group(self.pid, signal.SIGCONT)
        main = self.main_pid()
        with contextlib.suppress(ProcessLookupError):
            os.kill(main or self.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            found += [int(p) for p in (task / "children").read_text().split()]
    return found


class Cluster:
    def __init__(
        self,
        workdir: Path,
        *,
        broker: str,
        backend: str = "redis",
        store: str = "redis",
        workers: int,
        concurrency: int,
        ttl: float,
        vt: float,
        log: Any = print,
    ) -> None:
        self.workdir = workdir
        self.broker_kind = broker
        self.backend_kind = backend
        self.store_kind = store
        self.ttl = ttl
        self.vt = vt
        self.log = log
        self.n_workers = workers
        self.concurrency = concurrency
        self.history = workdir / "history.jsonl"
        self.servers_dir = workdir / "servers"
        self.logdir = workdir / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.broker_redis: RedisServer | None = None
        self.rabbit: RabbitMQServer | None = None
        self.store: RedisServer | None = None
        self.backend: RedisServer | None = None
        self.pg: PostgresServer | None = None
        self.spare: RedisServer | None = None
        self.workers: list[ChaosWorker] = []
        self.probe: ChaosWorker | None = None
        self.env: dict[str, str] = {}
        self.locks = {name: threading.Lock() for name in ("broker", "store", "pg")}
        self._supervising = False
        self._supervisor: threading.Thread | None = None
        self.supervisor_restarts = 0
        self.liveness_restarts = 0
        self.liveness: liveness.Liveness | None = None
        #: seconds between liveness checks (each reads the broker)
        self.liveness_every = 5.0

    # -- servers ---------------------------------------------------------

    def start_servers(self) -> None:
        d = self.servers_dir
        started = time.monotonic()
        if self.broker_kind == "redis":
            self.broker_redis = RedisServer(
                d, appendonly=True, appendfsync="always",
                extra_args=["--auto-aof-rewrite-percentage", "0"],
            )  # fmt: skip
            self.broker_redis.start()
            broker_url = self.broker_redis.url(0)
        else:
            self.rabbit = RabbitMQServer(d)
            self.rabbit.start()
            broker_url = self.rabbit.url()
        self.store = RedisServer(
            d, appendonly=True, appendfsync="always",
            extra_args=["--repl-diskless-sync-delay", "0"],
        )  # fmt: skip
        self.store.start()
        self.spare = RedisServer(d, appendonly=False)
        self.spare.start()
        self.spare.command("REPLICAOF", "127.0.0.1", str(self.store.port))
        if self.backend_kind == "redis":
            self.backend = RedisServer(d, appendonly=True, appendfsync="always")
            self.backend.start()
        self.pg = PostgresServer(d, settings={"max_connections": 300})
        self.pg.start()
        results_url = self.pg.create_database("chaos")
        import celery_lease

        celery_lease.migrate(results_url)
        engine = create_engine(results_url)
        with engine.begin() as conn:
            conn.execute(text(PROTECTED_DDL))
            for ddl in META_HISTORY_DDL if self.backend is None else []:
                conn.execute(text(ddl))
        engine.dispose()
        self.results_url = results_url
        self.env = {
            "CHAOS_BROKER": broker_url,
            # lease+: lease_result_url is the same database, so a leased task's
            # SUCCESS is written in its commit's transaction.
            "CHAOS_BACKEND": self.backend.url(0) if self.backend else f"lease+{results_url}",
            # pg: the leases in the result database (one statement per step)
            "CHAOS_STORE": self.store.url(0) if self.store_kind == "redis" else results_url,
            "CHAOS_RESULTS": results_url,
            "CHAOS_HISTORY": str(self.history),
            "CHAOS_TTL": str(self.ttl),
            "CHAOS_VT": str(self.vt),
            "CHAOS_STORE_RETRY": str(STORE_RETRY),
        }
        (self.workdir / "env.json").write_text(json.dumps(self.env, indent=1))
        self.log(f"servers up in {time.monotonic() - started:.1f}s")

    def servers(self) -> list[Any]:
        return [
            s
            for s in (self.broker_redis, self.rabbit, self.store, self.backend, self.pg, self.spare)
            if s
        ]

    def all_workers(self) -> list[ChaosWorker]:
        return self.workers + ([self.probe] if self.probe is not None else [])

    # -- workers ---------------------------------------------------------

    def start_workers(self) -> None:
        for i in range(self.n_workers):
            pool = "threads" if i == 0 else "prefork"
            w = ChaosWorker(f"w{i}", self.env, self.logdir, pool=pool, concurrency=self.concurrency)
            self.workers.append(w)
            w.launch()
        # Four slots: copies of an earlier probe that are still deferring (an
        # outage's copies multiply when a broker reconnect restores them next
        # to their re-published successors) must leave a slot for the new one.
        self.probe = ChaosWorker(
            "probe", {**self.env, "CHAOS_DEFER_MAX": str(DEFER_MAX)}, self.logdir,
            pool="prefork", concurrency=PROBE_CONCURRENCY, extra_args=("-Q", "chaos.probe"),
        )  # fmt: skip
        self.probe.launch()
        for w in self.all_workers():
            w.wait_ready()
        self.log(f"{len(self.workers)} workers ready")

    def supervise(self) -> None:
        held = (
            liveness.held_in_redis(self.env["CHAOS_BROKER"])
            if self.rabbit is None
            else liveness.held_in_rabbitmq(self.rabbit)
        )
        self.liveness = liveness.Liveness(self.history, held)
        self._supervising = True
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._supervisor.start()

    def _supervise(self) -> None:
        checked = time.monotonic()
        while self._supervising:
            for w in self.all_workers():
                if w.alive() or not w.lock.acquire(blocking=False):
                    continue
                try:
                    if not w.alive() and self._supervising:
                        code = w.proc.returncode if w.proc is not None else None
                        w.kill()  # reap what is left of its group
                        w.exits += 1
                        self.supervisor_restarts += 1
                        self.log(f"supervisor: {w.name} exited ({code}); restarting")
                        w.launch(w.skew)
                finally:
                    w.lock.release()
            if time.monotonic() - checked >= self.liveness_every:
                checked = time.monotonic()
                try:
                    self._check_liveness(checked)
                except Exception as e:  # noqa: BLE001 - the broker may be down: next time
                    self.log(f"supervisor: liveness check failed: {e!r}")
            time.sleep(0.5)

    def _check_liveness(self, now: float) -> None:
        assert self.liveness is not None
        self.liveness.read(now)
        for w in self.all_workers():
            queue = PROBE_QUEUE if w is self.probe else "celery"
            if not self.liveness.stalled(w.hostname, queue, now):
                continue
            if not w.lock.acquire(blocking=False):
                continue  # a fault is acting on it (a SIGSTOP is no stall)
            try:
                label = time.strftime("%H%M%S")
                stacks.dump([w], self.workdir / "stacks", f"{label}-liveness")
                self.liveness_restarts += 1
                self.log(
                    f"supervisor: {w.name} started no task for {self.liveness.stall:.0f}s while "
                    f"its queue held messages; stacks taken; restarting"
                )
                w.terminate(grace=10.0)
                w.launch(w.skew)
                self.liveness.restarted(w.hostname, time.monotonic())
            finally:
                w.lock.release()

    def stop_supervising(self) -> None:
        self._supervising = False
        if self._supervisor is not None:
            self._supervisor.join(5)

    def stop_workers(self) -> None:
        for w in self.all_workers():
            with contextlib.suppress(Exception):
                w.terminate(grace=15.0)

    def shutdown(self) -> None:
        self.stop_supervising()
        for w in self.all_workers():
            with contextlib.suppress(Exception):
                w.kill()
        for s in self.servers():
            with contextlib.suppress(Exception):
                s.cleanup()
