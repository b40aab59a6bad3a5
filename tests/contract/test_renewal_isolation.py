"""A store whose renewal call hangs delays no other store's renewals, nor its own losses.

A process renews every lease it holds from one renewal thread. A PostgreSQL
server that stops answering without closing its connections (a dead host, a
NAT dropping the flow; here SIGSTOP) leaves a renewal waiting in psycopg, which
has no read timeout, until the kernel gives the connection up (up to ~15
minutes). Timeline, TTL 3 s, renewed every second:

    00:00  leases on PostgreSQL and on Redis, both renewed
    00:01  PostgreSQL frozen: its next renewal hangs
    ~00:04 the PostgreSQL lease's local view runs out: it is lost, its
           callbacks run (LEASE_LOST for a task) on time, not when the call ends
    00:01 onwards  the Redis lease goes on being renewed, well past its TTL
    then   PostgreSQL resumes: the hung call returns, and a new PostgreSQL
           lease is renewed again

Before the fix, the hung call blocked the one thread: the Redis lease went
unrenewed and was lost at its TTL, and no lost callback ran at all.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import psycopg
import pytest

import celery_lease
from celery_lease import LeaseStore
from celery_lease.renewal import HeldLease
from tests.servers import PostgresServer, RedisServer, wait_for

pytestmark = pytest.mark.timeout(120)

TTL = 3.0  # renewed every TTL / 3
#: How late a lost callback may run after the lease's local view ran out (the
#: renewal thread wakes at that moment; two shared cores under a CI run).
LATE = 0.75


def _record_loss(lost: dict[str, tuple[float, str]]) -> Callable[[HeldLease, str], None]:
    def on_lost(held: HeldLease, reason: str) -> None:
        lost.setdefault(held.key, (time.monotonic(), reason))

    return on_lost


def _expiry(store: LeaseStore, held: HeldLease) -> float:
    record = store.inspect(held.key)
    assert record is not None and record.live and record.owner_id == held.owner_id, record
    return record.expires_at


def _frozen(pg: PostgresServer) -> bool:
    """True if the server accepts no session now (a fresh connection times out)."""
    try:
        psycopg.connect(pg.dsn("hung"), connect_timeout=2).close()
    except psycopg.OperationalError as e:
        return "timeout" in str(e)
    return False


def test_a_hung_store_delays_neither_other_stores_renewals_nor_its_own_lost_callbacks(
    make_pg_server: Callable[..., PostgresServer],
    make_redis_server: Callable[..., RedisServer],
) -> None:
    pg_server = make_pg_server()
    url = pg_server.create_database("hung")
    celery_lease.migrate(url)
    pg = LeaseStore.from_url(url)
    rs = LeaseStore.from_url(make_redis_server(appendonly=False).url(0))
    lost: dict[str, tuple[float, str]] = {}
    with contextlib.ExitStack() as stack:
        on_pg = stack.enter_context(pg.hold("on-pg", ttl=TTL))
        on_redis = stack.enter_context(rs.hold("on-redis", ttl=TTL))
        for held in (on_pg, on_redis):
            held.add_lost_callback(_record_loss(lost))
        # Both renewed on their stores: the PostgreSQL renewal's connection is
        # pooled, and the next renewal goes out on it.
        wait_for(lambda: on_pg.renewals >= 1 and on_redis.renewals >= 1, 2 * TTL, "renewals")

        pg_server.pause()
        try:
            assert _frozen(pg_server), "the paused PostgreSQL server still answers"
            frozen_at = time.monotonic()
            redis_count, redis_expiry = on_redis.renewals, _expiry(rs, on_redis)

            # The PostgreSQL lease: lost once its local view ran out, on time.
            wait_for(lambda: "on-pg" in lost, 3 * TTL, "the PostgreSQL lease's lost callback")
            lost_at, reason = lost["on-pg"]
            assert on_pg.valid_until <= lost_at <= on_pg.valid_until + LATE, (
                f"lost callback {lost_at - on_pg.valid_until:+.2f}s after the local view ran out"
            )
            assert "validity ran out" in reason, reason

            # The Redis lease: renewed all along, well past its TTL.
            past_ttl = frozen_at + 2 * TTL
            wait_for(
                lambda: time.monotonic() >= past_ttl and on_redis.renewals >= redis_count + 4,
                3 * TTL,
                "Redis renewals while PostgreSQL hangs",
            )
            assert on_redis.held and "on-redis" not in lost, lost
            moved = _expiry(rs, on_redis) - redis_expiry
            assert moved > TTL, f"the Redis record's expiry moved {moved:.2f}s in {2 * TTL}s"
            assert _frozen(pg_server), "PostgreSQL answered during the test: no fault proved"
        finally:
            pg_server.resume()

        # PostgreSQL answers again: its leases are renewed again.
        again = stack.enter_context(pg.hold("on-pg-again", ttl=TTL))
        claimed_at = time.monotonic()
        expiry = _expiry(pg, again)
        wait_for(
            lambda: time.monotonic() >= claimed_at + 1.5 * TTL and again.renewals >= 3,
            3 * TTL,
            "renewals of a new PostgreSQL lease after the server resumed",
        )
        assert again.held and "on-pg-again" not in lost, lost
        assert _expiry(pg, again) > expiry + TTL / 2
    pg.close()
    rs.close()
