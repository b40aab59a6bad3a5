"""How the Redis store talks to redis-py: scripts by EVALSHA on kept connections.

Each script is one round trip (EVALSHA, or EVAL when the server lost its
script cache). :class:`ScriptTransport` sends them itself on connections it
keeps checked out of the redis-py client's pool, not through
``Script``/``execute_command``, whose per-command machinery (pool checkout and
its socket poll, retry closure, observability hooks, ``Script.__call__``) costs
more per call than the round trip itself.

This is the one module that uses redis-py below its public command API
(``Connection.pack_command``/``pack_commands``/``send_packed_command``/``read_response``/
``disconnect``/``retry``, ``ConnectionPool.get_connection``/``release``) or
reads details that changed between redis-py versions (``get_connection``'s
``command_name``, an error's ``status_code``). ``tests/contract/test_redis_transport.py``
runs it on a real Redis and pins the redis-py versions it was checked with
(:data:`REDIS_PY_CHECKED`).
"""

from __future__ import annotations

import builtins
import inspect
import os
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

__all__ = ["REDIS_PY_CHECKED", "ScriptTransport", "server_reply"]

#: The redis-py versions this module was run against (a PEP 440 specifier).
#: tests/contract/test_redis_transport.py fails on a redis-py outside it: check the
#: connection internals above still hold, then widen it.
REDIS_PY_CHECKED = ">=5.0,<9"

#: Connections a store keeps checked out between calls; more, from a burst of
#: concurrent calls, go back to the client's pool.
KEEP_IDLE = 4


