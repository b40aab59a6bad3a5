"""Store error replies, provoked on real servers, read as the stores' mapping tables.

* Redis: every reply that means "not now" (OOM, MISCONF, LOADING, READONLY,
  BUSY, MASTERDOWN, NOREPLICAS, TRYAGAIN, CLUSTERDOWN) makes each operation
  the server refuses raise :class:`StoreUnavailable` (retryable) naming the
  code and the reason; a genuine error (WRONGTYPE, an error raised in our own
  Lua) is a permanent :class:`LeaseError`. Each row first proves the server
  answers that code to a plain command.
* PostgreSQL: a read-only session (SQLSTATE 25006: a standby, or
  ``default_transaction_read_only``) and a server out of connection slots
  are :class:`StoreUnavailable` too.
* The renewal thread survives an error reply: with Redis in OOM (or answering
  WRONGTYPE for a lease) the same thread goes on renewing once the server
  accepts writes again, and a failing ``on_lost`` callback does not stop the
  renewal of the process's other leases.
"""

from __future__ import annotations

import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import redis

import celery_lease
from celery_lease import LeaseError, StoreUnavailable
from celery_lease.renewal import HeldLease, renewer
from celery_lease.stores.base import Lease
from celery_lease.stores.redis import RedisLeaseStore
from celery_lease.stores.sql import SQLLeaseStore
from tests.servers import LOOPBACK, PostgresServer, RedisServer, wait_for

pytestmark = pytest.mark.timeout(180)

MakeRedis = Callable[..., RedisServer]


@dataclass
class Faulty:
    """A store whose server answers an error reply, and a lease it holds."""

    server: RedisServer
    store: RedisLeaseStore
    held: Lease
    probe: tuple[str, ...]  # a plain command the server must refuse with the code
    #: A key the claim tries: a free one, unless the fault is about ``held``'s slot.
    claim_key: str = "free"


def _store_with_lease(server: RedisServer) -> tuple[RedisLeaseStore, Lease]:
    store = RedisLeaseStore(server.url())
    lease = store.claim("held", ttl=120)
    assert lease is not None
    return store, lease


def _errorstat(server: RedisServer, code: str) -> int:
    """Error replies with ``code`` the server has sent (INFO errorstats)."""
    client = redis.Redis.from_url(server.url())
    try:
        stats = client.info("errorstats").get(f"errorstat_{code}", {})
    finally:
        client.close()
    return int(stats.get("count", 0)) if isinstance(stats, dict) else 0


def _fill_past_maxmemory(client: redis.Redis) -> None:
    """Data past maxmemory, nothing evictable: every write is answered OOM."""
    client.config_set("maxmemory-policy", "noeviction")
    client.execute_command("DEBUG", "POPULATE", 20000, "fill", 100)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used // 2)


@contextmanager
def oom(make: MakeRedis) -> Iterator[Faulty]:
    server = make(appendonly=False)
    store, held = _store_with_lease(server)
    _fill_past_maxmemory(redis.Redis.from_url(server.url()))
    yield Faulty(server, store, held, ("SET", "probe", "x"))


@contextmanager
def misconf(make: MakeRedis) -> Iterator[Faulty]:
    server = make(appendonly=False)
    store, held = _store_with_lease(server)
    client = redis.Redis.from_url(server.url())
    # The server's working directory is gone: its RDB save fails, and with
    # save points configured and stop-writes-on-bgsave-error it refuses writes.
    shutil.rmtree(server.data_dir)
    client.config_set("save", "3600 1")
    client.config_set("stop-writes-on-bgsave-error", "yes")
    client.bgsave()
    wait_for(
        lambda: client.info("persistence")["rdb_last_bgsave_status"] == "err",
        30,
        "the failed BGSAVE",
    )
    yield Faulty(server, store, held, ("SET", "probe", "x"))


@contextmanager
def loading(make: MakeRedis) -> Iterator[Faulty]:
    server = make(appendonly=False)
    store, held = _store_with_lease(server)
    client = redis.Redis.from_url(server.url())
    client.execute_command("DEBUG", "POPULATE", 50000, "fill", 10)
    # Loading each key takes 1 ms (a debug setting): the reload lasts ~50 s,
    # and the server answers LOADING between keys meanwhile.
    client.config_set("key-load-delay", 1000)
    client.config_set("loading-process-events-interval-bytes", 1024)
    reloader = socket.create_connection((LOOPBACK, server.port))
    reloader.sendall(b"*2\r\n$5\r\nDEBUG\r\n$6\r\nRELOAD\r\n")  # its reply is never read
    try:
        wait_for(lambda: server.command("GET", "probe").startswith(b"-LOADING"), 30, "the reload")
        yield Faulty(server, store, held, ("GET", "probe"))
    finally:
        reloader.close()


