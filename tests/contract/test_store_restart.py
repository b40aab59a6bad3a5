"""Tokens only grow across restarts of the store (invariant 1), on private servers.

Every test starts its own server (``make_redis_server`` / ``make_pg_server``
from conftest) so killing it disturbs nobody else. The store object is made
once, before the restart, and used again after it: callers do not recreate
stores when a server comes back.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

import celery_lease
from celery_lease import LeaseStore, StoreUnavailable
from celery_lease.stores.base import Lease, LeaseRecord
from tests.servers import PostgresServer, RedisServer
from tests.store_fixtures import CLIENT, PYTHON, client_env, new_key, wait_until_expired

pytestmark = pytest.mark.timeout(120)

A, B, C = "owner-a:1:a", "owner-b:2:b", "owner-c:3:c"


def claim_ok(store: LeaseStore, key: str, owner: str, ttl: float = 60.0) -> Lease:
    lease = store.claim(key, owner_id=owner, ttl=ttl)
    assert lease is not None, f"claim of {key} by {owner} refused: {store.inspect(key)}"
    return lease


def is_free(record: LeaseRecord | None) -> bool:
    return record is None or not record.live


def assert_unavailable(store: LeaseStore, key: str, lease: Lease) -> None:
    """Every store operation fails with StoreUnavailable, never a driver error."""
    operations: dict[str, Callable[[], Any]] = {
        "claim": lambda: store.claim(new_key(), owner_id=C, ttl=5),
        "claim-many": lambda: store.claim([new_key(), new_key()], owner_id=C, ttl=5),
        "renew": lambda: store.renew(lease),
        "renew_many": lambda: store.renew_many([lease]),
        "release": lambda: store.release(lease),
        "inspect": lambda: store.inspect(key),
        "list": lambda: store.list(prefix=key),
        "evict": lambda: store.evict(new_key()),
        "fence_token": lambda: store.fence_token(key),
        "time": store.time,
    }
    for name, op in operations.items():
        with pytest.raises(StoreUnavailable) as info:
            op()
        assert type(info.value) is StoreUnavailable, name
        # The driver's error is kept as the cause, for the logs.
        assert info.value.__cause__ is not None, name
    with pytest.raises(StoreUnavailable), store.hold(new_key(), ttl=5):
        pytest.fail("hold() entered while the store was down")


# --------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------


def test_redis_aof_tokens_grow_across_sigkill(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    server = make_redis_server(appendonly=True, appendfsync="always")
    store = LeaseStore.from_url(server.url(0))
    key = new_key()
    first = claim_ok(store, key, A)
    assert store.release(first)
    held = claim_ok(store, key, B)
    assert held.token > first.token

    server.kill()  # SIGKILL: no shutdown, no final fsync
    assert_unavailable(store, key, held)
    server.start()

    # The fence counter came back from the AOF: it is the counter (not the
    # clock floor) that still names the newest token.
    assert store.fence_token(key) == held.token
    # So did the live lease: its owner still holds it and can renew it.
    record = store.inspect(key)
    assert record is not None and record.live
    assert (record.owner_id, record.token) == (B, held.token)
    assert store.claim(key, owner_id=C, ttl=60) is None
    assert store.renew(held) is True
    assert store.release(held) is True
    after = claim_ok(store, key, C)
    assert after.token > held.token > first.token
    store.close()


def test_redis_without_persistence_tokens_grow_by_the_clock_floor(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    server = make_redis_server(appendonly=False)
    store = LeaseStore.from_url(server.url(0))
    key = new_key()
    tokens = []
    for owner in (A, B, C, A, B):
        lease = claim_ok(store, key, owner)
        tokens.append(lease.token)
        assert store.release(lease)
    live = claim_ok(store, key, C)
    tokens.append(live.token)
    assert tokens == sorted(set(tokens))
    assert store.fence_token(key) == live.token

    server.kill()
    server.start()

    # The data really is gone: no lease, no fence counter, an empty server.
    assert server.command("DBSIZE") == b":0"
    assert store.fence_token(key) == 0
    assert store.inspect(key) is None
    # The old owner's lease went with it: it cannot renew or release.
    assert store.renew(live) is False
    assert store.release(live) is False

    after = claim_ok(store, key, A)
    assert after.token > max(tokens), "a token was reused after Redis lost its data"
    assert store.fence_token(key) == after.token
    store.close()


# --------------------------------------------------------------------------
# PostgreSQL
# --------------------------------------------------------------------------


@pytest.fixture
def pg_restart_store(
    make_pg_server: Callable[..., PostgresServer],
) -> tuple[PostgresServer, LeaseStore]:
    server = make_pg_server()
    url = server.create_database("leases")
    celery_lease.migrate(url)
    return server, LeaseStore.from_url(url)


def test_postgres_tokens_grow_across_an_immediate_restart(
    pg_restart_store: tuple[PostgresServer, LeaseStore],
) -> None:
    server, store = pg_restart_store
    key, other = new_key(), new_key("other")
    first = claim_ok(store, key, A)
    assert store.release(first)
    held = claim_ok(store, key, B)
    kept = claim_ok(store, other, A, ttl=120)
    assert held.token > first.token

    server.stop("immediate")  # like a crash: no checkpoint, WAL replay on start
    assert_unavailable(store, key, held)
    server.start()

    # The same store object works again, and nothing committed was lost.
    assert store.fence_token(key) == held.token
    record = store.inspect(key)
    assert record is not None and record.live
    assert (record.owner_id, record.token) == (B, held.token)
    assert store.claim(key, owner_id=C, ttl=60) is None
    assert store.renew_many([held, kept]) == [
        pytest.approx(store.time() + 60, abs=2.0),
        pytest.approx(store.time() + 120, abs=2.0),
    ]
    assert store.release(held) is True
    after = claim_ok(store, key, C)
    assert after.token > held.token > first.token
    store.close()


def test_postgres_outage_without_prior_use_recovers(
    pg_restart_store: tuple[PostgresServer, LeaseStore],
) -> None:
    """Idle connections from before a restart are replaced, not surfaced as errors.

    Every idle connection died with the server; the first operation after the
    restart (none ran during the outage) must simply work: a connection from
    the free list that turns out dead is replaced and the statement resent.
    """
    server, store = pg_restart_store
    key = new_key()
    leases = [claim_ok(store, new_key(), A) for _ in range(3)]
    held = claim_ok(store, key, A)
    idle = [raw for raw, _cursor in store.db._pool.idle]  # type: ignore[attr-defined]
    assert idle, "the store kept no idle connection: nothing stale to test"
    before = {raw.info.backend_pid for raw in idle}
    server.stop("immediate")
    server.start()
    assert store.renew(held) is True  # first use: no StoreUnavailable
    stale = idle[-1]  # the free list is LIFO: the renewal took this one first
    assert stale.closed or stale.broken  # its session did die with the server
    with store.db.single() as conn:  # type: ignore[attr-defined]
        assert conn.execute("SELECT pg_backend_pid()").scalar() not in before
    assert store.renew_many(leases) == [pytest.approx(store.time() + 60, abs=2.0)] * 3
    assert claim_ok(store, key, A).token > held.token
    store.close()


# --------------------------------------------------------------------------
# SQLite: embedded, so "restart" is a new process opening the file
# --------------------------------------------------------------------------


def test_sqlite_tokens_grow_across_processes_reopening_the_file(sqlite_url: str) -> None:
    store = LeaseStore.from_url(sqlite_url)
    key = new_key()
    first = claim_ok(store, key, A)
    assert store.release(first)
    store.close()  # drops every connection; the file is all that is left

    # Another process opens the file and claims.
    out = subprocess.run(
        [PYTHON, CLIENT, "claim", sqlite_url, key, "--ttl", "0.3", "--owner", B],
        capture_output=True, text=True, env=client_env(), timeout=60, check=True,
    )  # fmt: skip
    second = json.loads(out.stdout)["lease"]
    assert second is not None and second["token"] > first.token

    reopened = LeaseStore.from_url(sqlite_url)
    assert reopened.fence_token(key) == second["token"]
    assert is_free(wait_until_expired(reopened, key, second["expires_at"]))
    assert claim_ok(reopened, key, C).token > second["token"]
    reopened.close()
