"""How the Redis store talks to redis-py: scripts by EVALSHA on kept connections.

Each script is one round trip (EVALSHA, or EVAL when the server lost its
script cache). :class:`ScriptTransport` sends them itself on connections it
keeps checked out of the redis-py client's pool, not through
``Script``/``execute_command``, whose per-command machinery (pool checkout and
its socket poll, retry closure, observability hooks, ``Script.__call__``) costs
more per call than the round trip itself.

This is the one module that uses redis-py below its public command API
(``Connection.pack_command``/``pack_commands``/``send_packed_command``/``read_response``/
``can_read``/``disconnect``/``retry``, ``ConnectionPool.get_connection``/``release``) or
reads details that changed between redis-py versions (``get_connection``'s
``command_name``, an error's ``status_code``). ``tests/contract/test_redis_transport.py``
runs it on a real Redis and pins the redis-py versions it was checked with
(:data:`REDIS_PY_CHECKED`).
"""

from __future__ import annotations

import builtins
import inspect
import logging
import os
from collections.abc import Callable
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

#: What :meth:`ScriptTransport.send_later` calls with the reply, once read:
#: ``(reply, None)``, or ``(None, error)`` for an error reply or a failed resend.
Answer = Callable[[Any, "RedisError | None"], None]


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
        #: kept connections whose last command's reply is still unread (send_later)
        self._late: dict[Any, _Late] = {}
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
        which also caches it). A connection the server closed while idle (a
        restart, an idle timeout; redis-py's pool polls for that before lending)
        shows as a ConnectionError on use: the command goes once more on a new
        connection. Every command the store sends here is safe to repeat: a
        repeated claim re-grants the same owner, a repeated release or renewal
        finds its own work done, an evict advances the fence again, the rest read.

        With ``then``, that command goes in the same packet and the answer is the
        pair of replies. A reply :meth:`send_later` left unread is read after
        ``command`` is sent, while its reply is on the way: no wait of its own.
        """
        conn, late = self._checkout()
        tries = 0

        def attempt() -> Any:
            nonlocal tries
            tries += 1
            if tries > 1 and late is not None and not late.answered:
                late.resend(conn)  # the connection failed before the late reply was read
            # Once answered (read, or resent and read), the late command has no
            # reply left on the connection: the next one is the command's own.
            unread = late if late is not None and not late.answered else None
            try:
                return _roundtrip(conn, command, script, then, unread)
            except RedisConnectionError:  # closed while idle: once more, reconnected
                # connect() explicitly: a Sentinel connection asks the sentinels for
                # the master there, while the reconnect inside a send (redis-py 8)
                # goes back to the address it had, the dead master's after a failover.
                conn.connect()
                if late is not None and not late.answered:
                    late.resend(conn)
                return _roundtrip(conn, command, script, then, None)

        try:
            return conn.retry.call_with_retry(attempt, lambda _error: conn.disconnect())
        except RedisError as e:
            if late is not None and not late.answered:
                late.hand_over(None, e)  # its connection failed, and every resend
            raise
        finally:
            self._checkin(conn)

    def send_later(
        self, script: Script, keys: builtins.list[str], args: builtins.list[Any], answer: Answer
    ) -> None:
        """Send ``script`` and go on without waiting for its reply: the server runs
        it as promptly as :meth:`run` would, and the reply is read, and handed
        to ``answer``, when the connection is next used (by any call of this
        transport, or :meth:`close`).

        Sent as EVAL with the script's text, so that no NOSCRIPT reply (a
        restarted server) can leave the command undone until that later read.
        A connection that fails before the reply is read is reconnected and the
        command sent again, synchronously: only idempotent commands (a release)
        may be sent this way. A kept connection the server closed while idle is
        found before the send, and the command goes synchronously too.
        """
        command = (b"EVAL", script.script, len(keys), *keys, *args)
        if not self.direct:
            _Late(command, answer).resend_on(self)
            return
        try:
            conn, late = self._checkout()
        except RedisError as e:  # no connection kept, and none to be made: the server is down
            _Late(command, answer).hand_over(None, e)
            return
        if late is not None:  # two in a row on one connection: the first one's reply now
            late.settle(self, conn)
        try:
            if _closed(conn):
                # A write to a socket the server closed succeeds, and the command
                # would wait there, unsent, until the connection's next use: for an
                # idle worker, the key would stay held for its whole TTL.
                raise RedisConnectionError("closed by the server while idle")
            conn.send_packed_command(conn.pack_command(*command))
        except RedisError:  # not sent, or not whole: send it again, waiting for the reply
            conn.disconnect()
            self._checkin(conn)
            _Late(command, answer).resend_on(self)
            return
        except BaseException:
            conn.disconnect()
            self._checkin(conn)
            raise
        if len(self._idle) >= KEEP_IDLE:  # cannot keep it: read the reply now
            _Late(command, answer).settle(self, conn)
            self._checkin(conn)
            return
        self._late[conn] = _Late(command, answer)
        self._idle.append(conn)

    @property
    def unread(self) -> int:
        """How many replies :meth:`send_later` left unread on kept connections."""
        return len(self._late)

    def close(self) -> None:
        """Read the replies still unread, then give the kept connections back to
        the pool (a forked child's are not its own)."""
        if self._pid != os.getpid():
            self._idle, self._late = [], {}
            return
        while self._idle:
            conn, late = self._checkout()
            if late is not None:
                late.settle(self, conn)
            self.client.connection_pool.release(conn)

    def _checkout(self) -> tuple[Any, _Late | None]:
        """A kept connection and the reply left unread on it, or one from the pool."""
        if self._pid != os.getpid():  # forked: the parent's sockets are not ours
            self._idle, self._late = [], {}
            self._pid = os.getpid()
        try:
            conn = self._idle.pop()
        except IndexError:
            return self.client.connection_pool.get_connection(*self._checkout_args), None
        return conn, self._late.pop(conn, None)

    def _checkin(self, conn: Any) -> None:
        if len(self._idle) < KEEP_IDLE:
            self._idle.append(conn)
        else:  # a burst of concurrent calls is over: give the pool its connection back
            self.client.connection_pool.release(conn)


class _Late:
    """A command :meth:`ScriptTransport.send_later` sent, whose reply is not read yet."""

    __slots__ = ("answer", "answered", "command")

    def __init__(self, command: tuple[Any, ...], answer: Answer) -> None:
        self.command = command
        self.answer = answer
        self.answered = False

    def read(self, conn: Any) -> None:
        """Read the reply off ``conn`` (the next one there) and hand it over; a
        connection error passes (the caller sends the command again)."""
        try:
            reply = conn.read_response()
        except ResponseError as e:  # the server's error reply: the command did not run
            self.hand_over(None, e)
            return
        self.hand_over(reply, None)

    def settle(self, transport: ScriptTransport, conn: Any) -> None:
        """Read the reply now; if the connection fails first, send the command again."""
        try:
            self.read(conn)
        except RedisError:  # lost with the connection: it may not have run
            conn.disconnect()
            self.resend_on(transport)
        except BaseException:
            conn.disconnect()
            raise

    def resend(self, conn: Any) -> None:
        """Send the command again on ``conn``, once, and read its reply; if that
        fails too, the answer is the error (the caller's own command goes on)."""
        try:
            reply = _roundtrip(conn, self.command, None, None, None)
        except RedisError as e:  # _roundtrip left a failed connection disconnected
            self.hand_over(None, e)
        else:
            self.hand_over(reply, None)

    def resend_on(self, transport: ScriptTransport) -> None:
        """Send the command again on any connection of ``transport``."""
        try:
            reply = transport.execute(self.command)
        except RedisError as e:
            self.hand_over(None, e)
        else:
            self.hand_over(reply, None)

    def hand_over(self, reply: Any, error: RedisError | None) -> None:
        self.answered = True
        # The answer comes inside another caller's call (the next claim, a
        # renewal): its own failure is logged, never raised into that call.
        try:
            self.answer(reply, error)
        except Exception:
            logging.getLogger(__name__).exception("the handler of a late reply failed")


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


def _closed(conn: Any) -> bool:
    """True if the server closed ``conn`` (or made it unusable) while it sat idle,
    no reply due on it: an idle timeout, CLIENT KILL, a restart, a proxy's reset.

    Polls the socket without waiting, as redis-py's pool does before lending a
    connection; a disconnected ``conn`` is connected here (the send needs it),
    and one that cannot be is reported closed. Bytes nobody asked for count
    too: a reply left there would be read as the next command's.
    """
    try:
        return bool(conn.can_read(timeout=0))
    except RedisError:  # end of stream or a reset, or no connection to be made
        return True


def _roundtrip(
    conn: Any,
    command: tuple[Any, ...],
    script: Script | None,
    then: tuple[Any, ...] | None,
    late: _Late | None,
) -> Any:
    """Send ``command`` (and ``then``) on ``conn`` and read the reply (EVAL if the
    server lacks ``script``); ``late``'s reply, which comes first, is read in between.

    Anything but a server's error reply leaves the connection disconnected, so a
    reply can never be left unread for the next command on it (redis-py's own
    send and read already do this for their errors; this covers the rest, such
    as a soft time limit raised between them).
    """
    replied = False  # every reply (or error reply) read: the connection stays usable
    try:
        try:
            reply = _send(conn, command, then, late)
        except NoScriptError:
            if script is None:
                replied = True
                raise
            reply = _send(conn, (b"EVAL", script.script, *command[2:]), then, None)
        replied = True
        return reply
    except ResponseError:
        replied = True
        raise
    finally:
        if not replied:
            conn.disconnect()


def _send(
    conn: Any, command: tuple[Any, ...], then: tuple[Any, ...] | None, late: _Late | None
) -> Any:
    if then is None:
        conn.send_packed_command(conn.pack_command(*command))
        if late is not None:
            late.read(conn)
        return conn.read_response()
    conn.send_packed_command(conn.pack_commands([command, then]))
    if late is not None:
        late.read(conn)
    try:
        first = conn.read_response()
    except ResponseError:
        conn.read_response()  # the second reply, so that none is left unread
        raise
    return first, conn.read_response()
