"""The Redis script transport (celery_lease.stores.redis_transport) on a real Redis.

The transport uses redis-py below its public command API (kept connections,
``pack_command``/``read_response``, ``get_connection``'s signature), so these
tests also pin the redis-py versions it was checked with: a redis-py that
setup.cfg allows but the transport was not run against fails here first.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from packaging.requirements import Requirement
from packaging.version import Version

from celery_lease.stores.redis import SOCKET_READ_SIZE, RedisLeaseStore
from celery_lease.stores.redis_transport import REDIS_PY_CHECKED
from tests.servers import RedisServer, wait_for

MakeRedis = Callable[..., RedisServer]
ROOT = Path(__file__).resolve().parents[2]
NAME = "transport-under-test"


def _allowed_redis_py() -> Requirement:
    """setup.cfg's requirement on redis-py (the ``redis`` extra)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options.extras_require"]["redis"].split()
    return Requirement(next(line for line in lines if line.startswith("redis")))


def test_the_installed_redis_py_is_one_the_transport_was_checked_with() -> None:
    allowed = _allowed_redis_py().specifier
    checked = Requirement(f"redis{REDIS_PY_CHECKED}").specifier
    installed = Version(redis.__version__)
    assert installed in allowed, f"redis-py {installed} is outside setup.cfg's {allowed}"
    assert installed in checked, (
        f"redis-py {installed} is outside REDIS_PY_CHECKED ({checked}): run this file, "
        "check the connection internals redis_transport.py uses, then widen it"
    )
    # The oldest redis-py a user may install is one the transport was checked with.
    lowest = min(Version(s.version) for s in allowed if s.operator in (">=", "=="))
    assert lowest in checked, f"setup.cfg allows redis-py {lowest}, not in {checked}"


@pytest.fixture
def server(make_redis_server: MakeRedis) -> RedisServer:
    return make_redis_server(appendonly=False)


@pytest.fixture
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url())
    yield client
    client.close()


@pytest.fixture
def store(server: RedisServer) -> Iterator[RedisLeaseStore]:
    s = RedisLeaseStore(server.url(), client_name=NAME)
    yield s
    s.close()


def _store_connections(admin: redis.Redis) -> list[dict[str, Any]]:
    return [c for c in admin.client_list() if c.get("name") == NAME]


