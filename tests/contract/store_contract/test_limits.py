"""The lease-store contract, part two: TTL limits and evict by token, on every store.

Run like the rest of tests/contract/store_contract/ (same stores, same real
servers), on every store but the in-memory one:

* a TTL up to :data:`celery_lease.stores.base.MAX_TTL` (one year) is granted,
  renewed and read back by ``inspect()`` exactly; a larger one is refused with
  :class:`LeaseConfigError` before anything is written (no lease record, no
  fence);
* ``evict(key, token=...)`` evicts only the lease granted with that token: with
  a stale token (the key released, or granted again since) nothing changes;
* internal markers (``mark``/``marker``): another owner's live marker is
  kept, the owner's own is extended, and an expired one is free again.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_lease import LeaseConfigError, LeaseStore
from celery_lease.stores.base import MAX_TTL
from tests.contract.store_contract.helpers import A, B, claim_ok, resolution, state
from tests.store_fixtures import ALL_STORE_KINDS, HA_STORE_KINDS, new_key, open_store, store_url

pytestmark = pytest.mark.timeout(60)

#: Over the maximum: just past it, where Redis wrote ``expires`` in exponent
#: form (1e11 s), and where its PEXPIRE failed after HSET had run (1e16 s).
TOO_LONG = (MAX_TTL + 1, 1e11, 1e16)


@pytest.fixture(params=(*ALL_STORE_KINDS, *HA_STORE_KINDS))
def store(request: pytest.FixtureRequest) -> Iterator[LeaseStore]:
    s = open_store(store_url(request, request.param), request.param)
    try:
        yield s
    finally:
        s.close()


def test_the_maximum_ttl_is_granted_renewed_and_inspected_exactly(store: LeaseStore) -> None:
    assert MAX_TTL == 365 * 24 * 3600
    key = new_key("max-ttl")
    lease = claim_ok(store, key, A, ttl=MAX_TTL)
    assert lease.ttl == MAX_TTL
    assert lease.expires_at == pytest.approx(lease.acquired_at + MAX_TTL, abs=resolution(store))
    for _ in range(2):  # as granted, then as renewed
        record = store.inspect(key)
        assert record is not None and record.live
        assert (record.owner_id, record.token, record.ttl) == (A, lease.token, MAX_TTL)
        assert record.expires_at == pytest.approx(record.now + MAX_TTL, abs=5 + resolution(store))
        assert store.list(key)[0].ttl == MAX_TTL
        assert store.renew(lease, ttl=MAX_TTL) is True
    assert store.release(lease) is True


@pytest.mark.parametrize("ttl", TOO_LONG)
def test_a_ttl_over_the_maximum_is_refused_before_anything_is_written(
    store: LeaseStore, ttl: float
) -> None:
    key = new_key("too-long")
    with pytest.raises(LeaseConfigError, match=r"ttl must be at most 31536000 seconds"):
        store.claim(key, owner_id=A, ttl=ttl)
    with pytest.raises(LeaseConfigError, match=r"at most 31536000"), store.hold(key, ttl=ttl):
        pytest.fail(f"hold() accepted ttl={ttl}")
    assert store.inspect(key) is None, "a refused claim wrote a record"
    assert store.fence_token(key) == 0, "a refused claim advanced the fence"

    # A renewal to such a TTL is refused too, and leaves the lease as it was.
    lease = claim_ok(store, key, A, ttl=30)
    before = store.inspect(key)
    with pytest.raises(LeaseConfigError, match=r"at most 31536000"):
        store.renew(lease, ttl=ttl)
    after = store.inspect(key)
    assert after is not None and after.ttl == 30
    assert state(after, store) == state(before, store)


def test_evict_with_a_stale_token_changes_nothing(store: LeaseStore) -> None:
    key = new_key("evict-token")
    first = claim_ok(store, key, A)
    assert store.release(first) is True
    second = claim_ok(store, key, B)
    assert second.token > first.token
    fence, before = store.fence_token(key), store.inspect(key)

    # The first owner's token (read before its release): not the current lease.
    assert store.evict(key, token=first.token) is None
    # A token never issued for the key (larger than any): nothing either.
    assert store.evict(key, token=second.token + 10**6) is None
    after = store.inspect(key)
    assert state(after, store) == state(before, store), "a stale-token evict changed the lease"
    assert store.fence_token(key) == fence, "a stale-token evict advanced the fence"
    assert store.renew(second) is True, "the current owner lost its lease"

    # Its own token evicts the current lease, and advances the fence past it.
    evicted = store.evict(key, token=second.token)
    assert evicted is not None and (evicted.owner_id, evicted.token) == (B, second.token)
    assert store.renew(second) is False
    assert store.fence_token(key) > second.token

    # A released lease is not evicted by its token: nothing changes.
    third = claim_ok(store, key, A)
    assert store.release(third) is True
    fence = store.fence_token(key)
    assert store.evict(key, token=third.token) is None
    assert store.fence_token(key) == fence
    assert claim_ok(store, key, B).token > third.token

    for bad in (0, -1, True, "7", 1.5):
        with pytest.raises(LeaseConfigError):
            store.evict(key, token=bad)  # type: ignore[arg-type]


def test_markers_keep_another_owners_extend_their_own_and_expire(store: LeaseStore) -> None:
    from celery_lease.task import DEFER_MARKER
    from tests.servers import wait_for

    name = f"{DEFER_MARKER}{new_key('marker')}"
    assert store.marker(name) is None
    assert store.mark(name, A, ttl=2.0)
    assert store.marker(name) == A
    assert not store.mark(name, B, ttl=2.0)
    assert store.marker(name) == A
    assert store.mark(name, A, ttl=2.0)
    wait_for(lambda: store.marker(name) is None, 30, "the marker to expire")
    assert store.mark(name, B, ttl=30.0)
    assert store.marker(name) == B


def test_a_marker_is_replaced_only_from_an_owner_named_and_by_one_of_many(
    store: LeaseStore,
) -> None:
    """The compare-and-set that keeps twin deferred copies (a broker restore)
    from both carrying a task on: of callers replacing the same marker at
    once, exactly one wins; a marker of an owner not named is kept."""
    import threading

    from celery_lease.task import DEFER_MARKER

    name = f"{DEFER_MARKER}{new_key('marker')}"
    assert store.mark(name, "copy-1", ttl=30.0)
    assert not store.mark(name, "copy-2", ttl=30.0, replace=("someone-else",))
    assert store.marker(name) == "copy-1"
    assert store.mark(name, "copy-2", ttl=30.0, replace=("copy-1", "copy-0"))
    assert store.marker(name) == "copy-2"
    assert store.mark(name, "copy-2", ttl=30.0, replace=("copy-1",)), "its own: extended"

    for round_ in range(5):
        current = store.marker(name)
        assert current is not None
        barrier = threading.Barrier(4)
        won: list[str] = []

        def replace_it(me: str, current: str, barrier: threading.Barrier, won: list[str]) -> None:
            barrier.wait()
            if store.mark(name, me, ttl=30.0, replace=(current,)):
                won.append(me)

        threads = [
            threading.Thread(target=replace_it, args=(f"twin-{round_}-{i}", current, barrier, won))
            for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(won) == 1, f"round {round_}: {won} all replaced {current}"
        assert store.marker(name) == won[0]
