"""Test helpers for projects that use celery-lease: a memory store, a pytest plugin.

* :class:`MemoryLeaseStore` (``memory://name``): leases in this process's
  memory with a clock the test moves (``advance``); for unit tests of your
  own logic, never evidence for an invariant of a real store.
* :func:`expire` / :func:`take_over`: make a task's lease lapse, or be taken
  over by another owner, in store time, so a test can assert how the task
  ends (``LEASE_LOST``, ``FENCED``); they work on every store.
* :func:`wait_until_held`: wait until a worker holds a key.
* the pytest plugin (``celery_lease.testing.pytest_plugin``, registered as a
  ``pytest11`` entry point; inert unless a test asks for its fixtures):
  ``lease_store``, ``lease_settings``, ``lease_store_url``,
  ``lease_result_url`` and their ``lease_session_*`` forms. See docs/testing.md.
"""

from __future__ import annotations

import time
from typing import Any

from celery_lease.exceptions import LeaseNotAcquired
from celery_lease.local import LocalLease
from celery_lease.stores.base import Lease, LeaseRecord, LeaseStore
from celery_lease.testing.memory import CLOCKS, TAKE_OVER_OWNER, MemoryLeaseStore, _keys_of

__all__ = [
    "CLOCKS",
    "TAKE_OVER_OWNER",
    "LocalLease",
    "MemoryLeaseStore",
    "expire",
    "take_over",
    "wait_until_held",
]


def expire(store: LeaseStore, lease_or_key: Any) -> int:
    """End the lease on ``lease_or_key`` now, in ``store``'s time; returns how many
    keys had a live lease.

    ``lease_or_key``: a key, a list of keys, or a ``Lease`` / ``HeldLease`` /
    ``LeaseRecord``. On a :class:`MemoryLeaseStore` the lease simply runs out
    (:meth:`MemoryLeaseStore.expire`); a real store's clock cannot be moved,
    so there each key is evicted (``store.evict``), which ends the lease the
    same way for its owner and also moves the key's fence.
    """
    if isinstance(store, MemoryLeaseStore):
        return store.expire(lease_or_key)
    return sum(store.evict(key) is not None for key in _keys_of(lease_or_key))


def take_over(
    store: LeaseStore, lease_or_key: Any, *, owner_id: str = TAKE_OVER_OWNER, ttl: float = 3600.0
) -> Lease:
    """:func:`expire` the lease on ``lease_or_key``, then claim its keys as
    ``owner_id``, in store time: what happens when a worker stalls past its TTL
    and another takes the key. The old owner's renewals fail and its commit is
    refused (the task ends ``FENCED``, or ``LEASE_LOST`` if its body checks
    ``self.lease.ensure()`` first). Returns the new owner's lease (release it
    to free the key)."""
    if isinstance(store, MemoryLeaseStore):
        return store.take_over(lease_or_key, owner_id=owner_id, ttl=ttl)
    keys = list(_keys_of(lease_or_key))
    expire(store, keys)
    lease = store.claim(keys, ttl=ttl, owner_id=owner_id)
    if lease is None:
        record = store.inspect(keys[0])
        raise LeaseNotAcquired(keys[0], record.owner_id if record else None, None)
    return lease


def wait_until_held(store: LeaseStore, key: str, timeout: float = 30.0) -> LeaseRecord:
    """Poll until ``key`` has a live lease in ``store`` (a worker claimed it);
    return its record. Raises ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        record = store.inspect(key)
        if record is not None and record.live:
            return record
        if time.monotonic() > deadline:
            raise TimeoutError(f"nobody held {key!r} within {timeout}s (last record: {record})")
        time.sleep(0.01)
