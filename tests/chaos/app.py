"""The chaos suite's Celery app, configured from ``CHAOS_*`` environment variables.

Three leased tasks over one body: ``chaos.exclusive`` (``lease_mode=
"exclusive"``), ``chaos.once`` (``once``, duplicates rejected) and
``chaos.once_return`` (``once``, duplicates return the accepted result).

The body keeps its own record, independent of the plugin: it appends to the
history file (``CHAOS_HISTORY``, one JSON line per event, fsync'd before the
body goes on) a ``start`` line (task id, key, token, the grant's store time,
its expiry), a ``renewed`` line each time its lease's confirmed expiry moves,
and an ``end`` line; each line carries the process's wall clock (skewed under
libfaketime) and ``CLOCK_MONOTONIC`` (never skewed: libfaketime runs with
``FAKETIME_DONT_FAKE_MONOTONIC=1``), from which the checker derives real time.
Before ending, the body writes one row to its own protected table
``chaos_protected`` through ``celery_lease.fencing.guard(conn, lease.key,
token)``, the documented way to fence a downstream write, and lets a refusal
(``StaleFencingToken``) propagate as a user would.

``task_prerun``/``task_postrun`` lines (delivery tag, redelivered flag, final
Celery state) help explain what happened to each message.

``chaos.probe`` (``exclusive``, a 1 s TTL, so a deferral comes back after
1 s) runs the same body on its own queue ``chaos.probe``, served by the probe
worker alone, which runs with a small ``lease_defer_max``
(``CHAOS_DEFER_MAX``): the long-outage faults publish probes on keys of their
own (no contention) and keep the server down until a probe was delivered more
than ``lease_defer_max`` times.

Every leased task here has one armed-only fault, ``kill_after_commit``: see
:class:`ChaosTask`.

``chaos.collect`` is the callback of the chords a run with ``--chords``
submits over ``chaos.exclusive`` members: a plain task that records a
``collected`` line (its task id, the values it got) per run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from celery import Celery, current_task
from celery.signals import before_task_publish, task_postrun, task_prerun
from sqlalchemy import Engine, create_engine, exc, text

from celery_lease import LeasedTask, StaleFencingToken, fencing
from celery_lease.scope import HEADER_DEFER_ID

__all__ = [
    "KILL_ARM",
    "POLICIES",
    "PROBE_QUEUE",
    "PUBLISH_ARM",
    "ChaosTask",
    "app",
    "build",
    "record",
    "tasks",
]

#: task name suffix per policy
POLICIES = {"exclusive": "exclusive", "once": "once", "once_return": "once_return"}
PROBE_QUEUE = "chaos.probe"
#: the arm file of ``kill_after_commit`` for worker ``<hostname>``, next to the history
KILL_ARM = "{history}.arm-kill-after-commit.{hostname}"
#: the arm file of ``publish_error``: the next re-publish on ``<hostname>`` fails
PUBLISH_ARM = "{history}.arm-publish-error.{hostname}"
#: a header no transport can encode: the publish fails inside kombu, with a
#: TypeError of its JSON encoder, not a connection or channel error
UNENCODABLE = "chaos_unencodable"


class ChaosTask(LeasedTask):
    """A leased task that can die between its fenced commit and its backend write.

    Celery's tracer stores SUCCESS after ``__call__`` returns; the plugin's
    ``__call__`` returns only once the fenced commit was accepted (a refused
    or duplicate commit raises). So, when the harness has armed this worker
    (the file ``KILL_ARM``, one shot: the execution that removes it fires),
    the process records ``kill_after_commit`` in the history and SIGKILLs
    itself right there: the result is accepted, the backend never heard of it.
    Inert unless armed.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        retval = super().__call__(*args, **kwargs)
        req = self.request
        history = os.environ.get("CHAOS_HISTORY")
        if not history or req.called_directly or not req.id:
            return retval
        arm = KILL_ARM.format(history=history, hostname=req.hostname)
        try:
            with open(arm) as fh:
                nonce = fh.read().strip()
            os.unlink(arm)  # only one execution succeeds: the shot is taken
        except FileNotFoundError:
            return retval
        token = retval.get("token") if isinstance(retval, dict) else None
        record(history, "kill_after_commit", task_id=req.id, token=token, nonce=nonce,
               host=req.hostname)  # fmt: skip
        os.kill(os.getpid(), signal.SIGKILL)
        return retval  # not reached


