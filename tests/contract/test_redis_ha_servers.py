"""The Sentinel and Cluster deployments of tests/redis_ha.py do what the store tests need.

Real servers on loopback ports: a write reaches the replicas, a SIGKILLed
master is replaced by one of its replicas (proven from the sentinels' and the
cluster's own view), and the promoted node serves the data that had been
replicated before the crash.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis
from redis.sentinel import Sentinel

from tests.redis_ha import ClusterDeployment, SentinelDeployment
from tests.servers import LOOPBACK

pytestmark = pytest.mark.timeout(180)

D = TypeVar("D", SentinelDeployment, ClusterDeployment)


@pytest.fixture
def sentinel_deployment(tmp_path: Path) -> Iterator[SentinelDeployment]:
    yield from _running(SentinelDeployment(tmp_path))


@pytest.fixture
def cluster_deployment(tmp_path: Path) -> Iterator[ClusterDeployment]:
    yield from _running(ClusterDeployment(tmp_path))


def _running(deployment: D) -> Iterator[D]:
    try:
        yield deployment.start()
    finally:
        deployment.stop()


def test_a_sentinel_deployment_promotes_a_replica_when_its_master_is_killed(
    sentinel_deployment: SentinelDeployment,
) -> None:
    d = sentinel_deployment
    assert d.url(1).count("sentinel://") == 3 and d.url(1).endswith("/1")
    sentinel = Sentinel(d.sentinel_addresses, socket_timeout=2.0)
    master = sentinel.master_for(d.master_name, socket_timeout=2.0)
    master.set("before", "crash")
    # Both replicas acknowledged the write before the crash.
    assert master.execute_command("WAIT", 2, 5000) == 2

    old = d.kill_master()
    assert not old.running
    new = d.wait_failover(old)

    assert new is not old and new in d.nodes[1:], "a former replica is master"
    assert sentinel.discover_master(d.master_name) == (LOOPBACK, new.port)
    # master_for follows the sentinels to the new master
    assert master.get("before") == b"crash"


def test_a_cluster_promotes_the_replica_of_a_killed_master(
    cluster_deployment: ClusterDeployment,
) -> None:
    d = cluster_deployment
    assert len(d.masters()) == 3
    with d.client(socket_timeout=2.0) as c:
        c.set("{k}before", "crash")
        served_by = d.master_of("{k}before")
        with redis.Redis(host=LOOPBACK, port=served_by.port) as direct:
            assert direct.execute_command("WAIT", 1, 5000) == 1

    old, replicas = d.kill_master("{k}before")
    assert len(replicas) == 1 and not old.running
    new = d.wait_failover(old, replicas)

    assert new.port == replicas[0]
    assert new.port in d.masters() and old.port not in d.masters()
    with d.client(socket_timeout=2.0) as c:
        assert c.get("{k}before") == b"crash"
