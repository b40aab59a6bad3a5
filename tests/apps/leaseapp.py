"""A Celery app for acceptance tests, configured from CL_* environment variables.

Every task body appends its start and end to an independent, fsync'd
execution log (``CL_LOG``), so tests count executions without trusting the
plugin's own tables.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from celery import Celery, current_task, states
from celery.exceptions import Ignore
from celery.signals import before_task_publish

from celery_lease import LeasedTask


def build(environ: Mapping[str, str]) -> tuple[Celery, SimpleNamespace]:
    """The app and its tasks, configured from ``environ`` (workers: os.environ;
    tests: the same variables, to publish and read results as a client)."""
    env = environ.get
    app = Celery(
        "leaseapp",
        broker=env("CL_BROKER", "redis://127.0.0.1:6379/10"),
        backend=env("CL_BACKEND", "redis://127.0.0.1:6379/11"),
    )
    app.conf.update(
        lease_store_url=env("CL_STORE", "sqlite:///celery-lease-test.sqlite3"),
        lease_result_url=env("CL_RESULTS") or None,
        lease_ttl=float(env("CL_TTL", "3")),
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_track_started=env("CL_TRACK_STARTED", "1") == "1",
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    if env("CL_VT"):
        app.conf.broker_transport_options = {
            "visibility_timeout": float(env("CL_VT", "3600")),
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        }
    if env("CL_SETTINGS"):
        app.conf.update(json.loads(env("CL_SETTINGS", "{}")))

    def leased(name: str, **options: Any) -> Any:
        def run(self: Any, key: str, sleep: float = 0.0, tag: str = "") -> dict[str, Any]:
            return _body(self, key, sleep, tag, env("CL_LOG"))

        run.__name__ = name
        return app.task(
            base=LeasedTask,
            bind=True,
            shared=False,
            name=f"leaseapp.{name}",
            lease_key="{key}",
            **options,
        )(run)

    tasks = SimpleNamespace(
        work=leased("work"),
        work_once=leased("work_once", lease_mode="once"),
        work_reject=leased("work_reject", lease_on_conflict="reject"),
        work_once_return=leased("work_once_return", lease_mode="once", lease_on_duplicate="return"),
        lock_only=leased("lock_only", lease_commit=False),
    )

    @app.task(
        base=LeasedTask, bind=True, shared=False, name="leaseapp.bad_return", lease_key="{key}"
    )
    def bad_return(self: Any, key: str, sleep: float = 0.0, tag: str = "") -> Any:
        """Runs like ``work``, then returns a value JSON cannot store (a set)."""
        value = _body(self, key, sleep, tag, env("CL_LOG"))
        return {**value, "ids": {1, 2}}

    @app.task(
        base=LeasedTask, bind=True, shared=False, name="leaseapp.retry_once", lease_key="{key}"
    )
    def retry_once(self: Any, key: str, sleep: float = 0.0, tag: str = "") -> Any:
        """Runs like ``work``; the first execution ends in ``self.retry()``."""
        value = _body(self, key, sleep, tag, env("CL_LOG"))
        if self.request.retries == 0:
            raise self.retry(countdown=0.2, max_retries=1)
        return value

    @app.task(shared=False, name="leaseapp.add")
    def add(x: Any, y: Any) -> Any:
        """A plain task (no lease): ``x + y``; a TypeError for operands that do not add."""
        return x + y

    @app.task(bind=True, shared=False, name="leaseapp.collect")
    def collect(self: Any, results: list[Any]) -> list[Any]:
        """A plain chord callback: what the members returned, in order (each run logged)."""
        record(env("CL_LOG"), "collected", task_id=self.request.id)
        return results

    @app.task(base=LeasedTask, bind=True, shared=False, name="leaseapp.fail_on", lease_key="{key}")
    def fail_on(self: Any, key: str, sleep: float = 0.0, tag: str = "") -> Any:
        """Runs like ``work``; on the worker named by ``tag`` ("raise:<hostname>" or
        "retry:<hostname>") the body then raises an error or ``self.retry()``;
        with "slow:<hostname>" the body sleeps ``sleep`` only there (0.1 s elsewhere)."""
        how, _, host = tag.partition(":")
        if how == "slow" and host != self.request.hostname:
            sleep = 0.1
        value = _body(self, key, sleep, tag, env("CL_LOG"))
        if host == self.request.hostname:
            if how == "raise":
                raise RuntimeError(f"late failure on {host}")
            if how == "retry":
                raise self.retry(countdown=0.2, max_retries=3)
        return value

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="leaseapp.suite",
        lease_key="payment-security-{api_id}",
    )
    def suite(self: Any, api_id: int, work_s: float) -> Any:
        """The README's task shape: a key template that names one argument of two."""
        return _body(self, f"payment-security-{api_id}", work_s, "", env("CL_LOG"))

    @app.task(base=LeasedTask, bind=True, shared=False, name="leaseapp.report", lease_key="{key}")
    def report(self: Any, key: str, sleep: float = 0.0, tag: str = "") -> Any:
        """Runs like ``work``; a copy that finds it lost its lease on the way (a
        pause past its TTL) reports FAILURE itself, Celery's documented way
        (``update_state(state=FAILURE)``, then ``Ignore``)."""
        value = _body(self, key, sleep, tag, env("CL_LOG"))
        if not self.lease.held:
            record(env("CL_LOG"), "report_failure", task_id=self.request.id, tag=tag)
            self.update_state(
                state=states.FAILURE,
                meta={"exc_type": "RuntimeError", "exc_message": ["lost its lease"]},
            )
            record(env("CL_LOG"), "reported", task_id=self.request.id, tag=tag)
            raise Ignore()
        return value

    tasks.fail_on = fail_on
    tasks.suite = suite
    tasks.report = report

    @app.task(
        base=DieAfterCommit,
        bind=True,
        shared=False,
        name="leaseapp.die_after_commit",
        lease_key="{key}",
    )
    def die_after_commit(self: Any, key: str, sleep: float = 0.0, tag: str = "") -> Any:
        return _body(self, key, sleep, tag, env("CL_LOG"))

    @app.task(shared=False, name="leaseapp.census")
    def census(hold_cycles: bool = False) -> dict[str, Any]:
        """What this pool process holds of celery-lease's (tests/census.py)."""
        from tests.census import take

        return take(hold_cycles)

    tasks.die_after_commit = die_after_commit
    tasks.census = census
    tasks.bad_return = bad_return
    tasks.retry_once = retry_once
    tasks.collect = collect
    tasks.add = add
    return app, tasks


