"""Every store operation with its server down: StoreUnavailable, and nothing else.

The server is stopped (its port refuses connections, proven first) and each
operation runs on two store objects: one that held connections when the
server went (a long-lived worker's) and one made afterwards, holding none (a
fresh pool child's: its first call must connect). ``release_later`` raises
nothing on either: a task's own release hands the error to its callback, now
or at the store's next call, and the task's outcome stands.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest

import celery_lease
from celery_lease import LeaseStore, StoreUnavailable
from celery_lease.stores.base import Lease
from tests.etcd_cluster import EtcdCluster, make_etcd_cluster  # noqa: F401 - fixture
from tests.servers import LOOPBACK, PostgresServer, RedisServer

pytestmark = pytest.mark.timeout(120)

OPS: dict[str, Callable[[LeaseStore, Lease], Any]] = {
    "claim": lambda s, h: s.claim("k", ttl=30),
    "claim several": lambda s, h: s.claim(["k1", "k2"], ttl=30),
    "renew": lambda s, h: s.renew(h),
    "renew_many": lambda s, h: s.renew_many([h]),
    "release": lambda s, h: s.release(h),
    "inspect": lambda s, h: s.inspect("held"),
    "fence_token": lambda s, h: s.fence_token("held"),
}


def _refused(port: int) -> bool:
    try:
        socket.create_connection((LOOPBACK, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.fixture(params=["redis", "postgresql", "etcd"])
def down(
    request: pytest.FixtureRequest,
    make_redis_server: Callable[..., RedisServer],
    make_pg_server: Callable[..., PostgresServer],
    make_etcd_cluster: Callable[..., EtcdCluster],  # noqa: F811 - the fixture
) -> tuple[str, LeaseStore, Lease]:
    """A store URL whose server is down, a store that used it before, a lease it held."""
    stop: Callable[[], None]
    if request.param == "redis":
        server = make_redis_server(appendonly=False)
        url, port, stop = server.url(0), server.port, server.stop
    elif request.param == "postgresql":
        pg_server = make_pg_server()
        url, port, stop = pg_server.create_database("down"), pg_server.port, pg_server.stop
        celery_lease.migrate(url)
    else:
        cluster = make_etcd_cluster(1)
        (member,) = cluster.members
        url, port, stop = cluster.url, member.client_port, member.kill
    warm = LeaseStore.from_url(url)
    held = warm.claim("held", owner_id="owner-A:1:aaaa", ttl=120)
    assert held is not None
    assert warm.inspect("held") is not None  # connections made and kept
    stop()
    assert _refused(port), "the server's port refuses connections"
    return url, warm, held


def test_every_operation_on_a_store_that_is_down_raises_store_unavailable(
    down: tuple[str, LeaseStore, Lease],
) -> None:
    url, warm, held = down
    wrong: dict[str, str] = {}
    for which in ("warm", "cold"):
        for op, call in OPS.items():
            store = warm if which == "warm" else LeaseStore.from_url(url)
            try:
                call(store, held)
            except StoreUnavailable:
                continue
            except BaseException as e:  # noqa: BLE001 - the wrong outcome is the finding
                wrong[f"{which} {op}"] = repr(e)
            else:
                wrong[f"{which} {op}"] = "returned"
    assert wrong == {}, wrong


@pytest.mark.parametrize("which", ["warm", "cold"])
def test_release_later_on_a_store_that_is_down_hands_the_error_over(
    down: tuple[str, LeaseStore, Lease], which: str
) -> None:
    url, warm, held = down
    store = warm if which == "warm" else LeaseStore.from_url(url)
    failures: list[BaseException] = []
    store.release_later(held, failures.append)  # raises nothing
    store.close()  # a reply left unread is read (and its failure handed over) here
    assert len(failures) == 1 and isinstance(failures[0], StoreUnavailable), failures