@contextmanager
def readonly(make: MakeRedis) -> Iterator[Faulty]:
    primary = make(appendonly=False)
    replica = make(appendonly=False)
    _, held = _store_with_lease(primary)
    client = redis.Redis.from_url(replica.url())
    client.replicaof(LOOPBACK, primary.port)
    wait_for(lambda: client.info("replication")["master_link_status"] == "up", 30, "replication")
    # A client that reaches the replica (a failover moved the primary): the
    # lease is there, writes are refused.
    store = RedisLeaseStore(replica.url())
    assert store.inspect("held") is not None
    yield Faulty(replica, store, held, ("SET", "probe", "x"))


@contextmanager
def masterdown(make: MakeRedis) -> Iterator[Faulty]:
    primary = make(appendonly=False)
    replica = make(appendonly=False)
    _, held = _store_with_lease(primary)
    client = redis.Redis.from_url(replica.url())
    client.config_set("replica-serve-stale-data", "no")
    client.replicaof(LOOPBACK, primary.port)
    wait_for(lambda: client.info("replication")["master_link_status"] == "up", 30, "replication")
    primary.kill()
    wait_for(
        lambda: client.info("replication")["master_link_status"] == "down", 30, "the link down"
    )
    yield Faulty(replica, RedisLeaseStore(replica.url()), held, ("GET", "probe"))


@contextmanager
def busy(make: MakeRedis) -> Iterator[Faulty]:
    server = make(appendonly=False)
    store, held = _store_with_lease(server)
    client = redis.Redis.from_url(server.url())
    client.config_set("busy-reply-threshold", 100)
    looper = socket.create_connection((LOOPBACK, server.port))
    script = b"while true do end"
    looper.sendall(b"*3\r\n$4\r\nEVAL\r\n$%d\r\n%s\r\n$1\r\n0\r\n" % (len(script), script))
    try:
        wait_for(lambda: server.command("PING").startswith(b"-BUSY"), 30, "the busy script")
        yield Faulty(server, store, held, ("PING",))
    finally:
        server.command("SCRIPT", "KILL")
        looper.close()


@contextmanager
def noreplicas(make: MakeRedis) -> Iterator[Faulty]:
    server = make(appendonly=False)
    store, held = _store_with_lease(server)
    redis.Redis.from_url(server.url()).config_set("min-replicas-to-write", 1)
    yield Faulty(server, store, held, ("SET", "probe", "x"))


