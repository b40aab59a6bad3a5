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
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import os
import pwd
import queue
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

__all__ = [
    "PostgresServer",
    "RabbitMQServer",
    "RedisServer",
    "ServerStartError",
    "free_port",
    "redis_command",
    "wait_for",
]

T = TypeVar("T")

LOOPBACK = "127.0.0.1"

#: Ports that other software on a developer / CI machine commonly uses and
#: that must never be handed out, even if they happen to be free right now.
_RESERVED_PORTS = frozenset(
    {1883, 3306, 4222, 4369, 5432, 5433, 5672, 5671, 6379, 6380, 8080, 11211, 15672, 25672, 27017}
)
#: Ports are drawn from below the kernel's ephemeral range (32768-60999 on
#: Linux) so that an outgoing client connection can never grab the port of a
#: stopped server between its stop and its restart.
_PORT_RANGE = (20000, 32000)
_handed_out_ports: set[int] = set()
_port_lock = threading.Lock()


class ServerStartError(RuntimeError):
    """A server did not become ready; the message carries its log tail."""


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


def _port_is_free(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # No SO_REUSEADDR: a stricter check (fails on TIME_WAIT leftovers too).
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK) -> int:
    """Return a currently free TCP port on ``host``.

    The port is taken from outside the ephemeral range, is never one of the
    well-known service ports and is never returned twice by this process.
    """
    lo, hi = _PORT_RANGE
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    with _port_lock:
        for _ in range(2000):
            port = rng.randint(lo, hi)
            if port in _RESERVED_PORTS or port in _handed_out_ports:
                continue
            if _port_is_free(port, host):
                _handed_out_ports.add(port)
                return port
    raise RuntimeError(f"no free port found in {lo}-{hi} on {host}")


