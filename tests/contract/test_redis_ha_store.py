"""What the Sentinel and Cluster stores do when the deployment changes under them.

Real deployments (tests/redis_ha.py), private to each test that hurts them:

* Sentinel: after the master is SIGKILLed and a replica promoted (proven from
  the sentinels' view), the same store object reaches the new master, which
  has none of the scripts cached (proven with ``SCRIPT EXISTS``): NOSCRIPT is
  answered with EVAL, and a grant replicated before the crash is still held.
Two Sentinel cases take 11-13 s and run with ``--slow``: the operator's
failover and the lost grant.

* Sentinel: after an operator's ``SENTINEL FAILOVER`` the old master serves
  as a replica (proven from ``ROLE``); the store's kept connections to it are
  dropped or answered READONLY, and either way its next calls go to the new
  master.
* Sentinel: a grant the old master made and never replicated is lost in the
  failover (proven: the new master has no trace of it); the fenced result
  table refuses that owner's commit, before and after a new owner commits.
  With ``wait_replicas=1`` the same stranded master's grant is refused.
* Cluster: a master SIGKILLed, its replica promoted (proven from CLUSTER
  NODES), the store follows; keys on every master are listed, and renewed in
  one round trip per master (counted by a connection class that counts its
  writes); keys in different slots are refused in one claim.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis

from celery_lease import LeaseConfigError, LeaseStore, StaleFencingToken, StoreUnavailable
from celery_lease.results import ResultTable
from celery_lease.stores.redis import RedisLeaseStore
from celery_lease.stores.redis_scripts import CLAIM
from tests.redis_ha import SENTINEL_MASTER, ClusterDeployment, SentinelDeployment, _role
from tests.servers import LOOPBACK, RedisServer, wait_for
from tests.store_fixtures import new_key, tagged_keys

pytestmark = pytest.mark.timeout(120)

A = "owner-A:1:aaaa"
B = "owner-B:2:bbbb"


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[SentinelDeployment]:
    d = SentinelDeployment(tmp_path)
    try:
        yield d.start()
    finally:
        d.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterDeployment]:
    d = ClusterDeployment(tmp_path)
    try:
        yield d.start()
    finally:
        d.stop()


def sentinel_store(d: SentinelDeployment, **options: Any) -> RedisLeaseStore:
    store = LeaseStore.from_url(d.url(0), master_name=SENTINEL_MASTER, **options)
    assert isinstance(store, RedisLeaseStore)
    return store


def direct(server: RedisServer) -> redis.Redis:
    return redis.Redis(host=LOOPBACK, port=server.port, socket_timeout=5.0)


def claim_sha() -> str:
    return redis.Redis().register_script(CLAIM).sha


# --------------------------------------------------------------------------
# Sentinel
# --------------------------------------------------------------------------


def test_sentinel_store_follows_a_failover_and_reloads_its_scripts(
    sentinel: SentinelDeployment,
) -> None:
    store = sentinel_store(sentinel)
    key = new_key("kept")
    lease = store.claim(key, owner_id=A, ttl=60)
    assert lease is not None
    with direct(sentinel.master()) as m:
        assert m.execute_command("WAIT", 2, 5000) == 2, "the grant reached both replicas"

    old = sentinel.kill_master()
    new = sentinel.wait_failover(old)
    assert new in sentinel.nodes[1:] and not old.running
    with direct(new) as n:
        assert n.script_exists(claim_sha()) == [False], "the promoted replica has no scripts"

    # The replicated grant survived, and the same store object reaches the new master.
    record = wait_for(lambda: _or_none(store.inspect, key), 20, "the store on the new master")
    assert (record.owner_id, record.token) == (A, lease.token) and record.live
    assert store.claim(key, owner_id=B, ttl=60) is None
    assert store.renew(lease) is True
    other = store.claim(new_key("after"), owner_id=B, ttl=60)
    assert other is not None and other.token > lease.token
    with direct(new) as n:
        assert n.script_exists(claim_sha()) == [True], "NOSCRIPT was answered with EVAL"
        assert n.hget(store.lease_name(other.key), "owner") == B.encode()
    store.close()


def _or_none(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(...)``, or None while the store is unavailable (a failover in progress)."""
    try:
        return fn(*args, **kwargs)
    except StoreUnavailable:
        return None


