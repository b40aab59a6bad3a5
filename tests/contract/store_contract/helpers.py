"""The lease-store contract's owners, and the helpers its assertions read with."""

from __future__ import annotations

from typing import Any

import pytest

from celery_lease import Lease, LeaseRecord, LeaseStore

A = "worker-a:1:aaaa"
B = "worker-b:2:bbbb"
C = "worker-c:3:cccc"


def resolution(store: LeaseStore) -> float:
    """How far a record's expiry may be from the grant's (1 ms; etcd: whole seconds)."""
    return max(1e-3, float(getattr(store, "expiry_resolution", 0.0)))


def state(record: LeaseRecord | None, store: LeaseStore | None = None) -> tuple[Any, ...] | None:
    """What a stranger must not change: owner, token, expiry (within the store's resolution)."""
    if record is None:
        return None
    if store is not None and resolution(store) > 1e-3:
        expiry: Any = pytest.approx(record.expires_at, abs=resolution(store), rel=0)
        return (record.owner_id, record.token, expiry)
    return (record.owner_id, record.token, record.expires_at)


def is_free(record: LeaseRecord | None) -> bool:
    return record is None or not record.live


def claim_ok(store: LeaseStore, key: str | list[str], owner: str, ttl: float = 30.0) -> Lease:
    lease = store.claim(key, owner_id=owner, ttl=ttl)
    first = key if isinstance(key, str) else key[0]
    assert lease is not None, f"claim of {key!r} by {owner} refused: {store.inspect(first)}"
    return lease
