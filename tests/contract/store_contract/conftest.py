"""The lease-store contract (celery_lease/stores/base.py), proved on real servers:
the fixtures every module of this package shares.

One suite, parametrized over the four stores: Redis (the session's private
server, and Redis as run past one server: the session's Sentinel deployment,
with and without ``wait_replicas``, and its Cluster, tests/redis_ha.py),
PostgreSQL (the session's private cluster, a database per module),
SQLite (a file under the test's tmp_path) and etcd (the session's private
3-member cluster, tests/etcd_cluster.py); and over celery_lease.testing's
in-memory store (its real-time clock), which users' unit tests stand on and
so must keep the same contract (what it passes proves nothing about the
others). No mocks: every claim, renewal
and release goes through the real driver to the real server, and every
expiry is decided by the store's own clock.

etcd reports a lease's remaining time in whole seconds and frees expired keys
from a 500 ms loop: a store declares these as ``expiry_resolution`` (how far
a record's expiry may be from the grant's) and ``expiry_lag`` (how long after
``expires_at`` a key may still be held); the assertions allow exactly that.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_lease import LeaseStore
from tests.etcd_cluster import etcd_cluster, etcd_url  # noqa: F401 - fixtures
from tests.store_fixtures import CONTRACT_STORE_KINDS, open_store, store_url


@pytest.fixture(params=CONTRACT_STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(request: pytest.FixtureRequest, store_kind: str) -> Iterator[LeaseStore]:
    s = open_store(store_url(request, store_kind), store_kind)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def other_store(store: LeaseStore, store_kind: str) -> Iterator[LeaseStore]:
    """A second handle on the same store, as another process would have."""
    s = open_store(store.url, store_kind)
    try:
        yield s
    finally:
        s.close()
