"""PostgreSQL connections end soon after their peer is gone without a word.

A half-open connection (a dead host, a NAT dropping the flow) answers nothing
and psycopg has no read timeout: a call on it waits until the kernel gives up,
~15 min by default. The store's connections carry TCP keepalives and a
``tcp_user_timeout``, which end it in seconds; the options are read back from
the kernel's socket of a connection the store made, so they are proved to
reach it (not only libpq's parameters).
"""

from __future__ import annotations

import socket

import pytest

import celery_lease
from celery_lease.sql.driver import database

pytestmark = pytest.mark.timeout(60)


def test_store_connections_carry_keepalives_and_a_user_timeout(pg_url: str) -> None:
    celery_lease.migrate(pg_url)
    raw, _ = database(pg_url)._pool.connect()
    try:
        sock = socket.socket(fileno=raw.fileno())
        try:
            options = {
                "SO_KEEPALIVE": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                "TCP_KEEPIDLE": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                "TCP_KEEPINTVL": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                "TCP_KEEPCNT": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                "TCP_USER_TIMEOUT": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
            }
        finally:
            sock.detach()  # the connection's descriptor stays open: psycopg owns it
    finally:
        raw.close()
    assert options == {
        "SO_KEEPALIVE": 1,
        "TCP_KEEPIDLE": 10,
        "TCP_KEEPINTVL": 5,
        "TCP_KEEPCNT": 3,
        "TCP_USER_TIMEOUT": 15_000,
    }
