"""One private server's process, managed: start until it answers, stop, kill,
pause, restart on the same port; and the registry that kills every live one
at exit."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TypeVar

from tests.servers.basics import (
    LOOPBACK,
    ServerStartError,
    file_size,
    free_port,
    log_mentions_port_conflict,
    log_tail,
    wait_for,
)
from tests.servers.process import group_alive, signal_group, spawn

T = TypeVar("T")

_live: dict[int, ManagedServer] = {}
_live_lock = threading.Lock()
_cleanup_paths: list[Path] = []
#: the process that imported this module; a forked child (a test that
#: forks, a prefork worker) inherits the registry but must never kill or
#: delete its parent's servers when it exits
_owner_pid = os.getpid()


def remove_at_exit(path: Path) -> None:
    """Delete ``path`` when this process exits (a server's data kept outside
    its tmpdir); :meth:`ManagedServer.cleanup` deletes it sooner."""
    _cleanup_paths.append(path)


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


class ManagedServer:
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
                offset = file_size(self.log_path)
                try:
                    self._start_once(offset)
                except ServerStartError:
                    conflict = log_mentions_port_conflict(self.log_path, offset)
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
            self._proc = spawn(
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
            raise ServerStartError(f"{exc}\n{log_tail(self.log_path, log_offset)}") from None
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
            self.resume()  # a paused process that outlived its leader would stay stopped
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
            signal_group(proc.pid, sig)

    def _reap(self) -> None:
        proc = self._proc
        assert proc is not None
        try:
            proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait(10)
        # Children (PostgreSQL backends, Erlang helpers) may outlive the
        # leader for a moment; wait until the whole group is gone so that a
        # restart never races with leftovers of the previous incarnation.
        if group_alive(proc.pid):
            signal_group(proc.pid, signal.SIGKILL)
            wait_for(lambda: not group_alive(proc.pid), 10.0, f"{self.name} group exit")
        self._proc = None
        with _live_lock:
            _live.pop(id(self), None)
        self._after_exit()

    def __enter__(self: T) -> T:
        assert isinstance(self, ManagedServer)
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} port={self.port} pid={self.pid} dir={self.base}>"


def iter_live_servers() -> Iterator[ManagedServer]:
    """The servers this process has running right now (for diagnostics)."""
    with _live_lock:
        yield from list(_live.values())