def wait_for(
    predicate: Callable[[], T | Literal[False] | None],
    timeout: float,
    what: str,
    *,
    interval: float = 0.02,
    max_interval: float = 0.25,
    abort: Callable[[], str | None] | None = None,
) -> T:
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` ends.

    ``abort`` is called on every round; if it returns a string, polling stops
    at once with a ``ServerStartError`` carrying that string (used to notice
    a server process that exited while we were waiting for it).
    """
    deadline = time.monotonic() + timeout
    delay = interval
    while True:
        result = predicate()
        if result:
            return result
        if abort is not None:
            reason = abort()
            if reason is not None:
                raise ServerStartError(f"{what}: {reason}")
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 1.5, max_interval)


def _encode_resp(*args: str | bytes | int) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, int):
            arg = str(arg)
        if isinstance(arg, str):
            arg = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


def redis_command(port: int, *args: str | bytes | int, db: int = 0, timeout: float = 2.0) -> bytes:
    """Send one command to a Redis server and return the first reply line.

    Dependency-free (raw RESP over a socket); good for PING, FLUSHDB,
    SHUTDOWN and similar commands whose reply is a single line.  The reply is
    returned raw, e.g. ``b"+PONG"`` or ``b"-LOADING ..."``.  With ``db`` the
    command runs after ``SELECT db`` on the same connection.
    """
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as s:
        reader = s.makefile("rb")
        if db:
            s.sendall(_encode_resp("SELECT", db))
            selected = reader.readline().rstrip(b"\r\n")
            if selected != b"+OK":
                return selected
        s.sendall(_encode_resp(*args))
        return reader.readline().rstrip(b"\r\n")


def _tail(path: Path, offset: int = 0, lines: int = 60) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except OSError as exc:
        return f"<log {path} unreadable: {exc}>"
    text = data.decode("utf-8", "replace").splitlines()
    shown = "\n".join(text[-lines:])
    return f"--- last {min(lines, len(text))} lines of {path} ---\n{shown}"


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _log_mentions_port_conflict(path: Path, offset: int) -> bool:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read().lower()
    except OSError:
        return False
    return b"address already in use" in data or b"eaddrinuse" in data


def _find_binary(name: str, candidates: Sequence[str] = ()) -> str:
    for cand in candidates:
        for hit in sorted(glob.glob(cand), reverse=True):
            if os.access(hit, os.X_OK):
                return hit
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(
        f"{name!r} not found (looked in {list(candidates)} and $PATH); "
        "install it, e.g. by running scripts/test as root"
    )


# --------------------------------------------------------------------------
# process spawning with a parent-death signal
# --------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - non-glibc platforms
    _libc = None


def _pdeathsig_preexec(sig: int, parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:
        # Runs in the child after fork and after setuid/setgid (CPython
        # applies user=/group= before calling preexec_fn), so the setting
        # survives the exec of a non-setuid binary.
        if _libc is not None:
            _libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent_pid:  # parent already gone
            os._exit(1)

    return preexec


class _Spawner:
    """Start child processes from a thread that lives as long as the process.

    Linux sends the parent-death signal when the *thread* that forked the
    child exits.  Processes started from the main thread are spawned there;
    ones requested from any other thread (e.g. a chaos test restarting a
    server in a background thread) are spawned by a daemon helper thread, so
    they do not die with the short-lived requesting thread.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[
            tuple[Callable[[], subprocess.Popen[bytes]], queue.SimpleQueue[Any]]
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _run(self) -> None:
        while True:
            func, reply = self._queue.get()
            try:
                reply.put((True, func()))
            except BaseException as exc:  # noqa: BLE001 - handed back to caller
                reply.put((False, exc))

    def popen(self, func: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        if threading.current_thread() is threading.main_thread():
            return func()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="test-server-spawner", daemon=True
                )
                self._thread.start()
        reply: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._queue.put((func, reply))
        ok, value = reply.get()
        if ok:
            assert isinstance(value, subprocess.Popen)
            return value
        raise value


_spawner = _Spawner()


def _spawn(
    argv: Sequence[str],
    *,
    log: IO[bytes],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    user: str | None = None,
    deathsig: int = signal.SIGKILL,
) -> subprocess.Popen[bytes]:
    parent = os.getpid()
    kwargs: dict[str, Any] = {}
    if user is not None:
        pw = pwd.getpwnam(user)
        kwargs.update(user=pw.pw_uid, group=pw.pw_gid, extra_groups=[])

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,  # own process group: kill() takes all of it
            preexec_fn=_pdeathsig_preexec(deathsig, parent),
            **kwargs,
        )

    return _spawner.popen(start)


def _group_alive(pgid: int) -> bool:
    """True while any non-zombie process is in process group ``pgid``."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may contain
        # spaces and parentheses, so split after the last ')'.
        fields = data[data.rfind(b")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# --------------------------------------------------------------------------
# registry of live servers, cleaned up at exit
# --------------------------------------------------------------------------

_live: dict[int, _ManagedServer] = {}
_live_lock = threading.Lock()
_cleanup_paths: list[Path] = []
#: the process that imported this module; a forked child (a test that
#: forks, a prefork worker) inherits the registry but must never kill or
#: delete its parent's servers when it exits
_owner_pid = os.getpid()


def _cleanup_at_exit() -> None:
    if os.getpid() != _owner_pid:
        return
    with _live_lock:
        servers = list(_live.values())
    for server in servers:
        with contextlib.suppress(Exception):
            server.kill()
    for path in _cleanup_paths:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_cleanup_at_exit)


class _ManagedServer:
    """Common process management for one private server instance."""

    name = "server"
    #: seconds to wait for readiness on ``start()``
    start_timeout = 30.0
    #: seconds to wait for a clean stop before escalating to SIGKILL
    stop_timeout = 30.0
    #: signal the server receives if the test process dies abruptly
    deathsig = signal.SIGKILL

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        port: int | None,
        env: Mapping[str, str] | None,
    ) -> None:
        Path(tmpdir).mkdir(parents=True, exist_ok=True)
        self.base = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=tmpdir))
        self._port_fixed = port is not None
        self.port: int = port if port is not None else free_port()
        self.log_path = self.base / f"{self.name}.log"
        self.extra_env: dict[str, str] = dict(env or {})
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_once = False
        self._lock = threading.RLock()
        self._outside_paths: list[Path] = []

    # -- to be provided by subclasses ----------------------------------
    def _prepare(self) -> None:
        """One-time setup before the first start (e.g. initdb)."""

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        return env

    def _user(self) -> str | None:
        return None

    def _cwd(self) -> Path:
        return self.base

    def _is_ready(self) -> bool:
        raise NotImplementedError

    def _graceful_stop(self) -> None:
        """Ask the server to shut down cleanly (no waiting here)."""
        self._send(signal.SIGTERM)

    def _after_exit(self) -> None:
        """Hook run after the server process group is gone."""

    def _before_start(self) -> None:
        """Hook run before every start (after ``_prepare``)."""

    # -- public API ----------------------------------------------------
    @property
    def pid(self) -> int | None:
        """PID of the server process while it is running, else ``None``."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return None
        return proc.pid

    @property
    def running(self) -> bool:
        return self.pid is not None

    def start(self) -> None:
        """Start the server and block until it answers (or raise)."""
        with self._lock:
            if self.running:
                raise RuntimeError(f"{self!r} is already running")
            if self._proc is not None:  # died on its own: reap what is left
                self.kill()
            if not self._started_once:
                self._prepare()
            attempts = 1 if (self._port_fixed or self._started_once) else 4
            for attempt in range(attempts):
                offset = _file_size(self.log_path)
                try:
                    self._start_once(offset)
                except ServerStartError:
                    conflict = _log_mentions_port_conflict(self.log_path, offset)
                    if conflict and attempt + 1 < attempts:
                        # Someone grabbed our port between free_port() and
                        # bind(): pick another one (first start only).
                        self.port = free_port()
                        continue
                    raise
                break
            self._started_once = True

    def _start_once(self, log_offset: int) -> None:
        self._before_start()
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(
                f"\n=== {time.strftime('%H:%M:%S')} starting {self.name} "
                f"on port {self.port} ===\n".encode()
            )
            log.flush()
            self._proc = _spawn(
                self._argv(),
                log=log,
                env=self._env(),
                cwd=self._cwd(),
                user=self._user(),
                deathsig=self.deathsig,
            )
        with _live_lock:
            _live[id(self)] = self

        proc = self._proc

        def exited() -> str | None:
            code = proc.poll()
            if code is None:
                return None
            return f"process exited with code {code}"

        try:
            wait_for(
                self._is_ready,
                self.start_timeout,
                f"{self.name} on {LOOPBACK}:{self.port}",
                abort=exited,
            )
        except (ServerStartError, TimeoutError) as exc:
            with contextlib.suppress(Exception):
                self.kill()
            raise ServerStartError(f"{exc}\n{_tail(self.log_path, log_offset)}") from None
        self.last_start_seconds = time.monotonic() - started

    def stop(self) -> None:
        """Stop the server cleanly; falls back to SIGKILL after a timeout."""
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            if proc.poll() is None:
                self._graceful_stop()
                try:
                    proc.wait(self.stop_timeout)
                except subprocess.TimeoutExpired:
                    self._send_group(signal.SIGKILL)
            self._reap()

    def kill(self) -> None:
        """SIGKILL the whole server process group (a crash, no clean-up)."""
        with self._lock:
            if self._proc is None:
                return
            self._send_group(signal.SIGCONT)
            self._send_group(signal.SIGKILL)
            self._reap()

    def cleanup(self) -> None:
        """Kill the server and delete its data kept outside ``tmpdir``.

        Logs in ``tmpdir`` are kept.  The instance cannot be restarted after
        this (fixtures call it on teardown).
        """
        self.kill()
        for path in self._outside_paths:
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(ValueError):
                _cleanup_paths.remove(path)
        self._outside_paths.clear()

    def restart(self, *, hard: bool = False) -> None:
        """Stop (or kill, with ``hard=True``) and start again on the same port."""
        with self._lock:
            if hard:
                self.kill()
            else:
                self.stop()
            self.start()

    def ensure_running(self) -> None:
        """Resume a paused server and start a stopped one (used by fixtures)."""
        with self._lock:
            if self.running:
                self.resume()
            else:
                self.start()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections hang, nothing answers."""
        self._send_group(signal.SIGSTOP)

    def resume(self) -> None:
        """Undo ``pause()``."""
        self._send_group(signal.SIGCONT)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # -- internals -------------------------------------------------------
    def _send(self, sig: int) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)

    def _send_group(self, sig: int) -> None:
        proc = self._proc
        if proc is not None:
            # start_new_session=True: the group id is the leader's pid.
            _signal_group(proc.pid, sig)

    def _reap(self) -> None:
        proc = self._proc
        assert proc is not None
        try:
            proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(10)
        # Children (PostgreSQL backends, Erlang helpers) may outlive the
        # leader for a moment; wait until the whole group is gone so that a
        # restart never races with leftovers of the previous incarnation.
        if _group_alive(proc.pid):
            _signal_group(proc.pid, signal.SIGKILL)
            wait_for(lambda: not _group_alive(proc.pid), 10.0, f"{self.name} group exit")
        self._proc = None
        with _live_lock:
            _live.pop(id(self), None)
        self._after_exit()

    def __enter__(self: T) -> T:
        assert isinstance(self, _ManagedServer)
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} port={self.port} pid={self.pid} dir={self.base}>"


# --------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------


class RedisServer(_ManagedServer):
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
        self.binary = _find_binary("redis-server", ["/usr/bin/redis-server"])

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


# --------------------------------------------------------------------------
# PostgreSQL
# --------------------------------------------------------------------------

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


class PostgresServer(_ManagedServer):
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
        _cleanup_paths.append(outside)
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
                f"{argv[0]} failed with code {result.returncode}\n{_tail(self.log_path, offset)}"
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
        lines = ["# written by tests/servers.py"]
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


# --------------------------------------------------------------------------
# RabbitMQ
# --------------------------------------------------------------------------


def _amqp_handshake_ok(port: int, timeout: float = 1.0) -> bool:
    """True if an AMQP 0-9-1 server on ``port`` answers with Connection.Start."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout) as s:
            s.sendall(b"AMQP\x00\x00\x09\x01")
            data = b""
            while len(data) < 11:
                chunk = s.recv(4096)
                if not chunk:
                    return False
                data += chunk
    except OSError:
        return False
    # method frame (type 1) on channel 0, class 10 (connection) method 10 (start)
    return data[0] == 1 and data[1:3] == b"\x00\x00" and data[7:11] == b"\x00\x0a\x00\x0a"


class RabbitMQServer(_ManagedServer):
    """A private RabbitMQ node with its own epmd, ports and directories.

    Node name ``rabbit-<unique>@localhost``; AMQP on ``127.0.0.1:<port>``;
    Erlang distribution, its epmd and the CLI tools' distribution ports are
    private too; no plugins (no management UI).  Runs as the current user
    (root works) by bypassing Debian's ``su rabbitmq`` wrapper script.
    """

    name = "rabbitmq"
    start_timeout = 90.0
    stop_timeout = 60.0

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        port: int | None = None,
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(tmpdir, port, env)
        self.server_bin = _find_binary("rabbitmq-server", ["/usr/lib/rabbitmq/bin/rabbitmq-server"])
        self.ctl_bin = _find_binary("rabbitmqctl", ["/usr/lib/rabbitmq/bin/rabbitmqctl"])
        self.epmd_bin = _find_binary(
            "epmd", ["/usr/lib/erlang/bin/epmd", "/usr/lib/erlang/erts-*/bin/epmd"]
        )
        self.nodename = f"rabbit-{os.getpid()}-{uuid.uuid4().hex[:8]}@localhost"
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.ctl_dist_port = free_port()
        self.home = self.base / "home"
        self.mnesia_base = self.base / "mnesia"
        self.log_base = self.base / "log"
        for d in (self.home, self.mnesia_base, self.log_base):
            d.mkdir()
        self.config_file = self.base / "rabbitmq.conf"
        self.env_file = self.base / "rabbitmq-env.conf"
        self.plugins_file = self.base / "enabled_plugins"
        self._epmd: subprocess.Popen[bytes] | None = None
        self.epmd_log = self.base / "epmd.log"

    def url(self, vhost: str = "/") -> str:
        path = "/" if vhost == "/" else vhost
        return f"amqp://guest:guest@{LOOPBACK}:{self.port}/{path}"

    def _env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RABBITMQ_", "ERL_")) and k not in ("NOTIFY_SOCKET",)
        }
        erl_args = "-kernel inet_dist_use_interface {127,0,0,1}"
        env.update(
            HOME=str(self.home),
            LC_ALL="C.UTF-8",
            LANG="C.UTF-8",
            ERL_EPMD_PORT=str(self.epmd_port),
            ERL_EPMD_ADDRESS=LOOPBACK,
            RABBITMQ_CONF_ENV_FILE=str(self.env_file),
            RABBITMQ_NODENAME=self.nodename,
            RABBITMQ_NODE_IP_ADDRESS=LOOPBACK,
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_CTL_DIST_PORT_MIN=str(self.ctl_dist_port),
            RABBITMQ_CTL_DIST_PORT_MAX=str(self.ctl_dist_port),
            RABBITMQ_CONFIG_FILE=str(self.config_file),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(self.base / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.plugins_file),
            RABBITMQ_MNESIA_BASE=str(self.mnesia_base),
            RABBITMQ_LOG_BASE=str(self.log_base),
            RABBITMQ_PID_FILE=str(self.base / "rabbitmq.pid"),
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=erl_args,
            RABBITMQ_CTL_ERL_ARGS=erl_args,
            # run the VM in place of the wrapper shell (no signal-forwarding
            # proxy), so our child *is* beam and the death signal reaches it
            RUNNING_UNDER_SYSTEMD="true",
        )
        env.update(self.extra_env)
        return env

    def _prepare(self) -> None:
        self.env_file.write_text("# private test node: no settings from /etc\n")
        self.plugins_file.write_text("[].\n")

    def _before_start(self) -> None:
        self.config_file.write_text(
            "\n".join(
                [
                    f"listeners.tcp.1 = {LOOPBACK}:{self.port}",
                    "loopback_users.guest = true",
                    "disk_free_limit.absolute = 1MB",
                    "log.file.level = info",
                    "log.console = false",
                    "",
                ]
            )
        )
        self._start_epmd()

    def _start_epmd(self) -> None:
        if self._epmd is not None and self._epmd.poll() is None:
            return
        with open(self.epmd_log, "ab") as log:
            self._epmd = _spawn(
                [self.epmd_bin, "-port", str(self.epmd_port), "-address", LOOPBACK],
                log=log,
                env=self._env(),
                cwd=self.base,
            )
        epmd = self._epmd

        def up() -> bool:
            try:
                socket.create_connection((LOOPBACK, self.epmd_port), timeout=0.5).close()
            except OSError:
                return False
            return True

        def exited() -> str | None:
            code = epmd.poll()
            return None if code is None else f"epmd exited with {code}\n{_tail(self.epmd_log)}"

        wait_for(up, 10.0, f"epmd on port {self.epmd_port}", abort=exited)

    def _stop_epmd(self) -> None:
        epmd = self._epmd
        if epmd is None:
            return
        _signal_group(epmd.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            epmd.wait(10)
        self._epmd = None

    def _after_exit(self) -> None:
        self._stop_epmd()

    def _argv(self) -> list[str]:
        return [self.server_bin]

    def _is_ready(self) -> bool:
        return _amqp_handshake_ok(self.port)

    def _start_once(self, log_offset: int) -> None:
        # the broker's own log lives in log_base; append its tail on failure
        try:
            super()._start_once(log_offset)
        except ServerStartError as exc:
            own = self.log_base / f"{self.nodename}.log"
            raise ServerStartError(f"{exc}\n{_tail(own)}") from None

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl -n NODE ARGS...`` and return its stdout."""
        result = subprocess.run(
            [self.ctl_bin, "-n", self.nodename, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=self._env(),
            cwd=self.base,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"rabbitmqctl {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result.stdout

    def list_connections(self) -> list[str]:
        """Names ("ip:port -> ip:port") of the client connections."""
        out = self.ctl("list_connections", "name", "--quiet", "--no-table-headers")
        return [line.strip() for line in out.splitlines() if line.strip()]

    def list_vhosts(self) -> list[str]:
        out = self.ctl("list_vhosts", "name", "--quiet", "--no-table-headers")
        return [line.strip() for line in out.splitlines() if line.strip()]

    def close_all_connections(
        self, reason: str = "closed by test", *, hard: bool = False, timeout: float = 30.0
    ) -> None:
        """Close every client connection, vhost by vhost.

        RabbitMQ sends ``Connection.Close`` (CONNECTION_FORCED); a client
        that is reading sees it at once.  A client that is not reading keeps
        the connection half-open for up to 30 s while the broker waits for
        its ``Close-Ok``; with ``hard=True`` the close is repeated until no
        connection is listed any more, which resets those TCP connections
        (a second close of a closing connection terminates it).

        (``close_all_connections --global`` reported success without closing
        anything on RabbitMQ 3.10, hence the per-vhost loop.)
        """

        def close_all() -> None:
            for vhost in self.list_vhosts():
                self.ctl("close_all_connections", "--vhost", vhost, reason)

        close_all()
        if hard:

            def gone() -> bool:
                if not self.list_connections():
                    return True
                close_all()
                return False

            wait_for(gone, timeout, "client connections to close")


def iter_live_servers() -> Iterator[_ManagedServer]:
    """The servers this process has running right now (for diagnostics)."""
    with _live_lock:
        yield from list(_live.values())
