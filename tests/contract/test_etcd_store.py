"""What is particular to the etcd store (the common contract: tests/contract/store_contract/).

Against real etcd clusters (tests/etcd_cluster.py): the shared 3-member
cluster, or a private one where a test kills members. Raw etcd reads (the
gateway's JSON API, not the store) check that the store uses etcd's own
primitives: keys stored as given, the token is the grant's revision, one etcd
lease per claim and none left behind, expiry and revocation decided by etcd.
"""

from __future__ import annotations

import base64
import json
import math
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_lease import LeaseConfigError, LeaseStore, StoreUnavailable
from celery_lease.config import Config
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
from tests.servers import free_port, wait_for
from tests.store_fixtures import new_key

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90)]

A = "worker-a:1:aaaa"
B = "worker-b:2:bbbb"


@pytest.fixture
def store(etcd_url: str) -> EtcdLeaseStore:  # noqa: F811 - the imported fixture
    s = LeaseStore.from_url(etcd_url)
    assert isinstance(s, EtcdLeaseStore)
    return s


# --------------------------------------------------------------------------
# selection and configuration (no server needed)
# --------------------------------------------------------------------------


def test_etcd_urls_select_the_etcd_store_through_the_entry_point_group() -> None:
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="celery_lease.stores")}
    assert names["etcd"] == names["etcds"] == "celery_lease.stores.etcd:EtcdLeaseStore"
    store = LeaseStore.from_url("etcd://127.0.0.1:2379,[::1]:2380,localhost")
    assert isinstance(store, EtcdLeaseStore)
    assert store.endpoints == [("127.0.0.1", 2379), ("::1", 2380), ("localhost", 2379)]
    assert isinstance(LeaseStore.from_url("etcds://127.0.0.1:2379"), EtcdLeaseStore)


