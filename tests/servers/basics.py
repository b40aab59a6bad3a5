"""What every private server here, and the harnesses beside them, share:
free ports, polling with a deadline, one-line Redis commands, log tails, binaries."""

from __future__ import annotations

import glob
import os
import random
import shutil
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, TypeVar

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


def log_tail(path: Path, offset: int = 0, lines: int = 60) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except OSError as exc:
        return f"<log {path} unreadable: {exc}>"
    text = data.decode("utf-8", "replace").splitlines()
    shown = "\n".join(text[-lines:])
    return f"--- last {min(lines, len(text))} lines of {path} ---\n{shown}"


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def log_mentions_port_conflict(path: Path, offset: int) -> bool:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read().lower()
    except OSError:
        return False
    return b"address already in use" in data or b"eaddrinuse" in data


def find_binary(name: str, candidates: Sequence[str] = ()) -> str:
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
