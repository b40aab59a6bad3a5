"""The lease-store contract, several keys: all-or-nothing claims, renewals
answered per lease, a renewal in flight racing the lease's end, and a
multi-key renewal after one key is lost.

The stores and servers: this package's conftest.py.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from celery_lease import HeldLease, LeaseStore
from celery_lease.results import ResultTable
from celery_lease.stores.sql import SQLLeaseStore
from tests.contract.store_contract.helpers import A, B, C, claim_ok, is_free, resolution, state
from tests.inflight import gate
from tests.store_fixtures import new_key, tagged_keys, wait_for, wait_until_expired

pytestmark = pytest.mark.timeout(60)


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
