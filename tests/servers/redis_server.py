"""A private ``redis-server``."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from typing import Literal

from tests.servers.basics import LOOPBACK, find_binary, redis_command
from tests.servers.managed import ManagedServer


class RedisServer(ManagedServer):
    """A private ``redis-server`` on ``127.0.0.1:<port>``.

    ``appendonly=True`` keeps data in an AOF (fsynced per ``appendfsync``)
    so it survives ``kill()`` + ``start()``; ``appendonly=False`` disables
    every kind of persistence so that any restart starts empty.
    """

    name = "redis"
    start_timeout = 20.0
    databases = 64

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        appendonly: bool,
        appendfsync: Literal["always", "everysec", "no"] = "always",
        port: int | None = None,
        *,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(tmpdir, port, env)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra_args = list(extra_args)
        self.data_dir = self.base / "data"
        self.data_dir.mkdir()
        self.binary = find_binary("redis-server", ["/usr/bin/redis-server"])

    def url(self, db: int = 0) -> str:
        return f"redis://{LOOPBACK}:{self.port}/{db}"

    def _argv(self) -> list[str]:
        return [
            self.binary,
            "--port", str(self.port),
            "--bind", LOOPBACK,
            "--protected-mode", "yes",
            "--daemonize", "no",
            "--supervised", "no",
            "--logfile", "",
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--databases", str(self.databases),
            # allow DEBUG SLEEP / DEBUG SEGFAULT etc. from loopback for chaos tests
            "--enable-debug-command", "local",
            *self.extra_args,
        ]  # fmt: skip

    def _is_ready(self) -> bool:
        try:
            return redis_command(self.port, "PING", timeout=1.0) == b"+PONG"
        except OSError:
            return False

    def _graceful_stop(self) -> None:
        # SIGTERM makes Redis shut down cleanly: the AOF is flushed and
        # fsynced; with --save "" no RDB snapshot is written, so a server
        # without appendonly really forgets everything (SHUTDOWN NOSAVE).
        self._send(signal.SIGTERM)

    def command(self, *args: str | bytes | int, db: int = 0) -> bytes:
        """Send one command (to database ``db``), return the raw first reply line."""
        return redis_command(self.port, *args, db=db)

    def flushdb(self, db: int = 0) -> None:
        reply = self.command("FLUSHDB", db=db)
        if reply != b"+OK":
            raise RuntimeError(f"FLUSHDB on db {db} failed: {reply!r}")

    def flushall(self) -> None:
        reply = self.command("FLUSHALL")
        if reply != b"+OK":
            raise RuntimeError(f"FLUSHALL failed: {reply!r}")