class ScriptTransport:
    """Runs scripts and raw commands for one ``redis.Redis`` client; redis-py errors pass.

    A client-side cache wraps connections in proxies: with one, commands go
    through redis-py's own path (:attr:`direct` is False).
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        pool = client.connection_pool
        self.direct = getattr(pool, "cache", None) is None
        self._idle: builtins.list[Any] = []  # redis-py Connections
        self._pid = os.getpid()
        # redis-py < 5.3 requires a command name; later versions deprecate it.
        param = inspect.signature(pool.get_connection).parameters.get("command_name")
        self._checkout_args: tuple[str, ...] = (
            ("EVALSHA",) if param is not None and param.default is param.empty else ()
        )

    def run(self, script: Script, keys: builtins.list[str], args: builtins.list[Any]) -> Any:
        """EVALSHA ``script`` in one round trip (see :meth:`execute`)."""
        if not self.direct:
            return script(keys=keys, args=args)
        return self.execute((b"EVALSHA", script.sha, len(keys), *keys, *args), script)

    def run_waited(
        self,
        script: Script,
        keys: builtins.list[str],
        args: builtins.list[Any],
        replicas: int,
        timeout_ms: int,
    ) -> tuple[Any, int]:
        """EVALSHA ``script`` and ``WAIT replicas timeout_ms`` in one round trip:
        the script's reply and how many replicas acknowledged its writes.

        WAIT cannot run inside a script, so it follows it on the same
        connection, written in the same packet: it waits for the script's writes.
        """
        wait = (b"WAIT", replicas, timeout_ms)
        if not self.direct:
            with self.client.pipeline(transaction=False) as pipe:
                script(keys=keys, args=args, client=pipe)
                pipe.execute_command(*wait)  # type: ignore[no-untyped-call]
                reply, acked = pipe.execute()
            return reply, int(acked)
        command = (b"EVALSHA", script.sha, len(keys), *keys, *args)
        reply, acked = self.execute(command, script, then=wait)
        return reply, int(acked)

    def execute(
        self,
        command: tuple[Any, ...],
        script: Script | None = None,
        then: tuple[Any, ...] | None = None,
    ) -> Any:
        """Send ``command`` on a kept connection and return its raw reply.

        Like redis-py: a connection that fails mid-command is disconnected (the
        next use reconnects); the client's Retry policy applies; NOSCRIPT (a
        restarted or flushed server) is answered by sending the script (EVAL,
        which also caches it). Like redis-py's pool, which polls a connection
        before lending it: one whose server closed it while idle (a restart, an
        idle timeout) is replaced. Here that shows as a ConnectionError on use, so
        the command is sent once more on a new connection. Every command the
        store sends here is safe to repeat: a repeated claim re-grants the same
        owner, a repeated release or renewal finds its own work done, an evict
        advances the fence again, the rest only read.

        With ``then``, that command is written in the same packet and the
        answer is the pair of replies.
        """
        if self._pid != os.getpid():  # forked: the parent's sockets are not ours
            self._idle = []
            self._pid = os.getpid()
        try:
            conn = self._idle.pop()
        except IndexError:
            conn = self.client.connection_pool.get_connection(*self._checkout_args)

        def attempt() -> Any:
            try:
                return _roundtrip(conn, command, script, then)
            except RedisConnectionError:  # closed while idle: once more, reconnected
                # connect() explicitly: a Sentinel connection asks the sentinels for
                # the master there, while the reconnect inside a send (redis-py 8)
                # goes back to the address it had, the dead master's after a failover.
                conn.connect()
                return _roundtrip(conn, command, script, then)

        try:
            return conn.retry.call_with_retry(attempt, lambda _error: conn.disconnect())
        finally:
            if len(self._idle) < KEEP_IDLE:
                self._idle.append(conn)
            else:  # a burst of concurrent calls is over: give the pool its connection back
                self.client.connection_pool.release(conn)

    def close(self) -> None:
        """Give the kept connections back to the pool (a forked child's are not its own)."""
        idle, self._idle = self._idle, []
        if self._pid == os.getpid():
            for conn in idle:
                self.client.connection_pool.release(conn)


#: The reply code of the redis-py classes that strip it from the message
#: (redis-py < 8 does not keep it in ``status_code``); subclasses first.
_CODE_OF_CLASS: tuple[tuple[type[RedisError], str], ...] = (
    (MasterDownError, "MASTERDOWN"),
    (ClusterDownError, "CLUSTERDOWN"),
    (TryAgainError, "TRYAGAIN"),
    (OutOfMemoryError, "OOM"),
    (ReadOnlyError, "READONLY"),
    (BusyLoadingError, "LOADING"),
    (NoScriptError, "NOSCRIPT"),
)


def server_reply(e: RedisError) -> tuple[str | None, str]:
    """The code of the server's error reply behind ``e`` (``OOM``, ``BUSY``...;
    None for a client-side error) and the reply as the server sent it.

    redis-py turns the replies it knows into classes and strips their code from
    the message (keeping it in ``status_code`` from redis-py 8 on); any other
    reply is a plain ResponseError whose message still starts with its code.
    """
    text = str(e.args[0]) if e.args else str(e)
    code = getattr(e, "status_code", None)
    if isinstance(code, str) and code:
        return code, f"{code} {text}"
    for cls, name in _CODE_OF_CLASS:
        if isinstance(e, cls):
            return name, f"{name} {text}"
    if isinstance(e, ResponseError):
        word = text.split(" ", 1)[0]
        if word.isalpha() and word.isupper():
            return word, text
    return None, str(e)


def _roundtrip(
    conn: Any, command: tuple[Any, ...], script: Script | None, then: tuple[Any, ...] | None
) -> Any:
    """Send ``command`` (and ``then``) on ``conn`` and read the reply (EVAL if the
    server lacks ``script``).

    Anything but a server's error reply leaves the connection disconnected, so a
    reply can never be left unread for the next command on it (redis-py's own
    send and read already do this for their errors; this covers the rest, such
    as a soft time limit raised between them).
    """
    replied = False  # every reply (or error reply) read: the connection stays usable
    try:
        try:
            reply = _send(conn, command, then)
        except NoScriptError:
            if script is None:
                replied = True
                raise
            reply = _send(conn, (b"EVAL", script.script, *command[2:]), then)
        replied = True
        return reply
    except ResponseError:
        replied = True
        raise
    finally:
        if not replied:
            conn.disconnect()


def _send(conn: Any, command: tuple[Any, ...], then: tuple[Any, ...] | None) -> Any:
    if then is None:
        conn.send_packed_command(conn.pack_command(*command))
        return conn.read_response()
    conn.send_packed_command(conn.pack_commands([command, then]))
    try:
        first = conn.read_response()
    except ResponseError:
        conn.read_response()  # the second reply, so that none is left unread
        raise
    return first, conn.read_response()
