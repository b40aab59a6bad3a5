"""The lease-store contract, reading and bad input: list, inspect and the
store's clock; refused arguments and store URLs.

The stores and servers: this package's conftest.py.
"""

from __future__ import annotations

import time

import pytest

from celery_lease import LeaseConfigError, LeaseStore
from celery_lease.stores.redis import RedisLeaseStore
from tests.contract.store_contract.helpers import A, B, claim_ok, is_free, resolution
from tests.store_fixtures import new_key, wait_until_expired

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------
# reading: list, inspect, time
# --------------------------------------------------------------------------


def test_list_returns_only_live_leases_matching_the_prefix(store: LeaseStore) -> None:
    hexid = new_key("")[1:]
    # Wildcards of LIKE (% _) and of Redis globs (* ? [ ]) must match literally.
    prefix = f"ls_{hexid}%*[x]?-"
    wanted = {claim_ok(store, prefix + s, A).key for s in ("a", "b")}
    decoys = [
        f"lsQ{hexid}%*[x]?-a",  # LIKE '_' taken as a wildcard
        f"ls_{hexid}QQ*[x]?-a",  # LIKE '%' taken as a wildcard
        f"ls_{hexid}%QQx?-a",  # glob '*' and '[x]' taken as wildcards
        f"ls_{hexid}%*[x]Q-a",  # glob '?' taken as a wildcard
        f"xls_{hexid}%*[x]?-a",  # not a prefix
    ]
    for d in decoys:
        claim_ok(store, d, A)
    released = claim_ok(store, prefix + "c", A)
    assert store.release(released)
    expired = claim_ok(store, prefix + "d", A, ttl=0.3)
    assert is_free(wait_until_expired(store, expired.key, expired.expires_at))

    records = store.list(prefix=prefix)
    assert sorted(r.key for r in records) == sorted(wanted)
    for r in records:
        assert r.live and r.owner_id == A
    everything = {r.key for r in store.list()}
    assert wanted | set(decoys) <= everything
    assert released.key not in everything and expired.key not in everything


def test_list_leaves_out_a_lease_the_store_keeps_past_its_expiry(
    store: LeaseStore, store_kind: str
) -> None:
    """``list`` answers by the store's clock, not by whether the record is still stored.

    SQL and the in-memory store keep an expired row; Redis deletes the hash by
    its PEXPIRE, which fires in the millisecond after the ``expires`` field the
    scripts decide by. For Redis the hash is made to stay (PERSIST), so that
    window is held open rather than hit by chance.
    """
    if store_kind == "etcd":
        pytest.skip(
            "etcd holds a key until its leader revokes the lease (the record reads live "
            "until then, and ownerless after): no record outlives its expiry"
        )
    key = new_key("lx")
    lease = claim_ok(store, key, A, ttl=0.3)
    if isinstance(store, RedisLeaseStore):
        assert store.client.persist(store.lease_name(key))
    record = wait_until_expired(store, key, lease.expires_at)
    assert record is not None and record.owner_id == A, "the record was not kept"
    assert not record.live, record
    assert key not in {r.key for r in store.list(prefix=key)}
    assert store.claim(key, owner_id=B, ttl=30) is not None  # and it is free to claim


def test_inspect_metadata_round_trips(store: LeaseStore) -> None:
    key = new_key()
    meta = {
        "task_id": "7f8e2c1a-task",
        "task_name": "proj.tasks.generate_security_suite",
        "root_id": "root-42",
        "tenant": "acme",
    }
    lease = store.claim(key, owner_id=A, ttl=30, meta=meta)
    assert lease is not None
    assert dict(lease.meta) == meta
    record = store.inspect(key)
    assert record is not None
    assert {f: getattr(record, f) for f in meta} == meta
    assert (record.key, record.owner_id, record.token, record.ttl) == (key, A, lease.token, 30.0)
    assert record.acquired_at == pytest.approx(lease.acquired_at, abs=1e-3)
    assert record.expires_at == pytest.approx(lease.expires_at, abs=resolution(store))
    [listed] = store.list(prefix=key)
    assert {f: getattr(listed, f) for f in meta} == meta

    # Partial metadata: the rest is None, and nothing leaks from the last owner.
    assert store.release(lease)
    nxt = store.claim(key, owner_id=B, ttl=30, meta={"task_id": "t-2", "tenant": None})
    assert nxt is not None
    record = store.inspect(key)
    assert record is not None
    assert (record.task_id, record.task_name, record.root_id, record.tenant) == (
        "t-2",
        None,
        None,
        None,
    )


def test_time_is_the_stores_clock(store: LeaseStore) -> None:
    t0 = store.time()
    lease = claim_ok(store, new_key(), A)
    record = store.inspect(lease.key)
    t1 = store.time()
    assert record is not None
    eps = 0.002  # SQLite's clock has millisecond resolution
    assert t0 - eps <= lease.acquired_at <= record.now + eps <= t1 + 2 * eps
    # The servers run on this machine: their clock is ours.
    assert abs(store.time() - time.time()) < 1.0
    readings = [store.time() for _ in range(20)]
    assert readings == sorted(readings)


# --------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------


def test_bad_input_raises_lease_config_error(store: LeaseStore) -> None:
    key = new_key()
    for bad_key in ("", [], [key, ""], [key, 7], None):
        with pytest.raises(LeaseConfigError):
            store.claim(bad_key, owner_id=A, ttl=5)  # type: ignore[arg-type]
    for bad_ttl in (0, -1, 0.0, -0.5, True, "5", None, float("nan"), float("inf")):
        with pytest.raises(LeaseConfigError):
            store.claim(key, owner_id=A, ttl=bad_ttl)  # type: ignore[arg-type]
    with pytest.raises(LeaseConfigError):
        store.claim(key, owner_id=A, ttl=5, meta={"priority": "high"})
    with pytest.raises(LeaseConfigError):
        with store.hold(key, ttl=0):
            pytest.fail("hold() accepted ttl=0")
    with pytest.raises(LeaseConfigError):
        store.inspect("")
    with pytest.raises(LeaseConfigError):
        store.evict("")
    assert store.inspect(key) is None, "a refused claim must leave no trace"

    lease = claim_ok(store, key, A, ttl=5)
    for bad_ttl in (0, -3, float("inf")):
        with pytest.raises(LeaseConfigError):
            store.renew(lease, ttl=bad_ttl)
    record = store.inspect(key)
    assert record is not None
    assert record.expires_at == pytest.approx(lease.expires_at, abs=resolution(store))


@pytest.mark.parametrize(
    "url",
    [
        "mongodb://127.0.0.1:27017/leases",
        "etcd3://127.0.0.1:2379",
        "no-scheme-at-all",
        "",
        "mysql+pymysql://u@127.0.0.1/db",
        "sqlite:///:memory:",
    ],
)
def test_unknown_or_unusable_store_urls_raise_lease_config_error(url: str) -> None:
    with pytest.raises(LeaseConfigError):
        LeaseStore.from_url(url)
