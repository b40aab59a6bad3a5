"""The etcd store against etcd's limits and faults: transaction size, lost replies, races.

etcd refuses a transaction with more than ``--max-txn-ops`` (default 128)
compares, or success or failure operations. The store keeps every
transaction within ``max_txn_ops`` (a store option, default 128): renewals
and releases of many leases are split into several transactions, a claim
too big for one transaction is refused up front (all or nothing cannot span
transactions). Faults are real: a loopback proxy (tests/lossy_proxy.py) drops
etcd's reply after etcd applied the request, or holds a request back while
another client acts.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_lease import LeaseConfigError, LeaseError, LeaseStore, StoreUnavailable
from celery_lease.config import Config
from celery_lease.renewal import HeldLease, renewer
from celery_lease.stores.etcd import EtcdLeaseStore
from tests.etcd_cluster import (  # noqa: F401 - fixtures
    EtcdCluster,
    b64,
    etcd_cluster,
    etcd_leases,
    etcd_url,
    lease_ttl,
    make_etcd_cluster,
    raw_get,
)
from tests.lossy_proxy import LossyProxy
from tests.servers import LOOPBACK, wait_for
from tests.store_fixtures import new_key

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

A = "worker-a:1:aaaa"
B = "worker-b:2:bbbb"


@pytest.fixture
def store(etcd_url: str) -> EtcdLeaseStore:  # noqa: F811 - the imported fixture
    s = LeaseStore.from_url(etcd_url)
    assert isinstance(s, EtcdLeaseStore)
    return s


@pytest.fixture
def proxy(etcd_url: str, etcd_cluster: EtcdCluster) -> Any:  # noqa: F811
    member = etcd_cluster.members[0]
    with LossyProxy(LOOPBACK, member.client_port) as p:
        yield p


def _raw_store(etcd_cluster: EtcdCluster) -> EtcdLeaseStore:  # noqa: F811
    s = LeaseStore.from_url(etcd_cluster.url)
    assert isinstance(s, EtcdLeaseStore)
    return s


# --------------------------------------------------------------------------
# etcd's default limit (the shared cluster runs with --max-txn-ops 128)
# --------------------------------------------------------------------------


def test_renew_many_of_200_separate_leases_at_etcds_default_limit(store: EtcdLeaseStore) -> None:
    leases = [store.claim(new_key("many"), owner_id=A, ttl=30) for _ in range(200)]
    assert all(lease is not None for lease in leases)
    sent = store.time()
    answers = store.renew_many(leases)  # type: ignore[arg-type]
    assert len(answers) == 200
    assert all(a is not None and a > sent for a in answers), answers
    # Each answer is its own lease's: a released one among them answers None.
    assert store.release(leases[117])  # type: ignore[arg-type]
    answers = store.renew_many(leases)  # type: ignore[arg-type]
    assert answers[117] is None and sum(a is not None for a in answers) == 199
    for lease in leases:
        store.release(lease)  # type: ignore[arg-type]


def test_a_64_key_lease_claims_renews_and_releases_at_etcds_default_limit(
    store: EtcdLeaseStore,
) -> None:
    keys = [new_key("wide") for _ in range(64)]
    lease = store.claim(keys, owner_id=A, ttl=30)
    assert lease is not None and sorted(lease.keys) == sorted(keys)
    assert store.claim(keys[40], owner_id=B, ttl=30) is None
    assert store.renew(lease) is True
    assert store.renew(lease, ttl=40) is True  # moved to a new etcd lease: 64 keys in one txn
    assert store.release(lease) is True  # 192 compares: more than one transaction
    assert all(store.inspect(k) is None or not store.inspect(k).live for k in keys)  # type: ignore[union-attr]
    assert store.release(lease) is True, "a repeated release of the same grant"
    other = store.claim(keys, owner_id=B, ttl=30)
    assert other is not None and other.token > lease.token
    assert store.release(other)


def test_a_claim_too_big_for_one_transaction_is_refused_naming_the_limit(
    store: EtcdLeaseStore,
) -> None:
    keys = [new_key("huge") for _ in range(65)]
    with pytest.raises(LeaseConfigError) as info:
        store.claim(keys, owner_id=A, ttl=30)
    message = str(info.value)
    assert "max_txn_ops" in message and "128" in message and "64" in message, message
    assert all(store.inspect(k) is None for k in keys), "a refused claim wrote nothing"


def test_max_txn_ops_is_a_store_option_checked_when_the_store_is_built() -> None:
    url = "etcd://127.0.0.1:2379"
    assert EtcdLeaseStore(url).max_txn_ops == 128
    assert EtcdLeaseStore(url, max_txn_ops=1024).max_txn_ops == 1024
    for bad in (0, 2, -1, 2.5, "128", True):
        with pytest.raises(LeaseConfigError, match="max_txn_ops"):
            EtcdLeaseStore(url, max_txn_ops=bad)
    # Through the settings, checked at worker start like the other store options.
    app = Celery("etcd-limits", set_as_current=False)
    app.conf.update(
        lease_result_url="sqlite:////tmp/unused-etcd-limits.db",
        lease_store_url=url,
        lease_store_options={"max_txn_ops": 2},
    )
    with pytest.raises(LeaseConfigError, match="max_txn_ops"):
        Config.from_app(app)


# --------------------------------------------------------------------------
# a lowered server limit (a private member with --max-txn-ops 12)
# --------------------------------------------------------------------------


def test_every_operation_stays_within_a_lowered_server_limit(
    make_etcd_cluster: Callable[..., EtcdCluster],  # noqa: F811
) -> None:
    cluster = make_etcd_cluster(1, args=("--max-txn-ops", "12"))
    # Proof the server enforces the limit: a store that assumes etcd's default is refused.
    naive = LeaseStore.from_url(cluster.url)
    with pytest.raises(LeaseError, match="too many operations"):
        naive.claim([new_key("n") for _ in range(7)], owner_id=A, ttl=30)

    store = LeaseStore.from_url(cluster.url, max_txn_ops=12)
    keys = [new_key("six") for _ in range(6)]  # 12 puts: the most one claim may write
    wide = store.claim(keys, owner_id=A, ttl=30)
    assert wide is not None
    with pytest.raises(LeaseConfigError, match="max_txn_ops"):
        store.claim([new_key("seven") for _ in range(7)], owner_id=A, ttl=30)
    leases = [store.claim(new_key("sep"), owner_id=A, ttl=30) for _ in range(30)]
    assert all(lease is not None for lease in leases)
    answers = store.renew_many([wide, *leases])  # type: ignore[list-item]
    assert all(a is not None for a in answers)
    assert store.renew(wide, ttl=20) is True
    assert store.release(wide) is True  # 18 compares: two transactions
    assert store.release(wide) is True
    assert all(store.inspect(k) is None or not store.inspect(k).live for k in keys)  # type: ignore[union-attr]
    assert store.list() and all(r.owner_id == A for r in store.list())
    assert all(a is not None for a in store.renew_many(leases))  # type: ignore[arg-type]
    for lease in leases:
        assert store.release(lease) is True  # type: ignore[arg-type]
    assert store.list() == []


@pytest.mark.slow  # a soak of three TTLs: .ci/run's long runs (-m ci)
@pytest.mark.ci
def test_a_process_renews_200_leases_for_three_ttls(etcd_url: str) -> None:  # noqa: F811
    """The store-level renewer: one renew_many per interval for all 200 leases."""
    store = LeaseStore.from_url(etcd_url)
    # The 200 claims and the renewer's first cycle must fit in one TTL, even
    # on a loaded 2-core machine beside other pytest workers.
    ttl = 10.0
    helds = []
    for _ in range(200):
        lease = store.claim(new_key("r"), owner_id=A, ttl=ttl)
        assert lease is not None
        held = HeldLease(store, lease)
        renewer().add(held)
        helds.append(held)
    try:
        start = time.monotonic()
        cycles = renewer().cycles
        while time.monotonic() < start + 3 * ttl:
            lost = [h for h in helds if not h.held]
            assert not lost, f"{len(lost)} of 200 lost: {lost[0].lost_reason}"
            time.sleep(0.2)
        assert renewer().cycles >= cycles + 3
        print(f"{renewer().cycles - cycles} renewal cycles of 200 leases in {3 * ttl:.0f}s")
        for h in helds:
            record = store.inspect(h.key)
            assert record is not None and record.live and record.token == h.token
    finally:
        for h in helds:
            h.release()


# --------------------------------------------------------------------------
# lost replies and races
# --------------------------------------------------------------------------


def test_a_release_whose_reply_was_lost_answers_true_when_repeated(
    proxy: LossyProxy,
    etcd_cluster: EtcdCluster,  # noqa: F811
) -> None:
    store = LeaseStore.from_url(f"etcd://{proxy.address}", timeout=5)
    key = new_key("lost")
    lease = store.claim(key, owner_id=A, ttl=30)
    assert lease is not None
    etcd_lease = raw_get(etcd_cluster, f"/celery-lease/lease/{key}")["lease"]  # type: ignore[index]

    proxy.drop_next_reply(b"request_delete_range")
    with pytest.raises(StoreUnavailable):
        store.release(lease)
    dropped = proxy.wait_dropped(5)
    # The fault happened: etcd applied the release and answered; the client never saw it.
    assert b" 200 " in dropped.reply.split(b"\r\n", 1)[0], dropped.reply[:200]
    assert raw_get(etcd_cluster, f"/celery-lease/lease/{key}") is None, "etcd applied it"
    assert store.fence_token(key) == lease.token

    assert store.release(lease) is True, "the owner's repeated release"
    assert store.release(lease) is True
    assert lease_ttl(etcd_cluster, etcd_lease) == (-1, 0), "the etcd lease is revoked after all"
    assert store.renew(lease) is False
    # A stranger gets no True from the released grant, and nothing changes.
    assert store.release(dataclasses.replace(lease, owner_id=B)) is False
    assert store.release(dataclasses.replace(lease, token=lease.token + 1)) is False
    taker = store.claim(key, owner_id=B, ttl=30)
    assert taker is not None and taker.token > lease.token
    assert store.release(lease) is False, "once another owner claimed, the old grant is gone"
    assert store.release(taker) is True


def test_a_renewal_racing_an_evict_never_answers_true_after_the_eviction(
    etcd_cluster: EtcdCluster,  # noqa: F811
    etcd_url: str,  # noqa: F811
) -> None:
    """The evict lands between the renewal's requests; the renewal must say lost.

    The renewer's keep-alive is held back by one proxy while an evictor's
    transaction goes through and its revocation of the etcd lease is held
    back by another: the keep-alive reaches etcd after the eviction, while the
    evicted etcd lease still exists.
    """
    port = etcd_cluster.members[0].client_port
    with LossyProxy(LOOPBACK, port) as p1, LossyProxy(LOOPBACK, port) as p2:
        renewing = LeaseStore.from_url(f"etcd://{p1.address}")
        evicting = LeaseStore.from_url(f"etcd://{p2.address}")
        key = new_key("race")
        lease = renewing.claim(key, owner_id=A, ttl=30)
        assert lease is not None
        assert renewing.renew(lease) is True

        p1.hold_next_request(b"lease/keepalive")
        answer: list[Any] = []
        renewal = threading.Thread(target=lambda: answer.append(renewing.renew(lease)))
        renewal.start()
        p1.wait_held(10)
        p2.hold_next_request(b"lease/revoke")
        evictor = threading.Thread(target=lambda: evicting.evict(key))
        evictor.start()
        p2.wait_held(10)
        # The fault is in place: the key is evicted, its etcd lease not yet revoked.
        assert raw_get(etcd_cluster, f"/celery-lease/lease/{key}") is None
        assert evicting.fence_token(key) > lease.token
        p1.resume()
        renewal.join(20)
        p2.resume()
        evictor.join(20)
        assert answer == [False], "renew answered True for an evicted lease"


def test_the_proxy_passes_everything_when_not_armed(proxy: LossyProxy) -> None:
    store = LeaseStore.from_url(f"etcd://{proxy.address}")
    lease = store.claim([new_key("p1"), new_key("p2")], owner_id=A, ttl=10)
    assert lease is not None
    assert wait_for(lambda: store.renew(lease), 5, "a renewal through the proxy")
    assert store.release(lease) is True
    assert proxy.dropped == []
