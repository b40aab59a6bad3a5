"""The opt-in replication wait (``wait_replicas``) on a real master and replica.

A private master and one replica (``--replicaof``). With the replica linked,
a grant under ``wait_replicas=1`` is on the replica when the claim returns.
With the replica paused (SIGSTOP, proven from its process state) nothing
acknowledges the writes: WAIT answers 0 after ``wait_timeout_ms``, and

* ``on_unreplicated="release"`` (the default): the claim raises
  StoreUnavailable and the key is left free on the master; a renewal raises
  it too (the renewer retries it within the lease's local validity);
* ``on_unreplicated="warn"``: the grant stands and a warning is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from celery_lease import LeaseStore, StoreUnavailable
from tests.servers import LOOPBACK, RedisServer, wait_for
from tests.store_fixtures import new_key

pytestmark = pytest.mark.timeout(60)

A = "owner-A:1:aaaa"
MakeRedis = Callable[..., RedisServer]


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def pair(make_redis_server: MakeRedis) -> Iterator[tuple[RedisServer, RedisServer]]:
    # No diskless-sync delay (5 s by default): the replica links at once.
    master = make_redis_server(appendonly=False, extra_args=["--repl-diskless-sync-delay", "0"])
    replica = make_redis_server(
        appendonly=False, extra_args=["--replicaof", LOOPBACK, str(master.port)]
    )
    with redis.Redis(host=LOOPBACK, port=replica.port) as r:
        wait_for(
            lambda: r.info("replication").get("master_link_status") == "up", 20, "replica linked"
        )
    yield master, replica


@pytest.fixture
def paused(pair: tuple[RedisServer, RedisServer]) -> Iterator[RedisServer]:
    master, replica = pair
    replica.pause()
    assert replica.pid is not None
    wait_for(lambda: _state(replica.pid) == "T", 10, "the replica stopped")  # type: ignore[arg-type]
    try:
        yield master
    finally:
        replica.resume()


def test_a_waited_grant_is_on_the_replica_when_the_claim_returns(
    pair: tuple[RedisServer, RedisServer],
) -> None:
    master, replica = pair
    store = LeaseStore.from_url(master.url(0), wait_replicas=1, wait_timeout_ms=5000)
    with redis.Redis(host=LOOPBACK, port=replica.port) as r:
        for _ in range(20):
            lease = store.claim(new_key("w"), owner_id=A, ttl=30)
            assert lease is not None
            name = store.lease_name(lease.key)  # type: ignore[attr-defined]
            assert r.hget(name, "token") == str(lease.token).encode()
            assert store.renew(lease) is True
    store.close()


def test_an_unreplicated_grant_is_released_and_refused(paused: RedisServer) -> None:
    store = LeaseStore.from_url(paused.url(0), wait_replicas=1, wait_timeout_ms=50)
    key = new_key("unrepl")
    with pytest.raises(StoreUnavailable, match="reached 0 of 1 replicas within 50 ms"):
        store.claim(key, owner_id=A, ttl=30)
    record = store.inspect(key)
    assert record is not None and not record.live, "the grant was given back"
    assert record.token > 0, "the fence keeps the token: a later grant outranks it"
    store.close()


def test_an_unreplicated_renewal_raises_store_unavailable(
    pair: tuple[RedisServer, RedisServer],
) -> None:
    """The renewer retries a StoreUnavailable renewal within the lease's local
    validity (celery_lease.renewal): the holder's view is not extended past what
    the replicas were told, and the lease is lost if they never answer."""
    master, replica = pair
    # The linked replica's acknowledgement is waited for with a patient store: on a
    # loaded machine it can take longer than the 50 ms the paused case waits.
    patient = LeaseStore.from_url(master.url(0), wait_replicas=1, wait_timeout_ms=5000)
    hasty = LeaseStore.from_url(master.url(0), wait_replicas=1, wait_timeout_ms=50)
    lease = patient.claim(new_key("renew"), owner_id=A, ttl=30)
    assert lease is not None
    replica.pause()
    try:
        wait_for(lambda: _state(replica.pid) == "T", 10, "the replica stopped")  # type: ignore[arg-type]
        with pytest.raises(StoreUnavailable, match="renewal of 1 lease"):
            hasty.renew(lease, ttl=60)
    finally:
        replica.resume()
    assert patient.renew(lease, ttl=60) is True, "renewed once the replica answers again"
    patient.close()
    hasty.close()


def test_warn_keeps_an_unreplicated_grant_and_logs_it(
    paused: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    store = LeaseStore.from_url(
        paused.url(0), wait_replicas=1, wait_timeout_ms=50, on_unreplicated="warn"
    )
    key = new_key("warned")
    with caplog.at_level(logging.WARNING, logger="celery_lease.stores.redis_wait"):
        lease = store.claim(key, owner_id=A, ttl=30)
    assert lease is not None
    record = store.inspect(key)
    assert record is not None and record.live and record.owner_id == A
    (warning,) = [r for r in caplog.records if getattr(r, "action", "") == "unreplicated"]
    assert "reached 0 of 1 replicas" in warning.getMessage() and "kept" in warning.getMessage()
    store.close()
