"""What celery_lease.testing adds to the store contract: the controllable clock,
expire / take_over, spaces shared by URL, and the thread safety of one space.

(The store contract itself runs on the memory store in
tests/contract/store_contract/.)
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from celery_lease import LeaseConfigError, LeaseStore
from celery_lease.testing import MemoryLeaseStore, expire, take_over, wait_until_held

A = "worker-a:1:aaaa"
B = "worker-b:2:bbbb"


@pytest.fixture(params=["real", "manual"])
def store(request: pytest.FixtureRequest) -> Iterator[MemoryLeaseStore]:
    s = LeaseStore.from_url(f"memory://t-{uuid.uuid4().hex}?clock={request.param}")
    assert isinstance(s, MemoryLeaseStore) and s.clock == request.param
    try:
        yield s
    finally:
        s.drop()


def test_manual_time_moves_only_when_advanced() -> None:
    s = MemoryLeaseStore(f"memory://m-{uuid.uuid4().hex}", clock="manual")
    t0 = s.time()
    lease = s.claim("k", ttl=5, owner_id=A)
    assert lease is not None
    time.sleep(0.05)  # real time passing is the point: the store must not see it
    assert s.time() == t0
    assert s.advance(4.9) == pytest.approx(t0 + 4.9)
    assert s.claim("k", ttl=5, owner_id=B) is None, "a lease lapsed before its TTL in store time"
    s.advance(0.2)
    assert s.renew(lease) is False
    taker = s.claim("k", ttl=5, owner_id=B)
    assert taker is not None and taker.token > lease.token
    s.drop()


def test_real_time_plus_advance(store: MemoryLeaseStore) -> None:
    lease = store.claim("k", ttl=30, owner_id=A)
    assert lease is not None
    before = store.time()
    assert store.advance(31) >= before + 31
    record = store.inspect("k")
    assert record is not None and not record.live and record.owner_id == A
    assert store.renew(lease) is False and store.release(lease) is False
    if store.clock == "real":
        assert abs(store.time() - 31 - time.time()) < 1.0


def test_expire_and_take_over_end_the_owners_lease(store: MemoryLeaseStore) -> None:
    lease = store.claim(["k1", "k2"], ttl=30, owner_id=A)
    assert lease is not None
    assert expire(store, lease) == 2
    assert store.renew(lease) is False
    assert expire(store, "k1") == 0, "nothing live left to expire"

    again = store.claim("k1", ttl=30, owner_id=A)
    assert again is not None and again.token > lease.token
    new = take_over(store, again)
    assert (new.owner_id, new.keys) == ("celery_lease.testing:take-over", ("k1",))
    assert new.token > again.token
    assert store.renew(again) is False and store.release(again) is False
    record = wait_until_held(store, "k1", timeout=1)
    assert (record.owner_id, record.token) == (new.owner_id, new.token)


def test_handles_on_one_url_share_a_space_and_drop_forgets_it() -> None:
    url = f"memory://shared-{uuid.uuid4().hex}"
    one, two = MemoryLeaseStore(url), LeaseStore.from_url(url)
    lease = one.claim("k", ttl=30, owner_id=A)
    assert lease is not None
    record = two.inspect("k")
    assert record is not None and (record.owner_id, record.token) == (A, lease.token)
    with pytest.raises(LeaseConfigError):
        MemoryLeaseStore(url, clock="manual")  # the space exists with the real clock
    one.drop()
    assert MemoryLeaseStore(url).inspect("k") is None
    MemoryLeaseStore(url).drop()


def test_bad_options_and_advance_are_refused() -> None:
    with pytest.raises(LeaseConfigError):
        MemoryLeaseStore("memory://x", clock="sundial")
    with pytest.raises(LeaseConfigError):
        MemoryLeaseStore("memory://x", ssl=True)
    s = MemoryLeaseStore(f"memory://b-{uuid.uuid4().hex}")
    for bad in (-1, float("nan"), "5", True):
        with pytest.raises(LeaseConfigError):
            s.advance(bad)  # type: ignore[arg-type]
    s.drop()


def test_one_owner_at_a_time_under_threads(store: MemoryLeaseStore) -> None:
    """Many threads claim, check and release one key: never two owners at once."""
    holders: list[str] = []
    overlaps: list[tuple[str, ...]] = []
    tokens: list[int] = []
    guard = threading.Lock()

    def worker(n: int) -> None:
        owner = f"w{n}"
        for _ in range(200):
            lease = store.claim("hot", ttl=30, owner_id=owner)
            if lease is None:
                continue
            with guard:
                holders.append(owner)
                tokens.append(lease.token)
                if len(holders) > 1:
                    overlaps.append(tuple(holders))
            with guard:
                holders.remove(owner)
            assert store.release(lease) is True

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not overlaps, overlaps[:3]
    assert tokens and len(set(tokens)) == len(tokens), "a token was granted twice"


def test_sqlite_in_memory_is_refused_pointing_at_celery_lease_testing() -> None:
    """Each connection to sqlite:///:memory: would see its own empty database."""
    from celery import Celery

    from celery_lease.config import Config

    with pytest.raises(LeaseConfigError, match=r"celery_lease\.testing"):
        LeaseStore.from_url("sqlite:///:memory:")
    app = Celery("mem", set_as_current=False)
    for name in ("lease_store_url", "lease_result_url"):
        app.conf.update({name: "sqlite:///:memory:"})
        with pytest.raises(LeaseConfigError, match=f"{name}.*celery_lease.testing"):
            Config.from_app(app)
        app.conf.update({name: None})