@pytest.mark.parametrize(
    ("url", "options", "message"),
    [
        ("etcd://user:secret@127.0.0.1:2379", {}, "authentication is not supported"),
        ("etcd://127.0.0.1:2379/some/path", {}, "names members only"),
        ("etcd://127.0.0.1:99999", {}, "not a TCP port"),
        ("etcd://127.0.0.1:x", {}, "not a number"),
        ("etcd://127.0.0.1:2379,:2380", {}, "without a host"),
        ("etcd://127.0.0.1:2379", {"socket_timeout": 3}, "unknown etcd store option"),
        ("etcds://127.0.0.1:2379", {"ca_cert": "/no/such/ca.crt"}, "no such file"),
        ("etcd://127.0.0.1:2379", {"ca_cert": __file__}, "need an etcds:// URL"),
        ("etcds://127.0.0.1:2379", {"cert_cert": __file__}, "both cert_cert and cert_key"),
        ("etcd://127.0.0.1:2379", {"timeout": 0}, "timeout must be a positive number"),
    ],
)
def test_bad_urls_and_options_are_config_errors(
    url: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(LeaseConfigError) as info:
        LeaseStore.from_url(url, **options)
    assert message in str(info.value)
    assert "secret" not in str(info.value)


def test_settings_check_the_etcd_url_and_options_at_worker_start() -> None:
    def cfg(**conf: Any) -> Config:
        app = Celery("etcd-settings", set_as_current=False)
        app.conf.update(lease_result_url="sqlite:////tmp/unused-etcd-settings.db", **conf)
        return Config.from_app(app)

    ok = cfg(lease_store_url="etcd://127.0.0.1:2379,127.0.0.1:2479", lease_key_prefix="proj")
    assert ok.store_url.startswith("etcd://")
    with pytest.raises(LeaseConfigError, match="names members only"):
        cfg(lease_store_url="etcd://127.0.0.1:2379/db")
    with pytest.raises(LeaseConfigError, match="no such file"):
        cfg(lease_store_url="etcds://127.0.0.1:2379", lease_store_options={"ca_cert": "/nope"})
    with pytest.raises(LeaseConfigError, match="lease_key_prefix"):
        cfg(lease_store_url="etcd://127.0.0.1:2379", lease_store_options={"key_prefix": "x"})


# --------------------------------------------------------------------------
# etcd's own primitives
# --------------------------------------------------------------------------


def test_keys_are_stored_as_given_and_the_token_is_the_grants_revision(
    store: EtcdLeaseStore,
    etcd_cluster: EtcdCluster,  # noqa: F811
) -> None:
    key = f"payment-sécurité-42/ü😀 {new_key()}"
    meta = {"task_id": "t-1", "task_name": "proj.suite", "root_id": "r-1", "tenant": "acme"}
    lease = store.claim(key, owner_id=A, ttl=7, meta=meta)
    assert lease is not None

    kv = raw_get(etcd_cluster, f"/celery-lease/lease/{key}")
    assert kv is not None, "the lease key is the key as given, under /celery-lease/lease/"
    assert int(kv["create_revision"]) == int(kv["mod_revision"]) == lease.token
    value = json.loads(kv["value"])
    assert value["owner"] == A and value["acquired"] == lease.acquired_at
    assert {f: value[f] for f in meta} == meta
    fence = raw_get(etcd_cluster, f"/celery-lease/fence/{key}")
    assert fence is not None and int(fence["mod_revision"]) == lease.token
    assert store.fence_token(key) == lease.token
    # One etcd lease per claim, with the TTL asked for.
    assert lease_ttl(etcd_cluster, kv["lease"])[1] == 7
    assert [r.key for r in store.list(prefix="payment-sécurité-42/")] == [key]

    assert store.release(lease) is True
    assert raw_get(etcd_cluster, f"/celery-lease/lease/{key}") is None
    assert lease_ttl(etcd_cluster, kv["lease"]) == (-1, 0), "release revokes the etcd lease"
    fence = raw_get(etcd_cluster, f"/celery-lease/fence/{key}")
    assert fence is not None and int(fence["mod_revision"]) == lease.token, "the fence stays"


def test_a_refused_claim_leaves_no_etcd_lease_behind(
    store: EtcdLeaseStore,
    etcd_cluster: EtcdCluster,  # noqa: F811
) -> None:
    key = new_key()
    held = store.claim(key, owner_id=A, ttl=30)
    assert held is not None
    before = etcd_leases(etcd_cluster)
    for i in range(20):
        assert store.claim([new_key("free"), key], owner_id=f"{B}{i}", ttl=30) is None
    after = etcd_leases(etcd_cluster)
    assert not after - before, f"refused claims left {len(after - before)} etcd leases"
    assert store.release(held)


def test_the_same_owner_claiming_again_gets_a_new_token_and_retires_the_old_grant(
    store: EtcdLeaseStore,
    etcd_cluster: EtcdCluster,  # noqa: F811
) -> None:
    """A claim retried after a lost reply: granted again atomically, never blocked by itself."""
    key = new_key()
    first = store.claim(key, owner_id=A, ttl=30)
    assert first is not None
    old_lease = raw_get(etcd_cluster, f"/celery-lease/lease/{key}")["lease"]  # type: ignore[index]
    again = store.claim(key, owner_id=A, ttl=30, meta={"task_id": "retry"})
    assert again is not None and again.token > first.token
    assert store.claim(key, owner_id=B, ttl=30) is None
    assert lease_ttl(etcd_cluster, old_lease) == (-1, 0), "the superseded etcd lease is revoked"
    record = store.inspect(key)
    assert record is not None and (record.owner_id, record.token) == (A, again.token)
    assert record.task_id == "retry"
    # The first grant is dead: only the new one renews and releases.
    assert store.renew(first) is False and store.release(first) is False
    assert store.renew(again) is True and store.release(again) is True


def test_renewing_to_another_ttl_moves_the_keys_to_a_new_etcd_lease_and_keeps_the_token(
    store: EtcdLeaseStore,
    etcd_cluster: EtcdCluster,  # noqa: F811
) -> None:
    keys = [new_key("mv1"), new_key("mv2")]
    lease = store.claim(keys, owner_id=A, ttl=3)
    assert lease is not None
    old = raw_get(etcd_cluster, f"/celery-lease/lease/{keys[0]}")
    [expires] = store.renew_many([lease], ttl=12)
    assert expires is not None and 11 < expires - store.time() <= 12
    moved = [raw_get(etcd_cluster, f"/celery-lease/lease/{k}") for k in keys]
    assert all(m is not None for m in moved)
    assert {m["lease"] for m in moved} != {old["lease"]}  # type: ignore[index]
    assert len({m["lease"] for m in moved}) == 1, "still one etcd lease for the claim"  # type: ignore[index]
    assert lease_ttl(etcd_cluster, moved[0]["lease"])[1] == 12  # type: ignore[index]
    assert lease_ttl(etcd_cluster, old["lease"]) == (-1, 0)  # type: ignore[index]
    assert store.fence_token(keys[0]) == lease.token
    assert store.renew(lease) is True, "the same Lease renews after the move"
    assert store.release(lease) is True


def test_operations_agree_on_the_revocation(
    store: EtcdLeaseStore,
    etcd_cluster: EtcdCluster,  # noqa: F811
) -> None:
    """etcd's expiry is the revocation that deletes the key: until then the key is
    held (inspect says live, other claimers are refused), from then on it is free
    for everyone (inspect, claim, renew, release agree). And the local view is a
    lower bound: the key is never freed before the grant's ``expires_at``."""
    freed_after: list[float] = []
    for _ in range(3):
        key = new_key("rev")
        lease = store.claim(key, owner_id=A, ttl=1)
        assert lease is not None and lease.ttl == 1.0
        while True:
            record = store.inspect(key)
            now = store.time()
            if record is None or not record.live:
                break
            assert now < lease.expires_at + store.expiry_lag, "not freed within expiry_lag"
            time.sleep(0.01)
        assert now >= lease.expires_at, f"freed {lease.expires_at - now:.3f}s before expires_at"
        freed_after.append(now - lease.expires_at)
        assert raw_get(etcd_cluster, f"/celery-lease/lease/{key}") is None
        assert store.renew(lease) is False
        assert store.release(lease) is False
        taker = store.claim(key, owner_id=B, ttl=5)
        assert taker is not None and taker.token > lease.token
    print(f"freed after expires_at: {', '.join(f'{s:.3f}s' for s in freed_after)}")


def test_a_dead_member_is_skipped_and_no_live_member_is_store_unavailable(
    etcd_cluster: EtcdCluster,  # noqa: F811
    etcd_url: str,  # noqa: F811
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    store = LeaseStore.from_url(etcd_url.replace("etcd://", f"etcd://{dead},"))
    lease = store.claim(new_key(), owner_id=A, ttl=5)
    assert lease is not None and store.renew(lease) and store.release(lease)

    nowhere = LeaseStore.from_url(f"etcd://{dead},127.0.0.1:{free_port()}", timeout=2)
    for call in (
        lambda: nowhere.claim(new_key(), owner_id=A, ttl=5),
        lambda: nowhere.inspect("k"),
        lambda: nowhere.renew(lease),
        lambda: nowhere.release(lease),
        lambda: nowhere.list(),
        lambda: nowhere.evict("k"),
        lambda: nowhere.fence_token("k"),
    ):
        with pytest.raises(StoreUnavailable) as info:
            call()
        assert "unavailable" in str(info.value)


def test_tokens_and_held_leases_survive_a_leader_kill_and_a_full_restart(
    make_etcd_cluster: Callable[..., EtcdCluster],  # noqa: F811
) -> None:
    cluster = make_etcd_cluster()
    store = LeaseStore.from_url(cluster.url, timeout=3)
    released, held_key = new_key("rel"), new_key("held")
    first = store.claim(released, owner_id=A, ttl=5)
    assert first is not None and store.release(first)
    held = store.claim(held_key, owner_id=A, ttl=10)
    assert held is not None

    leader = wait_for(cluster.leader, 10, "a leader")
    leader.kill()
    new_leader = wait_for(
        lambda: (lambda m: m if m is not None and m is not leader else None)(cluster.leader()),
        10,
        "a new leader",
    )
    # The lease granted under the old leader is still held (Raft kept it), its
    # owner renews it, others are refused; the fence did not move.
    assert wait_for(lambda: _retry(lambda: store.renew(held)), 10, "a renewal via the new leader")
    assert store.claim(held_key, owner_id=B, ttl=5) is None
    record = store.inspect(held_key)
    assert record is not None and record.live and (record.owner_id, record.token) == (A, held.token)
    second = store.claim(released, owner_id=B, ttl=5)
    assert second is not None and second.token > first.token
    assert store.fence_token(released) == second.token
    assert store.release(second)

    # Every member killed (no clean shutdown) and started again from its data:
    # the fence is where it was, and the held lease is still held.
    for m in cluster.members:
        m.kill()
    cluster.start()
    assert wait_for(lambda: _retry(lambda: store.fence_token(released)), 10, "the fence") == (
        second.token
    )
    record = store.inspect(held_key)
    assert record is not None and record.live and (record.owner_id, record.token) == (A, held.token)
    assert store.claim(held_key, owner_id=B, ttl=5) is None
    assert store.renew(held) is True
    third = store.claim(released, owner_id=A, ttl=5)
    assert third is not None and third.token > second.token
    print(f"leader {leader.name} -> {new_leader.name}; tokens {first.token} < {second.token} "
          f"< {third.token} across the leader kill and the full restart")  # fmt: skip


def _retry(call: Callable[[], Any]) -> Any:
    """``call()``, or None while the store is unavailable (during an election)."""
    try:
        return call()
    except StoreUnavailable:
        return None


# --------------------------------------------------------------------------
# TLS (etcds://)
# --------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _signed(d: Path, name: str, cn: str, ca: str = "ca") -> None:
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", "ext.cnf", cwd=d,
    )  # fmt: skip


@pytest.fixture(scope="module")
def etcd_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.crt; server.crt for 127.0.0.1 and client.crt signed by it; other-ca.crt."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("etcd-certs")
    for ca in ("ca", "other-ca"):
        _openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2",
            "-subj", f"/CN={ca}", cwd=d,
        )  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _signed(d, "server", "127.0.0.1")
    _signed(d, "client", "celery-lease-worker")
    _signed(d, "stranger", "stranger", ca="other-ca")
    return d


