"""The lease-store contract (celery_lease/stores/base.py), proved on real servers.

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

import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from celery_lease import (
    HeldLease,
    Lease,
    LeaseConfigError,
    LeaseLost,
    LeaseNotAcquired,
    LeaseRecord,
    LeaseStore,
)
from celery_lease.results import ResultTable
from celery_lease.stores.redis import RedisLeaseStore
from celery_lease.stores.sql import SQLLeaseStore
from tests.etcd_cluster import etcd_cluster, etcd_url  # noqa: F401 - fixtures
from tests.inflight import gate
from tests.store_fixtures import (
    CONTRACT_STORE_KINDS,
    new_key,
    open_store,
    store_url,
    tagged_keys,
    wait_for,
    wait_until_expired,
)

pytestmark = pytest.mark.timeout(60)

A = "worker-a:1:aaaa"
B = "worker-b:2:bbbb"
C = "worker-c:3:cccc"


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


# --------------------------------------------------------------------------
# claim
# --------------------------------------------------------------------------


def test_claim_grants_and_refuses_a_second_claimer_while_live(store: LeaseStore) -> None:
    key = new_key()
    before = store.time()
    lease = claim_ok(store, key, A, ttl=30)
    assert (lease.key, lease.keys, lease.owner_id, lease.ttl) == (key, (key,), A, 30.0)
    assert lease.token > 0
    assert lease.expires_at == pytest.approx(lease.acquired_at + 30, abs=1e-3)
    assert lease.acquired_at >= before - 0.002

    for owner in (B, C):
        assert store.claim(key, owner_id=owner, ttl=30) is None
    record = store.inspect(key)
    assert record is not None and record.live
    assert state(record) == (A, lease.token, pytest.approx(lease.expires_at, abs=resolution(store)))
    assert 0 < record.remaining <= 30


def test_tokens_grow_across_release(store: LeaseStore) -> None:
    key = new_key()
    tokens = []
    for owner in (A, B, C, A):
        lease = claim_ok(store, key, owner)
        tokens.append(lease.token)
        assert store.release(lease) is True
        assert is_free(store.inspect(key))
        assert store.fence_token(key) >= lease.token
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens


def test_tokens_grow_across_expiry(store: LeaseStore) -> None:
    key = new_key()
    first = claim_ok(store, key, A, ttl=0.3)
    assert store.claim(key, owner_id=B, ttl=0.3) is None
    record = wait_until_expired(store, key, first.expires_at)
    assert is_free(record), f"lease still live after its TTL: {record}"
    second = claim_ok(store, key, B, ttl=0.3)
    assert second.token > first.token
    record = wait_until_expired(store, key, second.expires_at)
    assert is_free(record)
    third = claim_ok(store, key, A, ttl=30)
    assert third.token > second.token > first.token


def test_tokens_grow_across_evict(store: LeaseStore, other_store: LeaseStore) -> None:
    key = new_key()
    lease = claim_ok(store, key, A)
    evicted = other_store.evict(key)
    assert evicted is not None
    assert (evicted.owner_id, evicted.token) == (A, lease.token)
    assert is_free(store.inspect(key))
    fence = store.fence_token(key)
    assert fence > lease.token, "evict must advance the fence past the evicted token"
    nxt = claim_ok(store, key, B)
    assert nxt.token > fence > lease.token
    # Evicting a free key still never lowers anything.
    assert store.release(nxt) is True
    assert other_store.evict(key) is None
    assert claim_ok(store, key, C).token > nxt.token


# --------------------------------------------------------------------------
# renew / release by the owner
# --------------------------------------------------------------------------


def test_owner_renews_and_expiry_moves_forward_in_store_time(store: LeaseStore) -> None:
    key = new_key()
    lease = claim_ok(store, key, A, ttl=5)
    # Past the store's resolution, so the renewal's move is visible in inspect.
    coarse = resolution(store) > 1e-3
    moved = 0.05 + (resolution(store) if coarse else 0.0)
    wait_for(lambda: store.time() > lease.acquired_at + moved, 5, "store clock to advance")
    assert store.renew(lease) is True
    record = store.inspect(key)
    assert record is not None and record.live and record.owner_id == A
    assert record.token == lease.token, "a renewal must not change the token"
    assert record.expires_at > lease.expires_at + 0.04
    assert record.renewed_at is not None
    assert record.expires_at == pytest.approx(record.renewed_at + 5, abs=1e-3)
    assert record.renewed_at <= record.now + 0.002

    # renew_many answers the new expiry; an explicit ttl sets a new length.
    [expires] = store.renew_many([lease], ttl=20)
    assert expires is not None
    record = store.inspect(key)
    assert record is not None
    assert record.expires_at == pytest.approx(expires, abs=resolution(store))
    assert 19 < record.expires_at - record.now <= 20


def test_owner_releases(store: LeaseStore) -> None:
    key = new_key()
    lease = claim_ok(store, key, A)
    assert store.release(lease) is True
    record = store.inspect(key)
    assert is_free(record)
    assert store.list(prefix=key) == []
    assert store.renew(lease) is False, "a released lease cannot be renewed back to life"
    assert claim_ok(store, key, B).token > lease.token


STRANGERS = {
    "other-owner-same-token": lambda lease: dataclasses.replace(lease, owner_id=B),
    "same-owner-older-token": lambda lease: dataclasses.replace(lease, token=lease.token - 1),
    "same-owner-newer-token": lambda lease: dataclasses.replace(lease, token=lease.token + 1),
    "other-owner-other-token": lambda lease: dataclasses.replace(
        lease, owner_id=B, token=lease.token + 1
    ),
}


@pytest.mark.parametrize("stranger", sorted(STRANGERS))
def test_strangers_renew_and_release_change_nothing(store: LeaseStore, stranger: str) -> None:
    key = new_key()
    lease = claim_ok(store, key, A, ttl=10)
    fake = STRANGERS[stranger](lease)
    wait_for(lambda: store.time() > lease.acquired_at + 0.02, 5, "store clock to advance")
    before = store.inspect(key)

    assert store.renew(fake) is False
    assert store.renew(fake, ttl=60) is False
    assert store.renew_many([fake]) == [None]
    assert store.release(fake) is False

    after = store.inspect(key)
    assert state(after, store) == state(before, store)
    assert after is not None and after.live
    # The real owner is unaffected.
    assert store.renew(lease) is True
    assert store.release(lease) is True


def test_expired_owner_cannot_renew_or_release_the_new_owners_lease(store: LeaseStore) -> None:
    key = new_key()
    old = claim_ok(store, key, A, ttl=0.3)
    assert is_free(wait_until_expired(store, key, old.expires_at))
    assert store.renew(old) is False, "an expired lease must not be renewed"

    new = claim_ok(store, key, B, ttl=30)
    assert new.token > old.token
    before = store.inspect(key)
    assert store.renew(old) is False
    assert store.renew_many([old]) == [None]
    assert store.release(old) is False
    assert state(store.inspect(key), store) == state(before, store)

    # Same owner id coming back after expiry: its old grant is still dead.
    assert store.release(new) is True
    again = claim_ok(store, key, A, ttl=30)
    assert again.token > new.token
    before = store.inspect(key)
    assert store.renew(old) is False
    assert store.release(old) is False
    assert state(store.inspect(key), store) == state(before, store)
    assert store.release(again) is True


def test_every_operation_agrees_on_expiry_at_the_boundary(store: LeaseStore) -> None:
    """Right after expiry in store time, claim/renew/release all treat the lease as gone.

    Redis used to decide claim and renew by the hash's PEXPIRE, which fires a
    millisecond or more after the store-time expiry that inspect reports: in
    between, a new claimer was refused and the expired owner could renew.
    """
    if getattr(store, "expiry_lag", 0.0):
        pytest.skip(
            "etcd decides expiry on the leader's clock, in whole seconds, and no client can "
            "read that clock: the expiry instant is not observable to the millisecond. There "
            "the operations agree on the revocation instead (test_etcd_store.py: "
            "test_operations_agree_on_the_revocation)"
        )
    for i in range(30):
        key = new_key("edge")
        lease = claim_ok(store, key, A, ttl=0.02)
        past = lease.expires_at
        wait_for(lambda t=past: store.time() > t, 5, "store time past expiry", interval=0)
        op = ("claim", "renew", "release")[i % 3]
        if op == "claim":
            taker = store.claim(key, owner_id=B, ttl=5)
            assert taker is not None, f"claim refused after expiry: {store.inspect(key)}"
            assert taker.token > lease.token
        elif op == "renew":
            assert store.renew(lease) is False, "an expired lease was renewed"
            assert is_free(store.inspect(key))
        else:
            assert store.release(lease) is False, "an expired lease was released"


# --------------------------------------------------------------------------
# hold() and HeldLease
# --------------------------------------------------------------------------


def test_hold_keeps_the_lease_past_several_ttls_and_releases_on_exit(store: LeaseStore) -> None:
    key = new_key()
    # Renewed every TTL/3: at 3 s a renewal may come up to 2 s late before the
    # lease lapses, slack a loaded two-core machine needs (1 s leaves 0.67 s).
    ttl = 3.0
    refusals = 0
    with store.hold(key, ttl=ttl, owner_id=A) as held:
        assert isinstance(held, HeldLease)
        token, acquired = held.token, held.lease.acquired_at
        # Run until the store clock is well past three TTLs from the grant.
        while store.time() < acquired + 3.5 * ttl:
            assert held.held
            held.ensure()
            assert store.claim(key, owner_id=B, ttl=ttl) is None
            refusals += 1
            record = store.inspect(key)
            assert record is not None and record.live
            assert (record.owner_id, record.token) == (A, token)
            time.sleep(0.05)
        assert held.renewals >= 3, f"only {held.renewals} renewals in {3.5 * ttl}s"
        assert held.expires_at > acquired + 3 * ttl
        assert held.held
    assert refusals >= 10
    assert not held.held
    after = claim_ok(store, key, B, ttl=ttl)
    assert after.token > token


def test_hold_raises_lease_not_acquired_when_held(store: LeaseStore) -> None:
    key = new_key()
    lease = claim_ok(store, key, A, ttl=30)
    with pytest.raises(LeaseNotAcquired) as info, store.hold(key, ttl=30, owner_id=B):
        pytest.fail("hold() entered a lease another owner holds")
    assert info.value.key == key
    assert info.value.holder == A
    assert info.value.remaining is not None and 0 < info.value.remaining <= 30
    assert state(store.inspect(key))[:2] == (A, lease.token)  # type: ignore[index]


def test_hold_with_a_bad_renew_interval_leaves_the_key_free(store: LeaseStore) -> None:
    key = new_key()
    with pytest.raises(LeaseConfigError), store.hold(key, ttl=5, renew_interval=10):
        pytest.fail("hold() accepted a renew interval above the TTL")
    assert is_free(store.inspect(key)), "a refused hold() must not leave the key claimed"
    claim_ok(store, key, B)


def test_held_lease_is_lost_when_another_owner_evicts_it(
    store: LeaseStore, other_store: LeaseStore
) -> None:
    key = new_key()
    with store.hold(key, ttl=3, owner_id=A, renew_interval=0.1) as held:
        assert held.held
        assert other_store.evict(key) is not None
        wait_for(lambda: not held.held, 5, "the renewer to notice the eviction")
        assert held.lost_reason
        with pytest.raises(LeaseLost):
            held.ensure()
        assert held.renew() is False
        # The key is free for someone else, with a newer token.
        taker = claim_ok(other_store, key, B, ttl=30)
        assert taker.token > held.token
    # Leaving the block of a lost lease does not touch the new owner's lease.
    record = store.inspect(key)
    assert record is not None and record.live
    assert (record.owner_id, record.token) == (B, taker.token)
    assert not held.held


# --------------------------------------------------------------------------
# several keys
# --------------------------------------------------------------------------


def test_multi_key_claims_are_all_or_nothing(store: LeaseStore) -> None:
    k1, k2, k3 = tagged_keys("m1", "m2", "m3")
    busy = claim_ok(store, k2, B)
    fences = {k: store.fence_token(k) for k in (k1, k3)}

    assert store.claim([k1, k2, k3], owner_id=A, ttl=30) is None
    for k in (k1, k3):
        assert is_free(store.inspect(k)), f"{k} granted by a refused multi-key claim"
        assert store.fence_token(k) == fences[k]
    assert state(store.inspect(k2))[:2] == (B, busy.token)  # type: ignore[index]
    # The free keys really are free: someone else takes and gives them back.
    for k in (k1, k3):
        assert store.release(claim_ok(store, k, C)) is True

    assert store.release(busy) is True
    lease = claim_ok(store, [k3, k1, k2], A)
    assert lease.key == k3, "the primary key is the first one named"
    assert lease.keys == tuple(sorted((k1, k2, k3)))
    for k in (k1, k2, k3):
        record = store.inspect(k)
        assert record is not None and record.live
        assert (record.owner_id, record.token) == (A, lease.token)
        assert lease.token > busy.token
        assert store.claim(k, owner_id=C, ttl=30) is None

    assert store.release(lease) is True
    for k in (k1, k2, k3):
        assert is_free(store.inspect(k))
        assert claim_ok(store, k, C).token > lease.token


def test_renew_many_answers_per_lease(store: LeaseStore, other_store: LeaseStore) -> None:
    expiring = claim_ok(store, new_key("exp"), A, ttl=0.3)
    live = claim_ok(store, new_key("live"), A, ttl=10)
    released = claim_ok(store, new_key("rel"), A, ttl=10)
    evicted = claim_ok(store, new_key("ev"), A, ttl=10)
    multi = claim_ok(store, tagged_keys("mx", "my"), A, ttl=10)
    stolen = claim_ok(store, new_key("st"), A, ttl=10)
    assert store.release(released)
    assert other_store.evict(evicted.key) is not None
    assert other_store.evict(stolen.key) is not None
    thief = claim_ok(other_store, stolen.key, B, ttl=10)
    assert is_free(wait_until_expired(store, expiring.key, expiring.expires_at))

    leases = [live, expiring, released, multi, evicted, stolen]
    answers = store.renew_many(leases, ttl=20)
    assert [a is not None for a in answers] == [True, False, False, True, False, False]
    now = store.time()
    for lease, expires in zip(leases, answers):
        if expires is not None:
            assert expires > lease.expires_at
            assert 19 < expires - now <= 20
            for k in lease.keys:
                record = store.inspect(k)
                assert record is not None and record.live and record.owner_id == A
                assert record.expires_at == pytest.approx(expires, abs=resolution(store))
    assert is_free(store.inspect(expiring.key))
    assert is_free(store.inspect(released.key))
    assert is_free(store.inspect(evicted.key))
    record = store.inspect(stolen.key)
    assert record is not None and (record.owner_id, record.token) == (B, thief.token)
    assert record.expires_at == pytest.approx(thief.expires_at, abs=resolution(store))


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


# --------------------------------------------------------------------------
# a renewal in flight, and multi-key renewal after a loss
# --------------------------------------------------------------------------


def _end_by_release(store: LeaseStore, held: HeldLease) -> bool:
    return held.release()


def _end_by_commit(store: LeaseStore, held: HeldLease) -> bool:
    # What a task does: renewals go on through the commit, which releases the lease.
    held.silence()
    ResultTable(store.url, store).commit(held.lease, {"done": held.key})
    held.released = True
    return True


ENDINGS = {"release": _end_by_release, "commit": _end_by_commit}


@pytest.mark.parametrize("nkeys", [1, 2])
@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_renewal_in_flight_never_extends_a_lease_ended_meanwhile(
    store: LeaseStore, ending: str, nkeys: int
) -> None:
    """Invariant 10: a lease released (or committed with release) while a renewal
    that names it is in flight stays released, in the store and in the local view.

    The renewal batch names two leases; a lock held from another connection
    (tests/inflight.py) holds it in flight on the first while the second is
    ended. Redis and etcd run each operation atomically: there the renewal,
    sent with the old lease, arrives after the release.
    """
    if ending == "commit" and not isinstance(store, SQLLeaseStore):
        pytest.skip(
            "the commit releases in the statement that checks the lease only for leases in "
            "the result database; elsewhere it calls the store's release (the other case)"
        )
    tag = new_key("")[1:]

    def keys(name: str) -> str | list[str]:
        # One hash tag per lease: a multi-key lease on a Redis Cluster needs one slot.
        if nkeys == 1:
            return f"{name}-{tag}"
        return [f"{{{name}-{tag}}}:{i}" for i in range(nkeys)]

    # Named and listed so the gated lease comes first: PostgreSQL locks the rows
    # of multi-key leases in key order, the others in the order named.
    x = HeldLease(store, claim_ok(store, keys("rx"), A, ttl=30))
    y = HeldLease(store, claim_ok(store, keys("ry"), A, ttl=30))
    end = ENDINGS[ending]

    def renew() -> list[float | None]:
        # The renewer's cycle (renewal.Renewer.renew_due), keeping the answers.
        sent = time.monotonic()
        answers = store.renew_many([x.lease, y.lease], ttl=60)
        for h, expires in zip((x, y), answers):
            h.renewed(sent, expires)
        return answers

    ending_done: Future[bool] | None = None
    with ThreadPoolExecutor(2) as pool, gate(store, x.key) as in_flight:
        if in_flight is None:
            assert end(store, y) is True
        renewing = pool.submit(renew)
        if in_flight is not None:
            in_flight.wait_blocked()
            ending_done = pool.submit(end, store, y)
            if in_flight.row_level:
                # Ended while the renewal waits, after it read its clock.
                assert ending_done.result(timeout=20) is True
                assert not renewing.done()
        # Leaving the block opens the gate: the renewal goes on.
    answers = renewing.result(timeout=30)
    assert ending_done is None or ending_done.result(timeout=30) is True
    assert answers[0] is not None, "the other lease of the batch was not renewed"
    # SQLite lets the renewal and the release go one after the other, in either
    # order: a renewal served first may answer yes, and the release follows.
    ordered = in_flight is None or in_flight.row_level
    if ordered:
        assert answers[1] is None, f"the renewal extended the ended lease to {answers[1]}"
        assert y.renewals == 0 and y.expires_at == y.lease.expires_at, "the local view moved"

    for k in y.keys:
        record = store.inspect(k)
        assert is_free(record), f"the ended lease is live again: {record}"
    assert not y.held
    taker = claim_ok(store, list(y.keys), B, ttl=30)
    assert taker.token > y.token
    assert x.held and x.renewals == 1
    assert x.release() is True


@pytest.mark.parametrize("how", ["evicted", "taken-over"])
def test_multi_key_renewal_after_one_key_is_lost_extends_no_key(
    store: LeaseStore, other_store: LeaseStore, how: str
) -> None:
    """A multi-key lease renews as a unit: once one key is gone, the renewal
    answers lost and leaves every key's expiry where it was."""
    k1, k2, k3 = tagged_keys("ma", "mb", "mc")
    lease = claim_ok(store, [k1, k2, k3], A, ttl=10)
    assert other_store.evict(k2) is not None
    taker = claim_ok(other_store, k2, B, ttl=10) if how == "taken-over" else None
    before = {k: state(store.inspect(k)) for k in (k1, k2, k3)}
    # Past the store's resolution, so that an extension would show in inspect.
    moved = 0.05 + resolution(store)
    wait_for(lambda: store.time() > lease.acquired_at + moved, 5, "store clock to advance")

    assert store.renew_many([lease], ttl=60) == [None]
    assert store.renew(lease) is False
    after = {k: state(store.inspect(k), store) for k in (k1, k2, k3)}
    assert after == before, "a lost multi-key lease was extended"
    if taker is not None:
        assert after[k2][:2] == (B, taker.token)  # type: ignore[index]
    else:
        assert is_free(store.inspect(k2))