@contextmanager
def clusterdown(make: MakeRedis) -> Iterator[Faulty]:
    node = make(appendonly=False, extra_args=["--cluster-enabled", "yes"])
    client = redis.Redis.from_url(node.url())
    client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    wait_for(lambda: b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO"), 30, "ok")
    store, held = _store_with_lease(node)
    # The lease's slot is served by nobody any more.
    client.execute_command(
        "CLUSTER", "DELSLOTS", client.execute_command("CLUSTER", "KEYSLOT", "held")
    )
    yield Faulty(node, store, held, ("GET", store.lease_name("held")), claim_key="held")


@contextmanager
def tryagain(make: MakeRedis) -> Iterator[Faulty]:
    node = make(appendonly=False, extra_args=["--cluster-enabled", "yes"])
    other = make(appendonly=False, extra_args=["--cluster-enabled", "yes"])
    client = redis.Redis.from_url(node.url())
    client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    wait_for(lambda: b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO"), 30, "ok")
    store, held = _store_with_lease(node)
    other_client = redis.Redis.from_url(other.url())
    other_id = other_client.execute_command("CLUSTER", "MYID")
    other_client.execute_command("CLUSTER", "MEET", LOOPBACK, node.port)
    wait_for(lambda: other_id in client.execute_command("CLUSTER", "NODES"), 30, "the meet")
    # The slot of "held" migrates; its lease hash is gone, its fence counter is
    # not: a command on both keys meets the slot half moved.
    client.execute_command(
        "CLUSTER", "SETSLOT", client.execute_command("CLUSTER", "KEYSLOT", "held"), "MIGRATING",
        other_id,
    )  # fmt: skip
    client.delete(store.lease_name("held"))
    probe = ("MGET", store.lease_name("held"), store.fence_name("held"))
    yield Faulty(node, store, held, probe, claim_key="held")


OPS: dict[str, Callable[[Faulty], Any]] = {
    "claim": lambda f: f.store.claim(f.claim_key, ttl=30, owner_id="another-owner"),
    "renew": lambda f: f.store.renew_many([f.held]),
    "release": lambda f: f.store.release(f.held),
    "inspect": lambda f: f.store.inspect("held"),
}
WRITES = ("claim", "renew", "release")
ALL = (*WRITES, "inspect")


@dataclass
class Row:
    code: str
    provoke: Callable[[MakeRedis], Any]
    refused: tuple[str, ...]  # the operations the server refuses in that state
    why: str  # what the error's message must say besides the code


#: The Redis mapping table, as the server behaves (Redis 7.0).
REDIS_TRANSIENT = [
    Row("OOM", oom, WRITES, r"out of memory"),
    Row("MISCONF", misconf, WRITES, r"RDB save failed"),
    Row("LOADING", loading, ALL, r"loading its dataset"),
    Row("READONLY", readonly, WRITES, r"read-only replica"),
    Row("MASTERDOWN", masterdown, ALL, r"lost its primary"),
    Row("BUSY", busy, ALL, r"busy running a script"),
    Row("NOREPLICAS", noreplicas, WRITES, r"too few replicas"),
    Row("CLUSTERDOWN", clusterdown, ALL, r"does not serve the key's slot"),
    # claim and inspect read the lease hash and the fence counter together
    Row("TRYAGAIN", tryagain, ("claim", "inspect"), r"slot is being migrated"),
]


@pytest.mark.parametrize("row", REDIS_TRANSIENT, ids=lambda r: r.code)
def test_redis_transient_reply_is_store_unavailable(row: Row, make_redis_server: MakeRedis) -> None:
    with row.provoke(make_redis_server) as faulty:
        reply = faulty.server.command(*faulty.probe)
        assert reply.startswith(f"-{row.code} ".encode()), reply  # the fault is there
        for op in row.refused:
            with pytest.raises(StoreUnavailable) as info:
                OPS[op](faulty)
            message = str(info.value)
            print(f"{row.code} {op}: {message[:160]}")
            assert row.code in message, (op, message)
            assert re.search(row.why, message), (op, message)


def test_redis_genuine_errors_are_permanent(make_redis_server: MakeRedis) -> None:
    # WRONGTYPE: the lease key holds something else than a lease
    server = make_redis_server(appendonly=False)
    store, held = _store_with_lease(server)
    server.command("DEL", store.lease_name("held"))
    server.command("SET", store.lease_name("held"), "not a hash")
    assert server.command("HGET", store.lease_name("held"), "owner").startswith(b"-WRONGTYPE")
    faulty = Faulty(server, store, held, (), claim_key="held")
    for op in ALL:
        with pytest.raises(LeaseError, match="WRONGTYPE") as info:
            OPS[op](faulty)
        assert not isinstance(info.value, StoreUnavailable), op
    # an error raised in our own Lua: a fence counter that is not a number
    server = make_redis_server(appendonly=False)
    store = RedisLeaseStore(server.url())
    server.command("SET", store.fence_name("k"), "not a number")
    with pytest.raises(LeaseError, match="user_script") as info:
        store.claim("k", ttl=30)
    assert not isinstance(info.value, StoreUnavailable)


# --------------------------------------------------------------------------
# PostgreSQL
# --------------------------------------------------------------------------


@pytest.fixture
def pg(make_pg_server: Callable[..., PostgresServer]) -> PostgresServer:
    return make_pg_server(settings={"max_connections": 12, "superuser_reserved_connections": 0})


def _pg_store(pg: PostgresServer, name: str) -> tuple[SQLLeaseStore, Lease]:
    url = pg.create_database(name)
    celery_lease.migrate(url)
    store = SQLLeaseStore(url)
    held = store.claim("held", ttl=120)
    assert held is not None
    return store, held


def _disconnect(pg: PostgresServer, name: str) -> None:
    """End the sessions of ``name`` (the store's kept connections reconnect)."""
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )


SQL_OPS: dict[str, Callable[[SQLLeaseStore, Lease], Any]] = {
    "claim": lambda s, h: s.claim("k", ttl=30),
    "claim several": lambda s, h: s.claim(["k1", "k2"], ttl=30),
    "renew": lambda s, h: s.renew_many([h]),
    "release": lambda s, h: s.release(h),
    "inspect": lambda s, h: s.inspect("held"),
}


def test_pg_read_only_session_is_store_unavailable(pg: PostgresServer) -> None:
    store, held = _pg_store(pg, "ro_db")
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute("ALTER DATABASE ro_db SET default_transaction_read_only = on")
    _disconnect(pg, "ro_db")
    with psycopg.connect(pg.dsn("ro_db"), autocommit=True) as conn:  # the fault is there
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("CREATE TABLE probe (x int)")
    for op in ("claim", "claim several", "renew", "release"):
        with pytest.raises(StoreUnavailable) as info:
            SQL_OPS[op](store, held)
        message = str(info.value)
        print(f"25006 {op}: {message[:160]}")
        assert "read-only" in message and "25006" in message, (op, message)
    assert store.inspect("held") is not None  # reads are served


def test_pg_out_of_connections_is_store_unavailable(pg: PostgresServer) -> None:
    store, held = _pg_store(pg, "crowded")
    _disconnect(pg, "crowded")
    hogs: list[psycopg.Connection[Any]] = []
    try:
        with pytest.raises(psycopg.OperationalError, match="too many clients"):
            while True:  # take every slot (the fault is there once a connect fails)
                hogs.append(psycopg.connect(pg.dsn()))
        for op, run in SQL_OPS.items():
            with pytest.raises(StoreUnavailable, match="too many clients") as info:
                run(store, held)
            print(f"too many clients {op}: {str(info.value)[:160]}")
    finally:
        for conn in hogs:
            conn.close()


# --------------------------------------------------------------------------
# the renewal thread survives error replies
# --------------------------------------------------------------------------


def _hold(store: RedisLeaseStore, key: str, **kw: Any) -> HeldLease:
    sent = time.monotonic()
    lease = store.claim(key, ttl=10)
    assert lease is not None
    held = HeldLease(store, lease, renew_interval=1.0, sent_at=sent, **kw)
    renewer().add(held)
    return held


def _renewed_after(held: HeldLease, count: int, what: str) -> None:
    wait_for(lambda: held.renewals > count, 8, what)
    assert held.held


def test_renewer_thread_keeps_renewing_after_oom(make_redis_server: MakeRedis) -> None:
    server = make_redis_server(appendonly=False)
    store = RedisLeaseStore(server.url())
    client = redis.Redis.from_url(server.url())
    held = _hold(store, "oom")
    try:
        thread = renewer()._thread
        _renewed_after(held, 0, "a first renewal")
        _fill_past_maxmemory(client)
        assert server.command("SET", "probe", "x").startswith(b"-OOM ")
        seen = _errorstat(server, "OOM")
        # the renewal thread met the OOM (twice: it retried)
        wait_for(lambda: _errorstat(server, "OOM") >= seen + 2, 8, "renewals answered OOM")
        count = held.renewals
        client.config_set("maxmemory", 0)
        _renewed_after(held, count, "a renewal once the server accepts writes again")
        assert renewer()._thread is thread and thread is not None and thread.is_alive()
        record = store.inspect("oom")
        assert record is not None and record.owner_id == held.owner_id
    finally:
        held.release()
        client.close()


def test_renewer_thread_keeps_renewing_after_a_permanent_error(
    make_redis_server: MakeRedis,
) -> None:
    server = make_redis_server(appendonly=False)
    store = RedisLeaseStore(server.url())
    client = redis.Redis.from_url(server.url())
    held = _hold(store, "wrongtype")
    name = store.lease_name("wrongtype")
    try:
        thread = renewer()._thread
        _renewed_after(held, 0, "a first renewal")
        fields = client.hgetall(name)
        client.delete(name)
        client.set(name, "not a hash")
        wait_for(lambda: _errorstat(server, "WRONGTYPE") >= 2, 8, "renewals answered WRONGTYPE")
        count = held.renewals
        with client.pipeline() as pipe:  # the lease as it was
            pipe.delete(name).hset(name, mapping=fields).pexpire(name, 10_000).execute()
        _renewed_after(held, count, "a renewal once the lease is readable again")
        assert renewer()._thread is thread and thread is not None and thread.is_alive()
    finally:
        held.release()
        client.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failing_lost_callback_does_not_stop_the_renewals(
    make_redis_server: MakeRedis,
) -> None:
    server = make_redis_server(appendonly=False)
    store = RedisLeaseStore(server.url())
    called = threading.Event()

    def broken(lease: HeldLease, reason: str) -> None:
        called.set()
        raise RuntimeError("a bug in an on_lost callback")

    doomed = _hold(store, "doomed", on_lost=broken)
    other = _hold(store, "other")
    try:
        thread = renewer()._thread
        store.evict("doomed")  # its next renewal is refused: on_lost runs, and raises
        wait_for(called.is_set, 8, "the on_lost callback")
        count = other.renewals
        _renewed_after(other, count, "a renewal of the other lease after the callback failed")
        assert doomed.lost_reason is not None
        replacement = renewer()._thread
        assert replacement is not thread and replacement is not None and replacement.is_alive()
    finally:
        other.release()
