"""A loopback TCP proxy that loses replies on purpose: the lost-reply fault.

``LossyProxy(host, port)`` listens on a free loopback port and forwards every
connection to ``host:port`` byte for byte. ``drop_next_reply(match)`` arms it:
the next request whose bytes contain ``match`` is forwarded to the server
unchanged, the server's reply is read (so the server has applied the request
and answered), and then the client's connection is closed instead of
forwarding that reply. The client sees a dropped connection for a request the
server did apply: the fault a retry after a lost reply must survive.

``drop_replies(match)`` loses the reply to every request containing
``match`` until ``stop_dropping()``: a client that sends the request again on
a new connection (a driver's or a store's own resend) loses that reply too,
so the caller sees the error however often the request is repeated.

``hold_next_request(match)`` delays one request instead: it reaches the
server only after ``resume()``, so a test can land another client's request
in between (a race made deterministic).

The proxy records what it dropped (``dropped``: the request and the reply it
kept from the client), so a test first proves the fault happened, e.g. that
the server's reply said the write succeeded, before asserting on the retry.

Request/reply boundaries are the protocol's turn-taking: bytes from the client
since the last reply are "the request" (HTTP/1.1 without pipelining, RESP,
the PostgreSQL protocol in simple request/response use all take turns). A
reply split over several reads is dropped as a whole because the connection
is closed at its first bytes.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from dataclasses import dataclass

from tests.servers import LOOPBACK

__all__ = ["Dropped", "LossyProxy"]


@dataclass
class Dropped:
    """One lost reply: the request the server applied and the reply the client never saw."""

    request: bytes
    reply: bytes


class LossyProxy:
    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._armed: bytes | None = None
        self._armed_once = True
        self._hold: bytes | None = None
        self._held = threading.Event()
        self._resume = threading.Event()
        self.dropped: list[Dropped] = []
        self._dropped_event = threading.Event()
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="lossy-proxy", daemon=True).start()

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def drop_next_reply(self, match: bytes) -> None:
        """Lose the reply to the next request containing ``match`` (once)."""
        with self._lock:
            self._armed = match
            self._armed_once = True
            self._dropped_event.clear()

    def drop_replies(self, match: bytes) -> None:
        """Lose the reply to every request containing ``match``, until :meth:`stop_dropping`."""
        with self._lock:
            self._armed = match
            self._armed_once = False
            self._dropped_event.clear()

    def stop_dropping(self) -> None:
        """Forward every reply again."""
        with self._lock:
            self._armed = None

    def hold_next_request(self, match: bytes) -> None:
        """Keep the next request containing ``match`` from the server until :meth:`resume`."""
        with self._lock:
            self._hold = match
            self._held.clear()
            self._resume.clear()

    def wait_held(self, timeout: float) -> None:
        """Return once the request armed by :meth:`hold_next_request` is being held."""
        if not self._held.wait(timeout):
            raise AssertionError("the proxy holds no request: the armed request never came")

    def resume(self) -> None:
        """Forward the held request (and everything after it)."""
        self._resume.set()

    def wait_dropped(self, timeout: float) -> Dropped:
        """The reply dropped since :meth:`drop_next_reply` (AssertionError if none in time)."""
        if not self._dropped_event.wait(timeout):
            raise AssertionError("the proxy dropped no reply: the armed request never came")
        return self.dropped[-1]

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> LossyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the forwarding ------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
            pending = bytearray()  # the client's bytes since the server last answered
            threading.Thread(
                target=self._upstream, args=(client, server, pending), daemon=True
            ).start()
            threading.Thread(
                target=self._downstream, args=(client, server, pending), daemon=True
            ).start()

    def _upstream(self, client: socket.socket, server: socket.socket, pending: bytearray) -> None:
        try:
            while data := client.recv(65536):
                with self._lock:
                    pending += data
                    hold = self._hold is not None and self._hold in pending
                    if hold:
                        self._hold = None
                if hold:
                    self._held.set()
                    self._resume.wait(60)
                server.sendall(data)
        except OSError:
            pass
        finally:
            _shut(server)

    def _downstream(self, client: socket.socket, server: socket.socket, pending: bytearray) -> None:
        try:
            while data := server.recv(65536):
                with self._lock:
                    request = bytes(pending)
                    pending.clear()
                    armed = self._armed
                    drop = armed is not None and armed in request
                    if drop and self._armed_once:
                        self._armed = None
                if drop:
                    self.dropped.append(Dropped(request, data))
                    # Before the reset: the client acts on it at once, and its
                    # test may ask wait_dropped(0) right after.
                    self._dropped_event.set()
                    # RST, not FIN: the client must not wait for the rest of a reply.
                    # The socket is reset when its last user lets go of it: wake the
                    # _upstream thread blocked in recv on it first (SHUT_RD sends
                    # nothing), or the reset waits for the client's next request.
                    with contextlib.suppress(OSError):
                        client.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                        client.shutdown(socket.SHUT_RD)
                    client.close()
                    server.close()
                    return
                client.sendall(data)
        except OSError:
            pass
        finally:
            _shut(client)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
