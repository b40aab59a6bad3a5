"""Regression tests for the chaos suite's bugs at the broker and in the worker, replayed
deterministically.

3. *A broker hiccup while sending a custom event failed the task*;
6. *a re-publish the broker refused ended the task FAILURE* (and one whose
   publish failed inside kombu);
7. *RabbitMQ lost deferred tasks published without confirms*;
9. *two threads making a metric at once failed a task (DuplicateTimeseries)*.

Real workers on private servers: :mod:`tests.chaos.regression_cell`. The
bugs are numbered across the three ``test_regressions_*`` modules.
"""

from __future__ import annotations

import shlex
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.app import build
from tests.chaos.backends import BackendMonitor
from tests.chaos.regression_cell import (
    Cell,
    is_event,
)
from tests.servers import RabbitMQServer, RedisServer, wait_for

pytestmark = pytest.mark.timeout(180)


def test_an_event_lost_with_its_broker_connection_never_fails_the_task(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    """3. *A deferred task ended FAILURE ConnectionError, then SUCCESS.* The
    LEASE_DEFERRED event was published on a pooled broker connection that
    the broker's restart had broken; redis-py's own ConnectionError (not a
    kombu error) escaped ``events.send`` after the copy was re-published, so
    the task id read FAILURE until its copy succeeded (the chaos run's
    backend monitor saw FAILURE ConnectionError -> SUCCESS)."""
    from celery import Celery

    from celery_lease import events

    broker = make_redis_server(appendonly=False)
    app = Celery("events-regression", broker=broker.url(0))
    events.send(app, events.LEASE_DEFERRED, task_id="t1", hostname="h")  # a pooled connection
    broker.kill()
    events.send(app, events.LEASE_DEFERRED, task_id="t2", hostname="h")  # must not raise


def test_a_deferral_the_broker_cannot_take_is_requeued_not_failed(
    tmp_path: Path, make_redis_server: Callable[..., RedisServer], pg_url: str
) -> None:
    """6. *A deferred task ended FAILURE OperationalError, then SUCCESS.* The
    broker (RabbitMQ, restarting) refused the deferral's re-publish; the
    error escaped, Celery stored FAILURE, and the message, never acked, came
    back and ran: FAILURE -> SUCCESS (the chaos run with ``--broker amqp``).
    A re-publish the broker cannot take now gives the message back
    (``Reject(requeue=True)``), backend untouched. The broker is stopped
    (``rabbitmqctl stop_app``) by the chaos app's hook, right before the
    re-publish."""
    try:
        rabbit = RabbitMQServer(tmp_path / "rabbit")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    rabbit.start()
    try:
        env = rabbit._env()
        script = tmp_path / "stop_app.sh"
        script.write_text(
            "#!/bin/sh\nexec env -i "
            + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
            + f" {shlex.quote(rabbit.ctl_bin)} -n {shlex.quote(rabbit.nodename)} stop_app\n"
        )
        script.chmod(0o755)
        cell = Cell(tmp_path, make_redis_server(), pg_url, broker=rabbit.url())
        monitor = BackendMonitor(cell.env["CHAOS_BACKEND"], tmp_path / "states.jsonl")
        monitor.start()
        key = f"nobroker-{uuid.uuid4().hex[:6]}"
        first, second = str(uuid.uuid4()), str(uuid.uuid4())
        cell.env["CHAOS_RUN_BEFORE_REPUBLISH"] = f"{second}:{script}"
        try:
            a = cell.worker("a", "qa")
            cell.worker("b", "qb")
            cell.tasks.exclusive.apply_async((key, 4.0, 0), task_id=first, queue="qb")
            wait_for(lambda: cell.records(is_event("start", first)), 30, "the first body to start")
            cell.tasks.exclusive.apply_async((key, 0.1, 1), task_id=second, queue="qa")
            wait_for(
                lambda: any(
                    line in a.log_text()
                    for line in (
                        f"could not re-publish {second}",  # requeued
                        f"chaos.exclusive[{second}] raised unexpected",  # the bug
                    )
                ),
                60,
                "A to fail to re-publish the second task",
            )
            rabbit.ctl("start_app")
            wait_for(lambda: cell.state(second)["status"] == "SUCCESS", 90, "the second task")
            time.sleep(0.5)
            states = [b.state for b in monitor.states.get(second, [])]
            assert "FAILURE" not in states, states
        finally:
            monitor.stop()
            cell.close()
    finally:
        rabbit.cleanup()


def test_a_deferral_whose_publish_fails_inside_kombu_is_requeued_not_failed(
    tmp_path: Path, make_redis_server: Callable[..., RedisServer], pg_url: str
) -> None:
    """8. *A deferred task ended FAILURE AttributeError, then SUCCESS.* During a
    broker reconnect the deferral's re-publish failed inside kombu (``'NoneType'
    object has no attribute 'client'``), an error that is no connection or
    channel error; only those gave the message back, so this one escaped,
    Celery stored FAILURE, and a restored copy of the task later stored
    SUCCESS (the 3,000 s chaos run). Any error of the re-publish now gives
    the message back under ``acks_late``. The chaos app's hook makes the
    re-publish fail in kombu's own encoder (a header it cannot encode)."""
    cell = Cell(tmp_path, make_redis_server(), pg_url)
    monitor = BackendMonitor(cell.env["CHAOS_BACKEND"], tmp_path / "states.jsonl")
    monitor.start()
    key = f"unencodable-{uuid.uuid4().hex[:6]}"
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    cell.env["CHAOS_UNENCODABLE_REPUBLISH"] = second
    try:
        a = cell.worker("a", "qa")
        cell.worker("b", "qb")
        cell.tasks.exclusive.apply_async((key, 3.0, 0), task_id=first, queue="qb")
        wait_for(lambda: cell.records(is_event("start", first)), 30, "the first body to start")
        cell.tasks.exclusive.apply_async((key, 0.1, 1), task_id=second, queue="qa")
        wait_for(
            lambda: Path(f"{cell.history}.unencodable-{second}").exists(),
            30,
            "A to re-publish the second task with the unencodable header",
        )
        wait_for(
            lambda: any(
                line in a.log_text()
                for line in (
                    f"could not re-publish {second}",  # requeued
                    f"chaos.exclusive[{second}] raised unexpected",  # the bug
                )
            ),
            30,
            "the re-publish to fail",
        )
        assert "TypeError" in a.log_text()  # kombu's encoder, not the transport
        wait_for(
            lambda: {"SUCCESS", "FAILURE"} & {b.state for b in monitor.states.get(second, [])},
            60,
            "the monitor to see the second task end",
        )
        states = [b.state for b in monitor.states.get(second, [])]
        assert "FAILURE" not in states, states
    finally:
        monitor.stop()
        cell.close()


def test_an_amqp_broker_without_publisher_confirms_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """7. *RabbitMQ lost deferred tasks.* A deferral re-publishes the task and
    acks the message it came in; a copy published (unconfirmed) a few hundred
    ms before RabbitMQ was SIGKILLed was gone after the restart, and with it
    the task (the chaos run with ``--broker amqp``: two tasks never ended).
    Only publisher confirms make the hand-over safe; the chaos app now sets
    ``confirm_publish`` and the worker warns at start when it is off."""
    from celery import Celery

    from celery_lease.signals import warn_unconfirmed_publish

    app = Celery("confirms", broker="amqp://guest:guest@127.0.0.1:1//")
    with caplog.at_level("WARNING", logger="celery_lease.signals"):
        assert warn_unconfirmed_publish(app)
    assert "confirm_publish" in caplog.text
    app.conf.broker_transport_options = {"confirm_publish": True}
    assert not warn_unconfirmed_publish(app)
    assert not warn_unconfirmed_publish(Celery("redis", broker="redis://127.0.0.1:1/0"))
    assert build({"CHAOS_BROKER": "amqp://guest:guest@127.0.0.1:1//"})[0].conf[
        "broker_transport_options"
    ] == {"confirm_publish": True}


def test_two_threads_counting_for_the_first_time_make_one_metric() -> None:
    """9. *A task failed with prometheus-client's DuplicateTimeseries.* Metrics
    are made on first use; in a ``-P threads`` worker (and between a task and
    the renewal thread) two threads could both find a metric unmade and both
    register it: the second registration raised inside the task, which ended
    FAILURE (a CI-sized chaos run: FAILURE DuplicateTimeseries -> SUCCESS).
    The slow registration below widens the window the race needs."""
    import threading

    prometheus_client = pytest.importorskip("prometheus_client")
    from celery_lease.metrics import _Lazy

    registry = prometheus_client.CollectorRegistry()
    made = []

    def make(p: Any) -> Any:
        time.sleep(0.05)
        made.append(1)
        return p.Counter("chaos_regression_total", "doc", registry=registry)

    metric = _Lazy(make)
    errors: list[BaseException] = []
    go = threading.Barrier(8)

    def count() -> None:
        go.wait()
        try:
            metric.inc()
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=count) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(made) == 1
    assert registry.get_sample_value("chaos_regression_total") == 8
