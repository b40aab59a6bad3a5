"""Child processes that die with the test process: their own process group,
and a parent-death signal from a thread that lives as long as the process."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import pwd
import queue
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any

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


def spawn(
    argv: Sequence[str],
    *,
    log: IO[bytes],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    user: str | None = None,
    deathsig: int = signal.SIGKILL,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a process group of its own (so a kill takes all of it),
    its output to ``log``, and ``deathsig`` sent to it if this process dies."""
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


def _proc_stats() -> Iterator[tuple[int, list[bytes]]]:
    """``(pid, ["state", "ppid", "pgrp", ...])`` of every process in /proc."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may contain
        # spaces and parentheses, so split after the last ')'.
        yield int(stat.split("/")[2]), data[data.rfind(b")") + 2 :].split()


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process is in process group ``pgid``."""
    return any(
        len(f) >= 3 and int(f[2]) == pgid and f[0] not in (b"Z", b"X") for _, f in _proc_stats()
    )


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s live children (PostgreSQL backends each lead their
    own session, so they are not in the postmaster's process group)."""
    return [
        child
        for child, f in _proc_stats()
        if len(f) >= 2 and int(f[1]) == pid and f[0] not in (b"Z", b"X")
    ]


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