PROTECTED_DDL = """
CREATE TABLE IF NOT EXISTS chaos_protected (
    id BIGSERIAL PRIMARY KEY,
    key TEXT NOT NULL,
    token BIGINT NOT NULL,
    task_id TEXT NOT NULL,
    attempt TEXT NOT NULL,
    written_at DOUBLE PRECISION NOT NULL
)
"""
PROTECTED_INSERT = """
INSERT INTO chaos_protected (key, token, task_id, attempt, written_at)
VALUES (:key, :token, :task_id, :attempt, extract(epoch FROM clock_timestamp()))
"""


def build(environ: Mapping[str, str]) -> tuple[Celery, SimpleNamespace]:
    env = environ.get
    broker = env("CHAOS_BROKER", "redis://127.0.0.1:6379/0")
    app = Celery("chaos", broker=broker, backend=env("CHAOS_BACKEND"))
    app.conf.update(
        lease_store_url=env("CHAOS_STORE"),
        lease_result_url=env("CHAOS_RESULTS"),
        lease_ttl=float(env("CHAOS_TTL", "4")),
        lease_defer_max=int(env("CHAOS_DEFER_MAX", "1000000")),
        lease_store_retry=float(env("CHAOS_STORE_RETRY", "5")),
        task_routes={"chaos.probe": {"queue": PROBE_QUEUE}},
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        result_backend_always_retry=True,
        result_backend_max_retries=50,
        worker_hijack_root_logger=True,
    )
    if broker.startswith("amqp"):
        # A deferral moves the task into a new message: RabbitMQ must confirm
        # it before the old one is acked (see celery_lease.signals).
        app.conf.broker_transport_options = {"confirm_publish": True}
    if broker.startswith("redis"):
        app.conf.broker_transport_options = {
            "visibility_timeout": float(env("CHAOS_VT", "10")),
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            # The restore sweep's mutex (default 300 s) stays held when a worker
            # is killed or stopped mid-sweep, and then no worker restores anything.
            "unacked_mutex_expire": 30,
        }
    history = env("CHAOS_HISTORY")

    def leased(policy: str, **options: Any) -> Any:
        def run(self: Any, key: str, duration: float = 0.0, n: int = 0) -> dict[str, Any]:
            return _body(self, key, duration, n, policy, history, env("CHAOS_RESULTS"))

        run.__name__ = policy
        return app.task(
            base=ChaosTask,
            bind=True,
            shared=False,
            name=f"chaos.{policy}",
            lease_key="{key}",
            **options,
        )(run)

    @app.task(bind=True, shared=False, name="chaos.collect")
    def collect(self: Any, values: list[Any]) -> list[Any]:
        """A chord's callback (a plain task): each run and what it got, in the history."""
        record(history, "collected", task_id=self.request.id, values=values)
        return values

    tasks = SimpleNamespace(
        exclusive=leased("exclusive"),
        once=leased("once", lease_mode="once", lease_on_duplicate="reject"),
        once_return=leased("once_return", lease_mode="once", lease_on_duplicate="return"),
        probe=leased("probe", lease_ttl=1.0),
    )
    names = {t.name for t in vars(tasks).values()}
    tasks.collect = collect

    def prerun(task_id: str = "", task: Any = None, **kwargs: Any) -> None:
        if task is None or task.name not in names:
            return
        req = task.request
        record(
            history,
            "prerun",
            task_id=task_id,
            tag=str((getattr(req, "properties", None) or {}).get("delivery_tag", "")),
            redelivered=bool((req.delivery_info or {}).get("redelivered")),
            deferrals=int(getattr(req, "lease_deferrals", 0) or 0),
            defer_id=getattr(req, HEADER_DEFER_ID, None),
            host=req.hostname,
        )

    def postrun(task_id: str = "", task: Any = None, state: str = "", **kwargs: Any) -> None:
        if task is None or task.name not in names:
            return
        record(history, "postrun", task_id=task_id, state=state)

    def before_publish(headers: Any = None, **kwargs: Any) -> None:
        # Deterministic faults for regression tests, each once, in the process
        # that first re-publishes a given task (a worker child deferring it):
        # CHAOS_CRASH_BEFORE_REPUBLISH=<task id> dies right there (SIGKILL);
        # CHAOS_RUN_BEFORE_REPUBLISH=<task id>:<program> runs the program
        # first (the test's way to stop the broker at that very moment).
        # A re-publish of a deferral carries lease_defer_id: the armed fault
        # publish_error (and CHAOS_UNENCODABLE_REPUBLISH=<task id>) fails it.
        task_id = (headers or {}).get("id")
        if headers is not None and headers.get(HEADER_DEFER_ID):
            _publish_error(history, headers)
        crash = os.environ.get("CHAOS_CRASH_BEFORE_REPUBLISH")
        run, _, program = os.environ.get("CHAOS_RUN_BEFORE_REPUBLISH", "").partition(":")
        if not task_id or task_id not in (crash, run):
            return
        flag = f"{history}.before-republish-{task_id}"
        if os.path.exists(flag):
            return
        open(flag, "w").close()
        if task_id == run:
            subprocess.run([program], check=False, timeout=120)
        if task_id == crash:
            os.kill(os.getpid(), signal.SIGKILL)

    before_task_publish.connect(before_publish, weak=False, dispatch_uid=f"chaos.pub.{id(app)}")
    task_prerun.connect(prerun, weak=False, dispatch_uid=f"chaos.prerun.{id(app)}")
    task_postrun.connect(postrun, weak=False, dispatch_uid=f"chaos.postrun.{id(app)}")
    return app, tasks