def test_etcds_with_a_ca_and_a_client_certificate(
    make_etcd_cluster: Callable[..., EtcdCluster],  # noqa: F811
    etcd_certs: Path,
) -> None:
    cluster = make_etcd_cluster(1, tls=etcd_certs)
    assert cluster.url.startswith("etcds://")
    options = {
        "ca_cert": str(etcd_certs / "ca.crt"),
        "cert_cert": str(etcd_certs / "client.crt"),
        "cert_key": str(etcd_certs / "client.key"),
    }
    store = LeaseStore.from_url(cluster.url, **options)
    lease = store.claim(new_key("tls"), owner_id=A, ttl=5)
    assert lease is not None and store.renew(lease) is True
    assert store.release(lease) is True
    # The Redis store's option names work too.
    aliases = LeaseStore.from_url(
        cluster.url,
        ssl_ca_certs=options["ca_cert"],
        ssl_certfile=options["cert_cert"],
        ssl_keyfile=options["cert_key"],
    )
    assert aliases.inspect(lease.key) is not None

    wrong = [
        {**options, "ca_cert": str(etcd_certs / "other-ca.crt")},  # server not trusted
        {"ca_cert": options["ca_cert"]},  # no client certificate
        {
            **options,
            "cert_cert": str(etcd_certs / "stranger.crt"),
            "cert_key": str(etcd_certs / "stranger.key"),
        },  # a client certificate etcd does not trust
    ]
    for bad in wrong:
        with pytest.raises(StoreUnavailable):
            LeaseStore.from_url(cluster.url, timeout=3, **bad).claim("k", owner_id=A, ttl=5)
    with pytest.raises(StoreUnavailable):  # plain HTTP to a TLS member
        LeaseStore.from_url(cluster.url.replace("etcds://", "etcd://"), timeout=3).inspect("k")
    # Nothing was granted by the refused attempts.
    assert store.inspect("k") is None


