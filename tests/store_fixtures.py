"""Helpers shared by the lease-store suites (contract, restart, contention, skew).

Not fixtures themselves (conftest.py belongs to the server infrastructure):
each test module declares its own ``store`` fixture with :func:`store_url`.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import celery_lease
from celery_lease import LeaseRecord, LeaseStore
from tests.redis_ha import SENTINEL_MASTER
from tests.servers import wait_for

__all__ = [
    "ALL_STORE_KINDS",
    "CLIENT",
    "CONTRACT_STORE_KINDS",
    "HA_STORE_KINDS",
    "PYTHON",
    "STORE_KINDS",
    "client_env",
    "new_key",
    "open_store",
    "store_options",
    "store_url",
    "tagged_keys",
    "wait_for",
    "wait_until_expired",
]

#: Redis as run past one server (tests/redis_ha.py): Sentinel and Cluster, for the
#: contract suites; "sentinel-wait", the same Sentinel store with wait_replicas=2,
#: only with --slow (the default suite keeps to its time budget).
HA_STORE_KINDS = ("sentinel", pytest.param("sentinel-wait", marks=pytest.mark.slow), "cluster")

#: The three stores every suite runs against.
STORE_KINDS = ("redis", "postgres", "sqlite")
#: Those and etcd (a 3-member cluster), for the suites that import the
#: ``etcd_url`` fixture from ``tests/etcd_cluster.py`` (the store contract).
ALL_STORE_KINDS = (*STORE_KINDS, pytest.param("etcd", marks=pytest.mark.etcd))
#: Those and celery_lease.testing's in-memory store, for the contract suite: it
#: must keep the same contract as the real stores (that it does proves nothing
#: about them; it is there so users' unit tests see a store that behaves alike).
CONTRACT_STORE_KINDS = (*ALL_STORE_KINDS, "memory", *HA_STORE_KINDS)

#: The subprocess client (run as a script, so it needs no ``tests`` package).
CLIENT = str(Path(__file__).with_name("lease_client.py"))
PYTHON = sys.executable

_migrated: set[str] = set()


def store_url(request: pytest.FixtureRequest, kind: str) -> str:
    """A URL for a fresh (or at least migrated) store of ``kind`` for this test."""
    if kind == "redis":
        url: str = request.getfixturevalue("redis_url")
    elif kind == "postgres":
        url = request.getfixturevalue("pg_url")
        if url not in _migrated:
            celery_lease.migrate(url)
            _migrated.add(url)
    elif kind == "sqlite":
        url = request.getfixturevalue("sqlite_url")
    elif kind in ("sentinel", "sentinel-wait"):
        url = request.getfixturevalue("sentinel_url")
    elif kind == "cluster":
        url = request.getfixturevalue("cluster_url")
    elif kind == "etcd":
        url = request.getfixturevalue("etcd_url")
    elif kind == "memory":
        # A space of its own, real-time clock (time passes as on a server, so
        # wait_until_expired sleeps out a TTL as for the other stores).
        from celery_lease.testing import MemoryLeaseStore

        url = f"memory://contract-{uuid.uuid4().hex}"
        request.addfinalizer(MemoryLeaseStore(url).drop)
    else:  # pragma: no cover - a typo in a parametrization
        raise ValueError(kind)
    return url


def store_options(url: str, kind: str = "") -> dict[str, Any]:
    """``lease_store_options`` a test deployment needs beyond its URL."""
    options: dict[str, Any] = {}
    if url.startswith("sentinel://"):
        options["master_name"] = SENTINEL_MASTER
    if kind.endswith("-wait"):
        options.update(wait_replicas=2, wait_timeout_ms=2000)
    return options


def open_store(url: str, kind: str = "") -> LeaseStore:
    """``LeaseStore.from_url(url)`` with the options of :func:`store_options`."""
    return LeaseStore.from_url(url, **store_options(url, kind))


def new_key(prefix: str = "k") -> str:
    """A key no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def tagged_keys(*names: str) -> list[str]:
    """Fresh keys sharing one Redis Cluster hash slot (``{tag}:name-...``), as a
    multi-key claim on a Cluster needs; on every other store, just keys."""
    tag = uuid.uuid4().hex[:8]
    return [f"{{{tag}}}:{name}-{uuid.uuid4().hex[:8]}" for name in names]


def wait_until_expired(
    store: LeaseStore, key: str, expires_at: float, timeout: float = 10.0
) -> LeaseRecord | None:
    """Let a lease lapse in *store* time, then return the key's record.

    Sleeps the remaining store time (the one place a sleep is the point),
    then polls the store clock until it is past ``expires_at``; the caller
    still asserts what ``inspect`` says.

    A store that frees keys some time after their expiry (etcd: the leader
    revokes expired leases from a 500 ms loop) declares that bound as
    ``expiry_lag``: then this polls ``inspect`` until the key is no longer
    live, for at most that long past ``expires_at`` (a slower release fails).
    """
    remaining = expires_at - store.time()
    if remaining > 0:
        time.sleep(remaining)
    wait_for(lambda: store.time() > expires_at, timeout, f"store time past {expires_at}")
    lag = float(getattr(store, "expiry_lag", 0.0))
    if lag:
        deadline = expires_at + lag
        while store.time() < deadline:
            record = store.inspect(key)
            if record is None or not record.live:
                return record
            time.sleep(0.02)
    return store.inspect(key)


def client_env(**extra: str) -> dict[str, str]:
    """Environment for a client subprocess (sees the package and the test dir)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env
