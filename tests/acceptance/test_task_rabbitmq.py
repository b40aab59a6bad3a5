"""An AMQP redelivery while the owner still runs never runs the body twice.

RabbitMQ broker (a private node), ``acks_late``, two real workers. A task
whose body lasts 7 s (TTL 3 s, so it lives on renewals) starts on one of
them, the *owner*. The test closes the owner's broker connections with
``rabbitmqctl close_connection``: RabbitMQ requeues the unacked message and
delivers it again with ``redelivered`` set -- to the other worker, or to the
owner once it has reconnected -- while the owner's body is still running.

Proved, from independent records (the execution log's ``start`` rows and the
``received`` rows written by the ``task_received`` signal of
``tests/apps/deliveries.py``):

* the fault happened: the owner's connections are gone from the broker and
  the message was delivered again with ``redelivered=True``;
* the copy met the live owner and was deferred or rejected, never run:
  exactly one ``start`` for the task id;
* the end state: one accepted result (the owner's token), the backend says
  SUCCESS with the owner's value, and the queue is empty (nothing unacked).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.servers import RabbitMQServer, ServerStartError, wait_for
from tests.workers import Worker, read_log, wait_log

pytestmark = [pytest.mark.timeout(180), pytest.mark.rabbitmq]

TTL = 3.0
BODY = 12.0  # long enough for rabbitmqctl (an Erlang VM per call) on a busy machine


def _socket_ports(pids: list[int]) -> set[int]:
    """Local TCP ports of the sockets the processes ``pids`` hold open."""
    inodes: set[str] = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            fds = list(fd_dir.iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _connections_of(rabbit: RabbitMQServer, worker: Worker) -> dict[str, str]:
    """The broker's connections of a worker's processes: {name: connection pid}.

    Names read "127.0.0.1:CLIENTPORT -> 127.0.0.1:5672"; the client port is
    matched with the sockets the worker's processes hold open.
    """
    ports = _socket_ports([worker.pid, *worker.children()])
    out = rabbit.ctl("list_connections", "pid", "name", "--quiet", "--no-table-headers")
    found = {}
    for line in out.splitlines():
        if "\t" not in line:
            continue
        pid, name = (part.strip() for part in line.split("\t", 1))
        client_port = name.split("->", 1)[0].strip().rsplit(":", 1)[-1]
        if client_port.isdigit() and int(client_port) in ports:
            found[name] = pid
    return found


def _queue_counts(rabbit: RabbitMQServer, queue: str) -> tuple[int, int] | None:
    out = rabbit.ctl(
        "list_queues", "name", "messages_ready", "messages_unacknowledged", "--quiet",
        "--no-table-headers",
    )  # fmt: skip
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == queue:
            return int(parts[1]), int(parts[2])
    return None


@pytest.fixture
def rabbit(request: pytest.FixtureRequest) -> RabbitMQServer:
    """The session's private RabbitMQ node; skip (with the reason) if it cannot start here.

    (A missing ``rabbitmq-server`` binary is skipped by the conftest fixture
    itself, or fails the run on CI.)
    """
    try:
        server: RabbitMQServer = request.getfixturevalue("rabbitmq_server")
    except ServerStartError as e:
        pytest.skip(f"a private RabbitMQ node cannot start on this machine: {e}")
    server.ensure_running()
    return server


def _rows(log: Path, event: str, task_id: str) -> list[dict[str, Any]]:
    return [r for r in read_log(log) if r["event"] == event and r["task_id"] == task_id]


def test_amqp_redelivery_during_the_run_does_not_run_the_body_twice(
    rabbit: RabbitMQServer, redis_url: str, tmp_path: Path
) -> None:
    from tests.apps.leaseapp import build

    log = tmp_path / "exec.log"
    hold = tmp_path / "hold"  # the body runs on until the broker has redelivered
    hold.touch()
    env = {
        "CL_HOLD": str(hold),
        "CL_BROKER": rabbit.url(),
        "CL_BACKEND": redis_url,
        "CL_STORE": redis_url,
        "CL_RESULTS": f"sqlite:///{tmp_path / 'results.sqlite3'}",
        "CL_TTL": str(TTL),
        "CL_LOG": str(log),
    }
    run = time.monotonic_ns()
    queue, key = f"rmq-{run}", f"payment-security-{run}"
    app, tasks = build(env)
    args = ("-Q", queue)
    workers = {
        w.hostname: w
        for w in (
            Worker("rmq-a", env, tmp_path, app="tests.apps.deliveries", extra_args=args),
            Worker("rmq-b", env, tmp_path, app="tests.apps.deliveries", extra_args=args),
        )
    }
    try:
        for w in workers.values():
            w.start()
        result = tasks.work.apply_async((key,), {"sleep": BODY, "tag": "owner"}, queue=queue)
        rows = wait_log(log, lambda rs: any(r["event"] == "start" for r in rs), 30, "the body")
        start = next(r for r in rows if r["event"] == "start")
        assert start["task_id"] == result.id and start["redelivered"] is False
        owner = workers[start["hostname"]]
        other = next(w for w in workers.values() if w is not owner)

        # -- the fault: close the owner's broker connections mid-body -----------
        names = wait_for(lambda: _connections_of(rabbit, owner), 10, "the owner's connections")
        closing_at = time.time()  # rabbitmqctl takes about a second to return
        for pid in names.values():
            rabbit.ctl("close_connection", pid, "closed by test_task_rabbitmq")
        wait_for(
            lambda: not set(names) & set(rabbit.list_connections()),
            30,
            "the owner's connections to close",
        )
        assert not _rows(log, "end", result.id), "the fault came too late: the body had ended"
        wait_for(
            lambda: "Connection to broker lost" in owner.log_text(),
            30,
            "the owner to notice the lost connection",
        )

        # RabbitMQ redelivered the unacked message (redelivered=True) while the
        # owner was still running it.
        redelivered = wait_for(
            lambda: [r for r in _rows(log, "received", result.id) if r["redelivered"]],
            30,
            "the broker to redeliver the message",
        )
        first_copy = redelivered[0]
        assert first_copy["t"] >= closing_at
        hold.unlink()
        ended = _rows(log, "end", result.id)
        assert not ended or first_copy["t"] < ended[0]["t"], (
            "the copy arrived only after the body ended: no concurrent redelivery was tested"
        )

        # -- the owner commits; the copy is deferred, then rejected ----------------
        value = result.get(timeout=BODY + 30)
        assert value["token"] == start["token"]

        def rejected() -> bool:
            return any(f"LEASE_REJECTED {result.id}" in w.log_text() for w in workers.values())

        wait_for(rejected, 30, "the redelivered copy to be rejected after the owner's commit")
        wait_for(lambda: _queue_counts(rabbit, queue) == (0, 0), 30, "an empty queue")

        logs = {w.name: w.log_text() for w in workers.values()}
        traces = {
            name: [
                line.split("] ", 1)[-1]
                for line in text.splitlines()
                if result.id in line and ("LEASE_" in line or "FENCED" in line)
            ]
            for name, text in logs.items()
        }
        deliveries = _rows(log, "received", result.id)
        print(
            f"owner {owner.name}; deliveries of {result.id}: "
            + ", ".join(
                f"{r['hostname'].split('@')[0]}(redelivered={r['redelivered']}, "
                f"deferrals={r['deferrals']})"
                for r in deliveries
            )
            + f"; lease traces: {traces}"
        )

        # Exactly one execution of the body, the owner's, seen through to its end.
        starts = _rows(log, "start", result.id)
        assert len(starts) == 1, starts
        ends = _rows(log, "end", result.id)
        assert len(ends) == 1 and ends[0]["held"] is True and ends[0]["token"] == start["token"]
        assert len(deliveries) >= 2
        # Every copy met the lease: deferred while the owner held it, then rejected.
        assert any(t.startswith("LEASE_DEFERRED") or t.startswith("LEASE_REJECTED")
                   for ts in traces.values() for t in ts)  # fmt: skip
        assert not any("FENCED" in t or "LEASE_LOST" in t for ts in traces.values() for t in ts)

        # One accepted result, the owner's; the backend keeps the owner's SUCCESS.
        assert result.state == "SUCCESS"
        assert result.get(timeout=5) == value
        accepted = tasks.work.accepted(key)
        assert accepted is not None
        assert (accepted.task_id, accepted.token) == (result.id, start["token"])
        assert accepted.value == value
        assert other.alive() and owner.alive()
    finally:
        for w in workers.values():
            w.kill()
        app.close()