def test_a_deferral_marker_expires_and_leaves_no_key_and_no_fence(
    store: EtcdLeaseStore,
    etcd_cluster: EtcdCluster,  # noqa: F811
) -> None:
    """A marker is one key on an etcd lease of its TTL: another owner is refused,
    its own owner extends it, and once etcd expires it nothing of it is left,
    no fence key (a marker made as a claim left one forever per deferral)."""
    from celery_lease.task import DEFER_MARKER

    name = f"{DEFER_MARKER}{new_key('mark')}"
    before = etcd_leases(etcd_cluster)
    assert store.mark(name, A, ttl=2.0)
    assert store.marker(name) == A
    assert not store.mark(name, B, ttl=2.0), "another chain's live marker is kept"
    assert store.mark(name, A, ttl=2.0), "the chain's own marker is extended"
    assert store.marker(name) == A
    assert raw_get(etcd_cluster, store.fence_name(name).decode()) is None, "a marker has no fence"
    raw = raw_get(etcd_cluster, f"/{store.prefix}/mark/{name}")
    assert raw is not None and raw["value"] == A.encode()
    lease_id = str(raw["lease"])
    assert lease_id in etcd_leases(etcd_cluster) - before
    assert len(etcd_leases(etcd_cluster) - before) == 1, "the refused and replaced leases are gone"
    assert raw_get(etcd_cluster, store.fence_name(name).decode()) is None
    assert raw_get(etcd_cluster, store.lease_name(name).decode()) is None

    wait_for(lambda: store.marker(name) is None, 20, "etcd to expire the marker")
    assert raw_get(etcd_cluster, f"/{store.prefix}/mark/{name}") is None
    assert raw_get(etcd_cluster, store.fence_name(name).decode()) is None
    assert lease_ttl(etcd_cluster, lease_id) == (-1, 0)
    left = etcd_cluster.call(
        "kv/range",
        {"key": b64(f"/{store.prefix}/".encode()), "range_end": b64(b"\0"), "keys_only": True},
    ).get("kvs", [])
    names = [base64.b64decode(kv["key"]).decode() for kv in left]
    assert not [n for n in names if name in n], names
    assert store.mark(name, B, ttl=2.0), "an expired marker is free for the next chain"


