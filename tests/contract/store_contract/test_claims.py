"""The lease-store contract: claim, renew and release by the owner and by
strangers, expiry at the boundary, hold() and HeldLease.

The stores and servers: this package's conftest.py.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from celery_lease import HeldLease, LeaseConfigError, LeaseLost, LeaseNotAcquired, LeaseStore
from tests.contract.store_contract.helpers import A, B, C, claim_ok, is_free, resolution, state
from tests.store_fixtures import new_key, wait_for, wait_until_expired

pytestmark = pytest.mark.timeout(60)


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