@pytest.mark.slow  # about 11 s: the sentinels' failover and the demotion
def test_after_an_operators_failover_the_store_leaves_the_demoted_master(
    sentinel: SentinelDeployment,
) -> None:
    store = sentinel_store(sentinel)
    first = store.claim(new_key("before"), owner_id=A, ttl=60)
    assert first is not None
    old = sentinel.master()
    with redis.Redis(host=LOOPBACK, port=sentinel.sentinels[0].port) as s:
        s.execute_command("SENTINEL", "FAILOVER", SENTINEL_MASTER)
    new = sentinel.wait_failover(old)
    wait_for(lambda: _role(old.port) == "slave", 20, "the old master demoted to a replica")

    lease = wait_for(
        lambda: _or_none(store.claim, new_key("after"), owner_id=B, ttl=60), 20, "a grant"
    )
    with direct(new) as n, direct(old) as o:
        assert n.hget(store.lease_name(lease.key), "owner") == B.encode()
        assert o.execute_command("ROLE")[0] == b"slave"
    assert lease.token > first.token
    store.close()


def _claim_on_a_stranded_master(
    d: SentinelDeployment, store: LeaseStore, key: str
) -> tuple[RedisServer, RedisServer, Any]:
    """A's claim reaches the master while it is stopped; the sentinels promote a
    replica; the old master resumes and answers the claim before the sentinels
    demote it (they wait 8 s for that). Returns (old, new, the claim's answer or
    the exception it raised)."""
    assert store.inspect(key) is None  # the store's kept connection is to the master
    old = d.master()
    old.pause()
    answered: list[Any] = []

    def claim() -> None:
        try:
            answered.append(store.claim(key, owner_id=A, ttl=30))
        except StoreUnavailable as e:
            answered.append(e)

    claiming = threading.Thread(target=claim)
    claiming.start()
    new = d.wait_failover(old)
    old.resume()
    claiming.join(30)
    return old, new, answered[0]


@pytest.mark.slow  # about 13 s: the sentinels demote a returning master after 8 s
def test_a_grant_lost_in_a_failover_is_refused_by_the_fenced_table(
    sentinel: SentinelDeployment, tmp_path: Path
) -> None:
    """The stranded master grants A, and is demoted before anything replicates:
    A holds a grant the new master never saw, and B is granted the key too."""
    store_a = sentinel_store(sentinel, socket_timeout=30.0)
    store_b = sentinel_store(sentinel)
    table_a = ResultTable(f"sqlite:///{tmp_path / 'results.sqlite3'}", store_a)
    table_b = ResultTable(table_a.url, store_b)
    key = new_key("lost")
    old, new, lease_a = _claim_on_a_stranded_master(sentinel, store_a, key)
    assert lease_a is not None and not isinstance(lease_a, Exception), "the old master granted A"
    wait_for(lambda: _role(old.port) == "slave", 20, "the old master demoted to a replica")
    with direct(new) as n:
        assert n.exists(store_a.lease_name(key)) == 0, "the new master never saw A's grant"
    table_a.register(lease_a)

    # A's commit: its fence row holds A's token, but the new master does not know the lease.
    with pytest.raises(StaleFencingToken):
        table_a.commit(lease_a, {"by": "A"}, release=False)

    lease_b = store_b.claim(key, owner_id=B, ttl=30)
    assert lease_b is not None and lease_b.token > lease_a.token, "the TIME floor"
    table_b.register(lease_b)
    assert table_b.commit(lease_b, {"by": "B"}).token == lease_b.token
    with pytest.raises(StaleFencingToken):
        table_a.commit(lease_a, {"by": "A"})
    assert [(r.token, r.value) for r in table_b.history(key)] == [(lease_b.token, {"by": "B"})]
    store_a.close()
    store_b.close()


def test_with_wait_replicas_a_stranded_master_grants_nothing(sentinel: SentinelDeployment) -> None:
    """The same stranded master, with wait_replicas=1: its replicas follow the new
    master now, WAIT counts none, and the grant is given back and refused. One
    owner only: B, on the new master."""
    store_a = sentinel_store(sentinel, socket_timeout=30.0, wait_replicas=1, wait_timeout_ms=300)
    store_b = sentinel_store(sentinel)
    key = new_key("stranded")
    _, new, answer = _claim_on_a_stranded_master(sentinel, store_a, key)
    assert isinstance(answer, StoreUnavailable), f"the stranded master answered {answer!r}"
    assert "reached 0 of 1 replicas" in str(answer) and "released" in str(answer)
    with direct(new) as n:
        assert n.exists(store_a.lease_name(key)) == 0
    lease_b = store_b.claim(key, owner_id=B, ttl=30)
    assert lease_b is not None
    record = store_b.inspect(key)
    assert record is not None and (record.owner_id, record.token) == (B, lease_b.token)
    store_a.close()
    store_b.close()