def test_a_lease_that_ran_out_is_held_until_etcd_revokes_it(
    make_etcd_cluster: Callable[..., EtcdCluster],  # noqa: F811
) -> None:
    """The model's finding 3 (docs/model.md, ``SPARE_ETCD_LAG``): in the lag
    between an etcd lease running out and the leader revoking it, the key
    still exists, so its owner's release (the fenced commit's ownership
    check) still succeeds; ``inspect`` must then report that owner, live,
    not a free key (a refused copy of the task id decided from it that
    nobody held the key and stored FAILURE while its twin could still
    commit). The lag is made long the way load makes it: the leader revokes
    at most 1,000 expired leases a second, and thousands of keyless etcd
    leases run out just before this one."""
    cluster = make_etcd_cluster(1)
    store = LeaseStore.from_url(cluster.url)
    assert isinstance(store, EtcdLeaseStore)
    key = new_key("lag")
    # Every filler runs out in the same second. The window is wide because
    # granting 4,000 leases on a loaded 2-core machine can take many seconds.
    fillers, ttl_end = 4000, time.time() + 25
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: cluster.call(
            "lease/grant", {"TTL": str(max(1, math.ceil(ttl_end - time.time())))}
        ), range(fillers)))  # fmt: skip
    assert time.time() < ttl_end - 2, "granting the fillers outlasted their window"
    # ... and this lease a second later: behind them in the revocation queue
    lease = store.claim(key, owner_id=A, ttl=math.ceil(ttl_end - time.time()) + 1,
                        meta={"task_id": "t-0"})  # fmt: skip
    assert lease is not None
    etcd_id = raw_get(cluster, f"/celery-lease/lease/{key}")["lease"]  # type: ignore[index]
    seen_lag = 0
    while True:
        record = store.inspect(key)
        left, granted = lease_ttl(cluster, etcd_id)
        if record is None or not record.live:
            break
        seen_lag += left < 0 and granted > 0  # run out, not revoked: the lag
        assert record.owner_id == A and record.task_id == "t-0", record
        assert time.time() < lease.expires_at + 30, "never revoked"
        time.sleep(0.05)
    released = store.release(lease)
    print(f"inspect said live through {seen_lag} reads in the lag; then {record}; "
          f"the owner's release after it: {released}")  # fmt: skip
    assert not released, (
        f"inspect reported {key!r} free ({record}) while its owner's release still succeeded"
    )
    assert seen_lag, "the lag never lasted a second: the fault did not happen"
    store.close()
