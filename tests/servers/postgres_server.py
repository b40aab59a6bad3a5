"""A private PostgreSQL cluster (run as the ``postgres`` user when the tests
run as root: PostgreSQL refuses root)."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from tests.servers.basics import LOOPBACK, ServerStartError, log_tail
from tests.servers.managed import ManagedServer, remove_at_exit
from tests.servers.process import children

PgStopMode = Literal["smart", "fast", "immediate"]
_PG_STOP_SIGNALS: dict[str, int] = {
    # exactly what ``pg_ctl stop -m MODE`` sends to the postmaster
    "smart": signal.SIGTERM,
    "fast": signal.SIGINT,
    "immediate": signal.SIGQUIT,
}


def _pg_bindir() -> Path:
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()
            if out and (Path(out) / "initdb").exists():
                return Path(out)

    def version(p: str) -> tuple[int, ...]:
        part = Path(p).parent.name
        return tuple(int(x) for x in part.split(".") if x.isdigit()) or (0,)

    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: version(p), reverse=True
    )
    if candidates:
        return Path(candidates[0]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    raise FileNotFoundError(
        "PostgreSQL server binaries (initdb, postgres) not found; "
        "install them, e.g. by running scripts/test as root"
    )


class PostgresServer(ManagedServer):
    """A private PostgreSQL cluster on ``127.0.0.1:<port>`` with trust auth.

    The postmaster runs in the foreground as a child of the test process
    (as the ``postgres`` OS user when running as root).  ``stop(mode)``
    sends the same signals ``pg_ctl stop -m mode`` would.  ``fsync`` is off
    for speed, which only matters for an OS crash: a committed row survives
    a clean stop, ``stop("immediate")`` and even ``kill()``, because the WAL
    is still written to the (OS-cached) file at commit.
    """

    name = "postgres"
    start_timeout = 60.0
    deathsig = signal.SIGQUIT  # immediate shutdown, takes the backends along

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        port: int | None = None,
        *,
        settings: Mapping[str, str | int] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(tmpdir, port, env)
        self.bindir = _pg_bindir()
        self.os_user: str | None = "postgres" if os.geteuid() == 0 else None
        self.settings: dict[str, str | int] = {
            "listen_addresses": LOOPBACK,
            "max_connections": 200,
            "fsync": "off",
            "synchronous_commit": "on",
            "full_page_writes": "off",
            "wal_level": "minimal",
            "max_wal_senders": 0,
            "shared_buffers": "64MB",
            "timezone": "UTC",
            "log_timezone": "UTC",
            "log_min_messages": "warning",
            "log_line_prefix": "%m [%p] ",
        }
        self.settings.update(settings or {})
        # The data directory must be reachable by the postgres user; the
        # given tmpdir may sit under a root-only 0700 directory (pytest's
        # tmp_path_factory does that), so fall back to the system temp dir
        # and leave a symlink next to the log.
        self.cluster_dir = self._cluster_dir()
        self.data_dir = self.cluster_dir / "data"
        self.socket_dir = self.cluster_dir / "sock"

    def _cluster_dir(self) -> Path:
        if self.os_user is None:
            return self.base
        pw = pwd.getpwnam(self.os_user)
        os.chown(self.base, pw.pw_uid, pw.pw_gid)
        probe = subprocess.run(
            ["test", "-w", str(self.base), "-a", "-x", str(self.base)],
            user=pw.pw_uid,
            group=pw.pw_gid,
            extra_groups=[],
            check=False,
        )
        if probe.returncode == 0:
            return self.base
        _remove_stale_pg_dirs()
        outside = Path(tempfile.mkdtemp(prefix=f"{_PG_OUTSIDE_PREFIX}{os.getpid()}-"))
        os.chown(outside, pw.pw_uid, pw.pw_gid)
        remove_at_exit(outside)
        self._outside_paths.append(outside)
        (self.base / "cluster").symlink_to(outside)
        return outside

    def _user(self) -> str | None:
        return self.os_user

    def _cwd(self) -> Path:
        return self.cluster_dir

    def _run_as_owner(self, argv: Sequence[str], timeout: float = 120.0) -> None:
        kwargs: dict[str, Any] = {}
        if self.os_user is not None:
            pw = pwd.getpwnam(self.os_user)
            kwargs.update(user=pw.pw_uid, group=pw.pw_gid, extra_groups=[])
        with open(self.log_path, "ab") as log:
            offset = log.tell()
            log.write(f"\n=== {' '.join(argv)} ===\n".encode())
            log.flush()
            result = subprocess.run(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.cluster_dir,
                env=self._env(),
                timeout=timeout,
                check=False,
                **kwargs,
            )
        if result.returncode != 0:
            raise ServerStartError(
                f"{argv[0]} failed with code {result.returncode}\n{log_tail(self.log_path, offset)}"
            )

    def _env(self) -> dict[str, str]:
        env = super()._env()
        env.setdefault("LC_ALL", "C.UTF-8")
        env.setdefault("TZ", "UTC")
        for var in ("PGDATA", "PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGSERVICE"):
            env.pop(var, None)
        return env

    def _prepare(self) -> None:
        self.socket_dir.mkdir(exist_ok=True)
        if self.os_user is not None:
            pw = pwd.getpwnam(self.os_user)
            os.chown(self.socket_dir, pw.pw_uid, pw.pw_gid)
        self._run_as_owner(
            [
                str(self.bindir / "initdb"),
                "-D", str(self.data_dir),
                "-U", "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
            ]
        )  # fmt: skip

    def _write_config(self) -> None:
        # Rewritten before each start so the port is part of the cluster's
        # own config (pg_ctl -D data start would use it as well).
        conf = {
            **self.settings,
            "port": self.port,
            "unix_socket_directories": str(self.socket_dir),
        }
        lines = ["# written by tests/servers/postgres_server.py"]
        for key, value in conf.items():
            if isinstance(value, int):
                lines.append(f"{key} = {value}")
            else:
                escaped = str(value).replace("'", "''")
                lines.append(f"{key} = '{escaped}'")
        path = self.data_dir / "postgresql.test.conf"
        path.write_text("\n".join(lines) + "\n")
        main_conf = self.data_dir / "postgresql.conf"
        include = "include = 'postgresql.test.conf'\n"
        text = main_conf.read_text()
        if include not in text:
            main_conf.write_text(text + "\n" + include)
        if self.os_user is not None:
            pw = pwd.getpwnam(self.os_user)
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def _before_start(self) -> None:
        self._write_config()

    def _argv(self) -> list[str]:
        return [str(self.bindir / "postgres"), "-D", str(self.data_dir)]

    def _is_ready(self) -> bool:
        result = subprocess.run(
            [
                str(self.bindir / "pg_isready"),
                "-q", "-h", LOOPBACK, "-p", str(self.port), "-U", "postgres",
                "-d", "postgres", "-t", "2",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self._env(),
            check=False,
        )  # fmt: skip
        return result.returncode == 0

    def stop(self, mode: PgStopMode = "fast") -> None:
        """Stop like ``pg_ctl stop -m mode`` and wait for the postmaster to exit."""
        if mode not in _PG_STOP_SIGNALS:
            raise ValueError(f"unknown stop mode {mode!r}")
        self._stop_signal = _PG_STOP_SIGNALS[mode]
        try:
            super().stop()
        finally:
            self._stop_signal = signal.SIGINT

    _stop_signal: int = signal.SIGINT

    def _graceful_stop(self) -> None:
        self._send(self._stop_signal)

    def restart(self, *, hard: bool = False, mode: PgStopMode = "fast") -> None:
        with self._lock:
            if hard:
                self.kill()
            else:
                self.stop(mode)
            self.start()

    def pause(self) -> None:
        """Freeze the cluster (SIGSTOP): open connections hang, new ones get no answer.

        The postmaster's process group is not enough: every backend leads its
        own session, so an open connection would go on being served. The
        postmaster stops first, so no child is forked while they are stopped.
        """
        super().pause()
        proc = self._proc
        if proc is not None:
            for pid in children(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Undo ``pause()``: the backends, then the postmaster."""
        proc = self._proc
        if proc is not None:
            for pid in children(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        super().resume()

    def url(self, dbname: str = "postgres") -> str:
        """SQLAlchemy URL (psycopg 3 driver) for ``dbname`` on this cluster."""
        return f"postgresql+psycopg://postgres@{LOOPBACK}:{self.port}/{dbname}"

    def dsn(self, dbname: str = "postgres") -> str:
        """libpq / psycopg connection string for ``dbname``."""
        return f"postgresql://postgres@{LOOPBACK}:{self.port}/{dbname}"

    def _admin_execute(self, sql: str) -> None:
        import psycopg  # imported lazily: only the PostgreSQL tests need it

        with psycopg.connect(self.dsn("postgres"), autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql)

    def create_database(self, name: str) -> str:
        """Create database ``name`` and return its SQLAlchemy URL."""
        self._admin_execute(f'CREATE DATABASE "{_pg_ident(name)}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop ``name``, disconnecting its clients (PostgreSQL 13+)."""
        self._admin_execute(f'DROP DATABASE IF EXISTS "{_pg_ident(name)}" WITH (FORCE)')


_PG_OUTSIDE_PREFIX = "celery-lease-pg-"


def _remove_stale_pg_dirs() -> None:
    """Remove cluster dirs left in the temp dir by test runs that died."""
    for path in Path(tempfile.gettempdir()).glob(f"{_PG_OUTSIDE_PREFIX}*-*"):
        owner = path.name[len(_PG_OUTSIDE_PREFIX) :].split("-", 1)[0]
        if not owner.isdigit() or int(owner) == os.getpid():
            continue
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass


def _pg_ident(name: str) -> str:
    if not name or '"' in name or "\x00" in name or len(name.encode()) > 63:
        raise ValueError(f"unusable database name {name!r}")
    return name