def _publish_error(history: str | None, headers: dict[str, Any]) -> None:
    """Make this re-publish fail in kombu's encoder, once per arm (or per task id)."""
    task_id = headers.get("id")
    if history and task_id == os.environ.get("CHAOS_UNENCODABLE_REPUBLISH"):
        flag = f"{history}.unencodable-{task_id}"
        if not os.path.exists(flag):
            open(flag, "w").close()
            headers[UNENCODABLE] = object()
        return
    task = current_task
    hostname = getattr(getattr(task, "request", None), "hostname", None)
    if not history or not hostname:
        return
    arm = PUBLISH_ARM.format(history=history, hostname=hostname)
    try:
        with open(arm) as fh:
            nonce = fh.read().strip()
        os.unlink(arm)  # one shot
    except FileNotFoundError:
        return
    record(history, "publish_error", task_id=task_id, nonce=nonce, host=hostname)
    headers[UNENCODABLE] = object()


# -- the record --------------------------------------------------------------


def record(path: str | None, event: str, **fields: Any) -> None:
    """Append one fsync'd JSON line to the history file."""
    if not path:
        return
    line = {
        "ev": event,
        "wall": time.time(),
        "mono": time.monotonic(),
        "pid": os.getpid(),
        "skew": os.environ.get("CHAOS_SKEW", ""),
        **fields,
    }
    data = (json.dumps(line) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


_engines: dict[int, Engine] = {}
_engines_lock = threading.Lock()


def _engine(url: str) -> Engine:
    with _engines_lock:
        engine = _engines.get(os.getpid())
        if engine is None:
            engine = create_engine(
                url, pool_pre_ping=True, connect_args={"connect_timeout": 5}, pool_size=4
            )
            _engines[os.getpid()] = engine
        return engine


def _body(
    task: Any, key: str, duration: float, n: int, policy: str, history: str | None, db: Any
) -> dict[str, Any]:
    lease = task.lease
    req = task.request
    common = {
        "attempt": uuid.uuid4().hex,
        "task_id": req.id,
        "key": key,
        "token": lease.token,
        "policy": policy,
    }
    record(
        history,
        "start",
        **common,
        n=n,
        duration=duration,
        acquired_at=lease.lease.acquired_at,
        expires=lease.expires_at,
        host=req.hostname,
        redelivered=bool((req.delivery_info or {}).get("redelivered")),
        deferrals=int(getattr(req, "lease_deferrals", 0) or 0),
    )
    write: str | None = None
    try:
        seen = lease.expires_at
        deadline = time.monotonic() + duration
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.05, left))
            if lease.expires_at != seen:
                seen = lease.expires_at
                record(history, "renewed", **common, expires=seen, held=lease.held)
        # The fenced downstream write: one row per guarded write, retried while
        # the database is unreachable and the lease still held.
        while True:
            try:
                with _engine(db).begin() as conn:
                    fencing.guard(conn, lease.key, lease.token)
                    conn.execute(
                        text(PROTECTED_INSERT),
                        {
                            "key": key,
                            "token": lease.token,
                            "task_id": req.id,
                            "attempt": common["attempt"],
                        },
                    )
                break
            except StaleFencingToken:
                write = "refused"
                raise
            except exc.DBAPIError:
                if not lease.held:
                    write = "error"
                    lease.ensure()  # raises LeaseLost
                time.sleep(0.2)
    except BaseException as e:
        # Whatever ends the body, say so: the plugin releases the lease after it.
        record(
            history,
            "end",
            **common,
            expires=lease.expires_at,
            held=lease.held,
            write=write or f"exception:{type(e).__name__}",
        )
        raise
    record(history, "end", **common, expires=lease.expires_at, held=lease.held, write="ok")
    return {"key": key, "token": lease.token, "n": n}


app, tasks = build(os.environ)