# --------------------------------------------------------------------------
# Cluster
# --------------------------------------------------------------------------


def test_a_cluster_claim_of_keys_in_different_slots_is_refused_before_any_write(
    cluster_url: str,
) -> None:
    store = LeaseStore.from_url(cluster_url)
    keys = [new_key("x"), new_key("y")]
    with pytest.raises(LeaseConfigError, match="one hash slot"):
        store.claim(keys, owner_id=A, ttl=30)
    assert all(store.inspect(k) is None for k in keys), "nothing was written"
    lease = store.claim(tagged_keys("x", "y"), owner_id=A, ttl=30)
    assert lease is not None and store.release(lease) is True
    store.close()


class CountingConnection(redis.Connection):
    """A real connection that counts its writes to the server: one per round trip
    (a pipeline is written at once)."""

    writes: ClassVar[Counter[int]] = Counter()

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.writes[int(self.port)] += 1
        super().send_packed_command(command, check_health)


def test_cluster_list_and_renewal_visit_every_master_in_one_round_trip_each(
    redis_cluster: ClusterDeployment, cluster_url: str
) -> None:
    store = LeaseStore.from_url(cluster_url)
    cluster = store.client  # type: ignore[attr-defined]
    for node in cluster.get_primaries():  # every master's new connections count their writes
        pool = cluster.get_redis_connection(node).connection_pool
        pool.reset()
        pool.connection_class = CountingConnection
    prefix = new_key("spread")
    leases = [store.claim(f"{prefix}-{i}", owner_id=A, ttl=30) for i in range(24)]
    assert all(leases)
    masters = {redis_cluster.master_of("{" + lease.key + "}").port for lease in leases}  # type: ignore[union-attr]
    assert masters == set(redis_cluster.masters()), "the keys fall on every master"

    listed = store.list(prefix)
    assert sorted(r.key for r in listed) == sorted(lease.key for lease in leases)  # type: ignore[union-attr]
    # A node without RENEW cached costs two more round trips once (SCRIPT LOAD, again).
    store.renew_many(leases, ttl=60)  # type: ignore[arg-type]
    CountingConnection.writes.clear()
    answers = store.renew_many(leases, ttl=60)  # type: ignore[arg-type]
    assert dict(CountingConnection.writes) == {port: 1 for port in masters}, "one per master"
    assert all(a is not None and a > lease.expires_at for a, lease in zip(answers, leases))  # type: ignore[union-attr]
    assert store.evict(leases[0].key) is not None  # type: ignore[union-attr]
    assert store.renew_many(leases[:2], ttl=60)[0] is None  # type: ignore[arg-type]
    store.close()


def test_cluster_store_follows_a_failover_of_the_keys_master(cluster: ClusterDeployment) -> None:
    store = LeaseStore.from_url(cluster.url())
    key = new_key("moved")
    lease = store.claim(key, owner_id=A, ttl=60)
    assert lease is not None
    master = cluster.master_of("{" + key + "}")
    with direct(master) as m:
        assert m.execute_command("WAIT", 1, 5000) == 1, "the grant reached the replica"

    old, replicas = cluster.kill_master("{" + key + "}")
    new = cluster.wait_failover(old, replicas)
    assert new.port in replicas and not old.running
    with direct(new) as n:
        assert n.script_exists(claim_sha()) == [False], "the promoted replica has no scripts"

    record = wait_for(lambda: _or_none(store.inspect, key), 30, "the store on the new master")
    assert (record.owner_id, record.token) == (A, lease.token) and record.live
    assert store.claim(key, owner_id=B, ttl=60) is None
    assert store.renew(lease) is True
    assert store.release(lease) is True
    taken = store.claim(key, owner_id=B, ttl=60)
    assert taken is not None and taken.token > lease.token
    store.close()
