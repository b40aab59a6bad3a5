"""Tests of the test infrastructure itself (tests/servers/, conftest)."""
# mypy: allow-untyped-calls

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
import redis

from tests.servers import (
    PostgresServer,
    RabbitMQServer,
    RedisServer,
    ServerStartError,
    free_port,
    wait_for,
)

SHARED_PORTS = {5432, 5672, 6379, 15672, 25672, 4369}


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in (b"Z", b"X")


# --------------------------------------------------------------------------
# generic helpers
# --------------------------------------------------------------------------


def test_free_port_is_private_and_bindable() -> None:
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20
    assert not ports & SHARED_PORTS
    for port in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_wait_for_times_out_without_sleeping_forever() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        wait_for(lambda: False, 0.2, "nothing")
    assert time.monotonic() - started < 1.0
    assert wait_for(lambda: 42, 1.0, "answer") == 42


def test_slow_tests_are_skipped_unless_asked_for(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CELERY_LEASE_SLOW", raising=False)
    pytester.makeconftest("from tests.conftest import *  # noqa: F403\n")
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.slow
        def test_soak():
            pass

        @pytest.mark.slow
        @pytest.mark.ci
        def test_ci_sized_chaos_run():
            pass

        @pytest.mark.parametrize("mode", ["slow", "fast"])
        def test_quick(mode):
            pass

        def test_redis_marker(redis_url):
            pass
        """
    )
    result = pytester.runpytest_inprocess("-m", "not redis", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, skipped=2, deselected=1)
    result = pytester.runpytest_inprocess("-m", "not redis", "--slow", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, deselected=1)
    # .ci/run's long runs: exactly the tests marked ci
    result = pytester.runpytest_inprocess("-m", "ci", "--slow", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, deselected=4)
    monkeypatch.setenv("CELERY_LEASE_SLOW", "1")
    result = pytester.runpytest_inprocess("-m", "not redis", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, deselected=1)


def test_a_long_default_suite_test_is_named_at_the_end_of_the_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tests.conftest

    # Any test is "long" at a budget of 0 s: what is checked is who is named.
    monkeypatch.setattr(tests.conftest, "LONG_TEST_S", 0.0)
    monkeypatch.delenv("CELERY_LEASE_SLOW", raising=False)
    pytester.makeconftest("from tests.conftest import *  # noqa: F403\n")
    pytester.makepyfile(
        """
        import pytest

        def test_in_the_default_suite():
            pass

        @pytest.mark.slow
        @pytest.mark.ci
        def test_long_run():
            pass
        """
    )
    result = pytester.runpytest_inprocess("--slow", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["*default-suite tests over the per-test budget*", "*test_in_the_default_suite: over 0 s*"]
    )
    result.stdout.no_fnmatch_line("*test_long_run: over*")


def test_a_ci_test_not_marked_slow_is_refused_at_collection(pytester: pytest.Pytester) -> None:
    # It would run in the default suite and again in .ci/run's long runs.
    pytester.makeconftest("from tests.conftest import *  # noqa: F403\n")
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ci
        def test_long_run():
            pass
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_long_run*marked 'ci' but not 'slow'*"])


def test_a_packaging_test_outside_the_long_runs_is_refused_at_collection(
    pytester: pytest.Pytester,
) -> None:
    # An install into a fresh virtualenv belongs in .ci/run's long runs, whether
    # it says so with the marker or by asking for the installed_venv fixture.
    pytester.makeconftest("from tests.conftest import *  # noqa: F403\n")
    pytester.makepyfile(
        marked="import pytest\n\n@pytest.mark.packaging\ndef test_marked():\n    pass\n",
        by_fixture="def test_by_fixture(installed_venv):\n    pass\n",
        long_run=(
            "import pytest\n\n@pytest.mark.packaging\n@pytest.mark.slow\n@pytest.mark.ci\n"
            "def test_long_run():\n    pass\n"
        ),
    )
    for name in ("marked", "by_fixture"):
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", f"{name}.py")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, name
        result.stderr.fnmatch_lines([f"*test_{name}*installs the package*mark it slow and ci*"])
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--co", "long_run.py")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()


# --------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------


def test_redis_aof_survives_kill(make_redis_server: Callable[..., RedisServer]) -> None:
    server = make_redis_server(appendonly=True, appendfsync="always")
    port, pid = server.port, server.pid
    assert port not in SHARED_PORTS
    assert server.url() == f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(server.url(3))
    client.set("lease", "token-1")
    client.close()

    server.kill()
    assert server.pid is None
    assert pid is not None and not _pid_alive(pid)
    server.start()

    assert server.port == port
    assert server.pid != pid
    client = redis.Redis.from_url(server.url(3))
    assert client.get("lease") == b"token-1"
    client.close()


def test_redis_without_persistence_forgets_on_restart(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    server = make_redis_server(appendonly=False)
    port = server.port
    client = redis.Redis.from_url(server.url())
    client.set("lease", "token-1")
    client.close()

    server.restart()  # clean stop (SHUTDOWN NOSAVE semantics) + start
    assert server.port == port
    client = redis.Redis.from_url(server.url())
    assert client.get("lease") is None
    client.set("again", "1")
    client.close()

    server.restart(hard=True)  # SIGKILL + start
    client = redis.Redis.from_url(server.url())
    assert client.dbsize() == 0
    client.close()
    assert not list(server.data_dir.iterdir())  # no RDB, no AOF


def test_redis_pause_and_resume(make_redis_server: Callable[..., RedisServer]) -> None:
    server = make_redis_server(appendonly=False)
    client = redis.Redis.from_url(server.url(), socket_timeout=0.3)
    assert client.ping()
    server.pause()
    with pytest.raises(redis.exceptions.TimeoutError):
        client.ping()
    server.resume()
    client.connection_pool.disconnect()
    assert client.ping()
    client.close()


def test_redis_started_from_short_lived_thread_keeps_running(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, appendonly=False)
    thread = threading.Thread(target=server.start)
    thread.start()
    thread.join()
    try:
        # the parent-death signal must not fire when the starting thread ends
        assert server.command("PING") == b"+PONG"
        assert server.running
    finally:
        server.cleanup()
    assert not server.running


def test_redis_start_failure_shows_the_log(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, appendonly=False, extra_args=["--no-such-option", "x"])
    with pytest.raises(ServerStartError) as info:
        server.start()
    assert "no-such-option" in str(info.value)
    assert str(server.log_path) in str(info.value)
    assert not server.running


def test_redis_url_fixture_gives_an_empty_database(
    redis_server: RedisServer, redis_url: str
) -> None:
    assert redis_url.startswith(f"redis://127.0.0.1:{redis_server.port}/")
    db = int(redis_url.rsplit("/", 1)[1])
    assert db != 0
    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0
    client.set("x", "1")
    client.close()
    assert redis_server.appendonly and redis_server.appendfsync == "always"


def test_redis_url_fixture_is_fresh_per_test(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0
    client.close()


# --------------------------------------------------------------------------
# PostgreSQL
# --------------------------------------------------------------------------


def _pg_rows(server: PostgresServer) -> list[tuple[int, str]]:
    with psycopg.connect(server.dsn("leases"), connect_timeout=5) as conn:
        return conn.execute("SELECT id, owner FROM lease ORDER BY id").fetchall()


def test_postgres_keeps_committed_rows_across_restarts(
    make_pg_server: Callable[..., PostgresServer],
) -> None:
    server = make_pg_server()
    port = server.port
    assert port not in SHARED_PORTS
    url = server.create_database("leases")
    assert url == f"postgresql+psycopg://postgres@127.0.0.1:{port}/leases"
    with psycopg.connect(server.dsn("leases")) as conn:
        conn.execute("CREATE TABLE lease (id int PRIMARY KEY, owner text)")
        conn.execute("INSERT INTO lease VALUES (1, 'a')")

    server.stop(mode="fast")
    assert not server.running
    server.start()
    assert server.port == port
    assert _pg_rows(server) == [(1, "a")]

    with psycopg.connect(server.dsn("leases")) as conn:
        conn.execute("INSERT INTO lease VALUES (2, 'b')")
    server.restart(mode="immediate")
    assert _pg_rows(server) == [(1, "a"), (2, "b")]

    with psycopg.connect(server.dsn("leases")) as conn:
        conn.execute("INSERT INTO lease VALUES (3, 'c')")
    server.restart(hard=True)  # SIGKILL of the whole process group
    assert server.port == port
    assert _pg_rows(server) == [(1, "a"), (2, "b"), (3, "c")]


def test_postgres_stop_disconnects_clients(
    make_pg_server: Callable[..., PostgresServer],
) -> None:
    server = make_pg_server()
    conn = psycopg.connect(server.dsn(), autocommit=True)
    assert conn.execute("SELECT 1").fetchone() == (1,)
    server.restart()
    with pytest.raises(psycopg.OperationalError):
        conn.execute("SELECT 1")
    conn.close()


def test_postgres_pause_freezes_open_connections_until_resume(
    make_pg_server: Callable[..., PostgresServer],
) -> None:
    server = make_pg_server()
    conn = psycopg.connect(server.dsn(), autocommit=True)
    assert conn.execute("SELECT 1").fetchone() == (1,)
    answers: list[object] = []
    server.pause()
    try:
        # An open connection (served by its own backend, outside the
        # postmaster's process group) hangs too.
        asking = threading.Thread(
            target=lambda: answers.append(conn.execute("SELECT 2").fetchone())
        )
        asking.start()
        asking.join(1.5)
        assert asking.is_alive() and answers == [], answers
    finally:
        server.resume()
    asking.join(10)
    assert answers == [(2,)]
    conn.close()


def test_pg_url_fixture(pg_server: PostgresServer, pg_url: str) -> None:
    prefix = f"postgresql+psycopg://postgres@127.0.0.1:{pg_server.port}/test_servers_"
    assert pg_url.startswith(prefix)
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE t (x int)")
        assert conn.execute("SELECT current_database()").fetchone() == (pg_url.rsplit("/")[-1],)


def test_pg_url_fixture_is_shared_by_the_module(pg_url: str) -> None:
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_tables WHERE tablename = 't'").fetchone()
    assert row == (1,)


# --------------------------------------------------------------------------
# SQLite
# --------------------------------------------------------------------------


def test_sqlite_url_fixture(sqlite_url: str, tmp_path: Path) -> None:
    assert sqlite_url == f"sqlite:///{tmp_path}/lease.sqlite3"
    path = sqlite_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (x int)")
    assert Path(path).exists()


# --------------------------------------------------------------------------
# RabbitMQ
# --------------------------------------------------------------------------


@pytest.mark.rabbitmq
def test_rabbitmq_publish_consume_and_close_connections(
    rabbitmq_server: RabbitMQServer, amqp_url: str
) -> None:
    from kombu.connection import Connection
    from kombu.entity import Exchange, Queue

    assert amqp_url == f"amqp://guest:guest@127.0.0.1:{rabbitmq_server.port}//"
    assert rabbitmq_server.port not in SHARED_PORTS
    queue = Queue("infra-test", Exchange("infra-test", type="direct"), routing_key="k")

    with Connection(amqp_url, connect_timeout=5) as conn:
        producer = conn.Producer(serializer="json")
        producer.publish({"hello": "lease"}, exchange=queue.exchange, routing_key="k",
                         declare=[queue])  # fmt: skip
        with conn.SimpleQueue(queue) as simple:
            message = simple.get(timeout=5)
            assert message.payload == {"hello": "lease"}
            message.ack()

        names = wait_for(rabbitmq_server.list_connections, 10.0, "connection listed")
        assert len(names) == 1
        rabbitmq_server.close_all_connections("infra test")
        # a client that reads sees the broker's forced close at once
        with pytest.raises(conn.connection_errors, match="CONNECTION_FORCED"):
            conn.drain_events(timeout=5)

    with Connection(amqp_url, connect_timeout=5) as conn:
        conn.connect()
        wait_for(rabbitmq_server.list_connections, 10.0, "connection listed")
        # hard: returns only once the broker lists no connection any more
        rabbitmq_server.close_all_connections("infra test", hard=True)
        assert rabbitmq_server.list_connections() == []
        with pytest.raises(conn.connection_errors):
            conn.drain_events(timeout=5)