def _calls(admin: redis.Redis, command: str) -> int:
    return int(admin.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_scripts_go_by_evalsha_on_one_kept_connection(
    store: RedisLeaseStore, admin: redis.Redis
) -> None:
    assert store.transport.direct  # no client-side cache: the transport's own path

    def one_of_each() -> None:
        lease = store.claim("k", ttl=30)
        assert lease is not None
        assert store.renew(lease)
        assert store.inspect("k") is not None
        assert store.release(lease)

    one_of_each()  # a new server: each script's first EVALSHA is NOSCRIPT, then EVAL
    admin.config_resetstat()
    one_of_each()
    assert _calls(admin, "evalsha") == 4
    assert _calls(admin, "eval") == 0
    conns = _store_connections(admin)
    assert len(conns) == 1, conns  # one connection, kept between the calls
    assert conns[0]["cmd"] == "evalsha"


def test_a_flushed_script_cache_is_answered_by_eval(
    store: RedisLeaseStore, admin: redis.Redis
) -> None:
    lease = store.claim("k", ttl=30)
    assert lease is not None
    admin.script_flush()
    assert admin.script_exists(store._renew.sha) == [False]  # the fault: NOSCRIPT next
    admin.config_resetstat()
    assert store.renew(lease)
    assert _calls(admin, "eval") == 1  # the NOSCRIPT reply was answered by EVAL...
    assert admin.script_exists(store._renew.sha) == [True]  # ...which cached the script
    assert store.renew(lease)
    assert _calls(admin, "eval") == 1  # and the next call is EVALSHA again
    assert _calls(admin, "evalsha") == 2


def test_a_kept_connection_the_server_closed_is_replaced(
    store: RedisLeaseStore, admin: redis.Redis
) -> None:
    lease = store.claim("k", ttl=30)
    assert lease is not None
    (kept,) = _store_connections(admin)
    assert admin.client_kill_filter(_id=kept["id"]) == 1
    wait_for(lambda: not _store_connections(admin), 10, "the server to close the kept connection")
    assert store.renew(lease)  # sent once more, on a new connection
    (new,) = _store_connections(admin)
    assert new["id"] != kept["id"]
    record = store.inspect("k")
    assert record is not None and record.owner_id == lease.owner_id


@pytest.mark.parametrize("closed_by", ["client-kill", "idle-timeout"])
@pytest.mark.parametrize("pending", [False, True], ids=["replies-read", "reply-pending"])
def test_a_late_release_on_a_kept_connection_the_server_closed_is_done_at_once(
    store: RedisLeaseStore, admin: redis.Redis, closed_by: str, pending: bool
) -> None:
    """The server closes the store's idle kept connection (CLIENT KILL, its
    ``timeout`` setting; a proxy's idle timeout or a restart alike), then a
    task's release goes without waiting: the key is free at once, with no
    further store call (an idle worker makes none for as long as it idles)."""
    first = store.claim("first", owner_id="a", ttl=30)
    second = store.claim("second", owner_id="a", ttl=30)
    assert first is not None and second is not None
    failures: list[BaseException] = []
    if pending:  # the previous task's release, its reply still unread
        store.release_later(first, failures.append)
    (kept,) = _store_connections(admin)
    if closed_by == "client-kill":
        assert admin.client_kill_filter(_id=kept["id"]) == 1
    else:
        admin.config_set("timeout", 1)
    wait_for(lambda: not _store_connections(admin), 10, "the server to close the kept connection")
    admin.config_set("timeout", 0)
    store.release_later(second, failures.append)
    wait_for(
        lambda: admin.hget(store.lease_name("second"), "released") == b"1",
        2,
        "the late release to be done on the server",
    )
    if pending:
        assert admin.hget(store.lease_name("first"), "released") == b"1"
    assert failures == []


def test_a_late_release_frees_the_key_before_its_reply_is_read(
    store: RedisLeaseStore, server: RedisServer
) -> None:
    """release_later: the key is free as promptly as with release (another
    client's claim, sent after it returned, is granted at once), its reply is
    read at the store's next call."""
    other = RedisLeaseStore(server.url())
    failures: list[BaseException] = []
    try:
        for i in range(50):
            lease = store.claim(f"k{i}", owner_id="a", ttl=30)
            assert lease is not None
            store.release_later(lease, failures.append)
            assert store.transport.unread == 1  # not waited for
            taken = other.claim(f"k{i}", owner_id="b", ttl=30)
            assert taken is not None and taken.token > lease.token, i
        assert store.time() > 0  # the next call reads the reply
        assert store.transport.unread == 0
        assert failures == []
    finally:
        other.close()


def test_an_error_reply_to_a_late_release_reaches_its_handler_at_the_next_call(
    store: RedisLeaseStore, admin: redis.Redis
) -> None:
    lease = store.claim("k", owner_id="a", ttl=30)
    assert lease is not None
    admin.delete(store.lease_name("k"))
    admin.set(store.lease_name("k"), "not a hash")  # the release's HMGET: WRONGTYPE
    failures: list[BaseException] = []
    store.release_later(lease, failures.append)
    assert failures == []  # not read yet
    assert store.claim("other", owner_id="a", ttl=30) is not None  # the next call answers
    assert len(failures) == 1 and "WRONGTYPE" in str(failures[0]), failures
    assert store.transport.unread == 0


def test_close_reads_the_late_replies(store: RedisLeaseStore, admin: redis.Redis) -> None:
    lease = store.claim("k", owner_id="a", ttl=30)
    assert lease is not None
    failures: list[BaseException] = []
    store.release_later(lease, failures.append)
    store.close()
    assert store.transport.unread == 0 and failures == []
    assert admin.hget(store.lease_name("k"), "released") == b"1"


def test_a_forked_child_does_not_use_the_parents_kept_connection(
    store: RedisLeaseStore,
) -> None:
    lease = store.claim("k", owner_id="a", ttl=30)
    assert lease is not None
    failures: list[BaseException] = []
    store.release_later(lease, failures.append)  # a reply left unread on the parent's connection
    assert store.transport.unread == 1
    parent_id = store.transport.execute((b"CLIENT", b"ID"))
    store.release_later(lease, failures.append)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the connection it used, never run pytest's teardown
        code = 1
        try:
            os.write(write, str(store.transport.execute((b"CLIENT", b"ID"))).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        child_id = int(f.read() or "-1")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child_id not in (-1, parent_id)
    # The parent's kept connection is intact: nothing of the child's reply was left on it.
    assert store.transport.execute((b"CLIENT", b"ID")) == parent_id
    assert store.transport.unread == 0 and failures == []  # the parent read its late reply


def test_with_a_client_side_cache_scripts_go_through_redis_py(
    server: RedisServer, admin: redis.Redis
) -> None:
    cache = pytest.importorskip("redis.cache")
    version = str(admin.info("server")["redis_version"])
    if Version(version) < Version("7.4"):
        pytest.skip(f"redis-py's client-side cache needs Redis 7.4 or later (server: {version})")
    store = RedisLeaseStore(server.url(), protocol=3, cache_config=cache.CacheConfig())
    try:
        assert not store.transport.direct
        lease = store.claim("k", ttl=30)
        assert lease is not None
        assert store.renew(lease)
        assert store.fence_token("k") == lease.token
        assert store.time() > 0
        assert store.release(lease)
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["redis", "sentinel", "cluster"])
def test_every_redis_store_reads_replies_in_small_chunks(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """The read size that keeps a worker's heap flat (client_defaults) reaches
    the connections of each Redis store: server, Sentinel master, every
    Cluster node. redis-py 5's cluster client has no such option."""
    from redis.cluster import REDIS_ALLOWED_KEYS

    from tests.store_fixtures import new_key, open_store, store_url

    store = open_store(store_url(request, kind), kind)
    assert isinstance(store, RedisLeaseStore)
    try:
        key = new_key("read-size")
        lease = store.claim(key, ttl=5.0)  # connects
        assert lease is not None
        if kind == "cluster":
            pools = [n.redis_connection.connection_pool for n in store.client.get_nodes()]
            expected = SOCKET_READ_SIZE if "socket_read_size" in REDIS_ALLOWED_KEYS else None
        else:
            pools = [store.client.connection_pool]
            expected = SOCKET_READ_SIZE
        assert pools
        for pool in pools:
            assert pool.connection_kwargs.get("socket_read_size") == expected
        store.release(lease)
    finally:
        store.close()
