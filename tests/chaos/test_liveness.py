"""The chaos supervisor's liveness check (tests/chaos/liveness.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from kombu import Connection

from tests.chaos import liveness
from tests.chaos.app import build
from tests.chaos.cluster import Cluster
from tests.servers import RedisServer, wait_for
from tests.workers import _state


def _prerun(history: Path, host: str) -> None:
    with open(history, "a") as f:
        f.write(json.dumps({"ev": "prerun", "host": host, "task_id": "t"}) + "\n")


def test_a_worker_is_stalled_only_when_its_queue_held_messages_and_it_started_nothing(
    tmp_path: Path,
) -> None:
    history = tmp_path / "history.jsonl"
    held = {"celery": 0, "chaos.probe": 0}
    live = liveness.Liveness(history, held.__getitem__, stall=100.0)
    now = 1000.0
    live.read(now)  # no history yet
    assert not live.stalled("w1@localhost", "celery", now), "nothing held"

    held["celery"] = 3
    assert not live.stalled("w1@localhost", "celery", now), "held from now on"
    assert not live.stalled("w1@localhost", "celery", now + 99), "within the bound"
    assert live.stalled("w1@localhost", "celery", now + 100), "held 100 s, nothing started"

    _prerun(history, "w1@localhost")
    live.read(now + 150)
    assert not live.stalled("w1@localhost", "celery", now + 150), "it started a task"
    assert not live.stalled("w1@localhost", "celery", now + 249)
    assert live.stalled("w1@localhost", "celery", now + 250), "100 s since its last start"
    assert not live.stalled("w2@localhost", "chaos.probe", now + 250), "another queue, empty"

    held["celery"] = 0
    assert not live.stalled("w1@localhost", "celery", now + 260), "its queue emptied"
    held["celery"] = 1
    assert not live.stalled("w1@localhost", "celery", now + 270), "held anew from 270"

    live.restarted("w1@localhost", now + 300)
    assert not live.stalled("w1@localhost", "celery", now + 399), "a restart starts the bound"
    assert live.stalled("w1@localhost", "celery", now + 400)


def test_a_half_written_history_line_is_read_once_complete(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    line = json.dumps({"ev": "prerun", "host": "probe@localhost"})
    history.write_text("not json\n" + line[:10])
    live = liveness.Liveness(history, lambda q: 1, stall=10.0)
    live.read(5.0)
    assert "probe@localhost" not in live.last_start
    with open(history, "a") as f:
        f.write(line[10:] + "\n")
    live.read(7.0)
    assert live.last_start["probe@localhost"] == 7.0


@pytest.mark.timeout(60)
def test_held_in_redis_counts_a_queues_ready_and_unacked_messages(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    server = make_redis_server(appendonly=False)
    held = liveness.held_in_redis(server.url(0))
    assert held("chaos.probe") == 0
    with Connection(server.url(0)) as conn:
        probe, other = conn.SimpleQueue("chaos.probe"), conn.SimpleQueue("chaos.probe.x")
        probe.put({"n": 1})
        probe.put({"n": 2})
        other.put({"n": 3})
        assert held("chaos.probe") == 2, "two ready; the other queue's message is not counted"
        message = probe.get(timeout=5)  # delivered, not acked: kombu keeps it in `unacked`
        assert held("chaos.probe") == 2, "one ready, one unacked"
        message.ack()
        assert held("chaos.probe") == 1
        probe.close()
        other.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("faketime") is None, reason="faketime is not installed")
def test_the_supervisor_restarts_a_worker_that_stopped_starting_its_queues_tasks(
    tmp_path: Path,
) -> None:
    """The probe worker's pool children stopped: a probe it receives is never
    started and stays held (unacked); the supervisor takes its stacks, restarts
    the worker, and the probe runs."""
    c = Cluster(tmp_path, broker="redis", workers=1, concurrency=1, ttl=4.0, vt=10.0)
    try:
        c.start_servers()
        c.start_workers()
        _app, tasks = build(c.env)
        c.liveness_every = 1.0
        c.supervise()
        assert c.liveness is not None and c.probe is not None
        c.liveness.stall = 10.0
        children = c.probe.pool_children()
        assert children
        for pid in children:
            os.kill(pid, signal.SIGSTOP)
        wait_for(
            lambda: all(_state(p) == "T" for p in children), 10, "the probe worker's pool stopped"
        )
        result = tasks.probe.apply_async(args=("p-liveness", 0.05, -1))
        wait_for(lambda: c.liveness_restarts == 1, 90, "the supervisor restarted it")
        assert list((tmp_path / "stacks").glob("*-liveness-probe.txt")), "its stacks were taken"
        assert result.get(timeout=90)["key"] == "p-liveness", "the held probe ran"
        assert c.liveness_restarts == 1 and c.supervisor_restarts == 0, "no other worker touched"
    finally:
        c.shutdown()
