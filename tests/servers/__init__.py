"""Private, restartable server instances for the test-suite.

Every server started here listens on its own loopback port (never the
machine's shared 6379 / 5432 / 5672), keeps its data, socket and log files
in its own temporary directory, and can be stopped, killed, paused and
restarted on its own without affecting any other instance.

Guarantees:

* Readiness is detected by polling a real protocol handshake against a
  deadline (Redis ``PING``, ``pg_isready``, an AMQP ``Connection.Start``
  frame); there are no fixed sleeps.
* A server keeps its port across restarts.
* Everything started here is cleaned up: explicitly via ``stop()`` /
  ``kill()`` (the pytest fixtures do that), at interpreter exit via
  ``atexit``, and even if the Python process dies abruptly, because every
  server is started with a Linux parent-death signal.
* Server output goes to a log file in the server's directory; when a start
  fails, the tail of that log is part of the raised ``ServerStartError``.

PostgreSQL refuses to run as root, so when the tests run as root the
cluster is initialised and run as the ``postgres`` OS user.

The modules, one concern each: :mod:`~tests.servers.basics` (ports, polling,
log tails), :mod:`~tests.servers.process` (spawning with a parent-death
signal), :mod:`~tests.servers.managed` (one server's life cycle, the exit
clean-up), then one per server.
"""

from __future__ import annotations

from tests.servers.basics import (
    LOOPBACK,
    ServerStartError,
    free_port,
    log_tail,
    redis_command,
    wait_for,
)
from tests.servers.managed import ManagedServer, iter_live_servers
from tests.servers.postgres_server import PostgresServer
from tests.servers.process import signal_group, spawn
from tests.servers.rabbitmq_server import RabbitMQServer
from tests.servers.redis_server import RedisServer

__all__ = [
    "LOOPBACK",
    "ManagedServer",
    "PostgresServer",
    "RabbitMQServer",
    "RedisServer",
    "ServerStartError",
    "free_port",
    "iter_live_servers",
    "log_tail",
    "redis_command",
    "signal_group",
    "spawn",
    "wait_for",
]