class DieAfterCommit(LeasedTask):  # type: ignore[misc]
    """A leased task whose child SIGKILLs itself between the fenced commit and
    Celery's result-backend write, once per armed task id.

    Inert unless the test arms it: a file named after the task id in
    ``CL_ARM_DIR``. ``__call__`` returns only after the commit (and release);
    the tracer writes SUCCESS after that, so the kill lands exactly between.
    """

    abstract = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        value = super().__call__(*args, **kwargs)
        arm_dir = os.environ.get("CL_ARM_DIR")
        armed = os.path.join(arm_dir, str(self.request.id)) if arm_dir else None
        if armed and os.path.exists(armed):
            os.unlink(armed)
            record(os.environ.get("CL_LOG"), "committed", task_id=self.request.id, value=value)
            os.kill(os.getpid(), signal.SIGKILL)
        return value


@before_task_publish.connect(weak=False, dispatch_uid="leaseapp.die_before_publishing")
def _die_before_publishing(sender: str | None = None, **_: Any) -> None:
    """A pool process that is about to publish task ``sender`` SIGKILLs itself
    first, once per arm: a file ``publish-<task name>`` in ``CL_ARM_DIR``. For a
    chord's callback that is the header task that counted last, between its
    count and the callback's publish."""
    arm_dir = os.environ.get("CL_ARM_DIR")
    armed = os.path.join(arm_dir, f"publish-{sender}") if arm_dir else None
    if armed and os.path.exists(armed):
        os.unlink(armed)
        member = current_task.request.id if current_task else None
        record(os.environ.get("CL_LOG"), "dying_before_publish", task=sender, member=member)
        os.kill(os.getpid(), signal.SIGKILL)


def record(path: str | None, event: str, **fields: Any) -> None:
    if not path:
        return
    line = json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _body(task: Any, key: str, sleep: float, tag: str, log: str | None) -> dict[str, Any]:
    lease = task.lease
    counted = {}
    if os.environ.get("CL_COUNT_PG") == "1":
        from celery_lease.sql import PG_TRAFFIC

        counted = {"pg_round_trips": PG_TRAFFIC["round_trips"]}
    record(
        log,
        "start",
        task_id=task.request.id,
        key=key,
        token=lease.token,
        tag=tag,
        hostname=task.request.hostname,
        redelivered=bool((task.request.delivery_info or {}).get("redelivered")),
        **counted,
    )
    # CL_HOLD names a file: past ``sleep``, the body goes on while it exists (up to
    # two minutes), so a test can inject its fault before the body ends however
    # slow the machine is, then let the body end.
    hold = os.environ.get("CL_HOLD")
    deadline = time.monotonic() + sleep
    while (now := time.monotonic()) < deadline or (
        hold and os.path.exists(hold) and now < deadline + 120.0
    ):
        time.sleep(min(0.05, max(0.01, deadline - now)))
    record(
        log, "end", task_id=task.request.id, key=key, token=lease.token, tag=tag, held=lease.held
    )
    return {"key": key, "token": lease.token, "tag": tag, "pid": os.getpid()}


if os.environ.get("CL_COUNT_PG") == "1":
    from celery.signals import worker_process_init

    @worker_process_init.connect(weak=False)
    def _count_pg(**_: Any) -> None:
        """Count this pool process's PostgreSQL round trips (each body start logs
        the count so far: tests/acceptance/test_result_backend_fenced.py)."""
        from celery_lease.sql import count_pg_traffic

        count_pg_traffic()


if os.environ.get("CL_TRACEMALLOC") == "1":
    from celery.signals import worker_process_init

    @worker_process_init.connect(weak=False)
    def _trace(**_: Any) -> None:
        import tracemalloc

        tracemalloc.start(1)


app, tasks = build(os.environ)
