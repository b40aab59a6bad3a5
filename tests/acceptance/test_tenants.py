"""Tenant scope: one tenant can never claim, renew, release, read or overwrite another's key.

A tenant's keys live in their own namespace (:func:`celery_lease.keys.scoped`):
the same key string ``shared-key`` is ``t/4:acme/shared-key`` for tenant
``acme``, ``t/6:globex/shared-key`` for ``globex`` and ``shared-key`` unscoped.
Proved on every store (Redis with results in PostgreSQL; PostgreSQL and SQLite
with leases and results together), through:

* the store: claim, renew, release, evict, inspect, list, fence tokens;
* the fenced result table: commit, ``accepted``, ``history`` (a tenant's
  client that forges a lease on the other tenant's key is refused);
* the CLI: ``celery -A tests.apps.tenantapp lease show|results|release KEY --tenant T``;
* real workers: the same key string submitted under two tenants (through the
  ``lease_tenant`` template of ``tenantapp.work_for`` and through the caller's
  ``headers={"lease_tenant": ...}``) runs concurrently, with no conflict, and
  each tenant gets its own accepted result (``task.accepted(...)``).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_lease import LeaseScopeMismatch, LeaseStore, StaleFencingToken
from celery_lease.keys import scoped
from celery_lease.results import ResultTable
from tests.sec_cluster import Cluster
from tests.servers import RedisServer, wait_for
from tests.store_fixtures import STORE_KINDS, store_url

pytestmark = pytest.mark.timeout(150)

A, B = "acme", "globex"
TTL = 30.0


@pytest.fixture(params=STORE_KINDS)
def stores(
    request: pytest.FixtureRequest, pg_results: str
) -> Iterator[tuple[str, LeaseStore, ResultTable, str]]:
    """(kind, lease store, result table, results URL): Redis leases commit into PostgreSQL."""
    kind = request.param
    url = store_url(request, kind)
    results_url = pg_results if kind == "redis" else url
    store = LeaseStore.from_url(url)
    yield kind, store, ResultTable(results_url, store), results_url
    store.close()


def _key() -> str:
    return f"shared-key-{uuid.uuid4().hex[:8]}"


def test_same_key_string_is_a_separate_lease_per_tenant(
    stores: tuple[str, LeaseStore, ResultTable, str],
) -> None:
    _, store, _, _ = stores
    key = _key()
    ka, kb = scoped(key, A), scoped(key, B)
    assert len({ka, kb, key}) == 3

    a = store.claim(ka, ttl=TTL, owner_id="worker-a", meta={"tenant": A})
    b = store.claim(kb, ttl=TTL, owner_id="worker-b", meta={"tenant": B})
    plain = store.claim(key, ttl=TTL, owner_id="worker-plain")
    assert a is not None and b is not None and plain is not None, "no cross-tenant conflict"

    # A's client scopes every key it names to A: it can never name B's key,
    # so its claim of "the same key" is a conflict with A's own holder only.
    assert store.claim(scoped(key, A), ttl=TTL, owner_id="worker-a2") is None
    rb = store.inspect(kb)
    assert rb is not None and rb.live and rb.owner_id == "worker-b" and rb.token == b.token
    assert rb.tenant == B

    # Inspect / list: each scope sees only its own record; unscoped sees neither.
    ra = store.inspect(ka)
    assert ra is not None and ra.owner_id == "worker-a" and ra.tenant == A
    unscoped = store.inspect(key)
    assert unscoped is not None and unscoped.owner_id == "worker-plain"
    assert unscoped.tenant is None
    assert [r.key for r in store.list(prefix=key)] == [key]
    assert [r.key for r in store.list(prefix=scoped(key, A))] == [ka]
    assert [r.key for r in store.list(prefix=f"t/{len(B)}:{B}/")] == [kb]
    assert store.inspect(scoped(key, "acme2")) is None
    assert store.inspect(scoped(key, "ACME")) is None


def test_a_tenant_cannot_renew_release_evict_or_overwrite_another_tenants_lease(
    stores: tuple[str, LeaseStore, ResultTable, str],
) -> None:
    _, store, table, _ = stores
    key = _key()
    ka, kb = scoped(key, A), scoped(key, B)
    a = store.claim(ka, ttl=TTL, owner_id="worker-a", meta={"tenant": A})
    b = store.claim(kb, ttl=TTL, owner_id="worker-b", meta={"tenant": B})
    assert a is not None and b is not None
    fence_b = store.fence_token(kb)

    # A forges a lease on B's key with its own owner id and token, and with B's token.
    for forged in (
        dataclasses.replace(a, key=kb, keys=(kb,)),
        dataclasses.replace(a, key=kb, keys=(kb,), token=b.token),
    ):
        assert store.renew(forged) is False
        assert store.release(forged) is False
        with pytest.raises(StaleFencingToken):
            table.commit(forged, {"by": "acme"}, tenant=A)
    # B's lease is untouched: same owner, same token, still live, fence not moved.
    rb = store.inspect(kb)
    assert rb is not None and rb.live and rb.owner_id == "worker-b" and rb.token == b.token
    assert store.fence_token(kb) == fence_b
    assert store.renew(b) is True

    # A's own operations never touch B's key.
    assert store.renew(a) is True
    evicted = store.evict(ka)
    assert evicted is not None and evicted.owner_id == "worker-a"
    a2 = store.claim(ka, ttl=TTL, owner_id="worker-a", meta={"tenant": A})
    assert a2 is not None and a2.token > a.token
    accepted_a = table.commit(a2, {"by": "acme"}, tenant=A)
    assert accepted_a.key == ka and accepted_a.tenant == A
    rb = store.inspect(kb)
    assert rb is not None and rb.live and rb.owner_id == "worker-b" and rb.token == b.token
    assert store.fence_token(kb) == fence_b

    # B commits its own result; A's commit did not overwrite it, and vice versa.
    accepted_b = table.commit(b, {"by": "globex"}, tenant=B)
    assert table.accepted(kb, B) == accepted_b
    assert table.accepted(ka, A) == accepted_a
    assert accepted_b.value == {"by": "globex"} and accepted_a.value == {"by": "acme"}


def test_results_are_read_only_within_their_tenant(
    stores: tuple[str, LeaseStore, ResultTable, str],
) -> None:
    _, store, table, _ = stores
    key = _key()
    for tenant, value in ((A, 1), (B, 2), (None, 3)):
        lease = store.claim(scoped(key, tenant), ttl=TTL, meta={"tenant": tenant})
        assert lease is not None
        table.commit(lease, {"v": value}, tenant=tenant)

    for tenant, value in ((A, 1), (B, 2), (None, 3)):
        got = table.accepted(scoped(key, tenant), tenant)
        assert got is not None and got.value == {"v": value} and got.tenant == tenant
        assert [r.value for r in table.history(scoped(key, tenant), tenant)] == [{"v": value}]
    # The right key string in the wrong tenant reads nothing, in either direction,
    # and an unscoped lookup never sees a scoped result.
    assert table.accepted(scoped(key, B), A) is None
    assert table.accepted(scoped(key, A), B) is None
    assert table.accepted(scoped(key, A), None) is None
    assert table.accepted(key, A) is None
    assert table.history(scoped(key, B), A) == []
    assert table.accepted(scoped(key, "nobody"), "nobody") is None


def test_cli_show_results_and_release_stay_in_their_tenant(
    stores: tuple[str, LeaseStore, ResultTable, str],
    redis_url: str,
    tmp_path: Path,
) -> None:
    kind, store, table, results_url = stores
    key = _key()
    held = {}
    for tenant in (A, B):
        lease = store.claim(
            scoped(key, tenant), ttl=TTL, owner_id=f"owner-{tenant}", meta={"tenant": tenant}
        )
        assert lease is not None
        held[tenant] = lease
    # one accepted result per tenant under another key string
    done = _key()
    for tenant in (A, B):
        lease = store.claim(scoped(done, tenant), ttl=TTL, meta={"tenant": tenant})
        assert lease is not None
        table.commit(lease, {"tenant": tenant}, tenant=tenant)

    c = Cluster(
        tmp_path,
        broker=redis_url,
        backend=redis_url,
        store_url=store.url,
        results_url=results_url,
        ttl=TTL,
    )
    try:
        if kind != "sqlite":
            # once through a real `celery` process: the entry point, -A, --tenant
            out = c.cli("show", key, "--tenant", A, "--json")
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["owner_id"] == f"owner-{A}"
        for tenant in (A, B):
            code, stdout, _ = c.cli_here("show", key, "--tenant", tenant, "--json")
            assert code == 0
            shown = json.loads(stdout)
            assert shown["key"] == scoped(key, tenant)
            assert (shown["owner_id"], shown["token"]) == (f"owner-{tenant}", held[tenant].token)
            assert shown["tenant"] == tenant and shown["live"] is True
            code, stdout, _ = c.cli_here("results", done, "--tenant", tenant, "--json")
            rows = json.loads(stdout)
            assert [(r["value"], r["tenant"]) for r in rows] == [({"tenant": tenant}, tenant)]
        # unscoped: neither tenant's lease nor result
        code, _, err = c.cli_here("show", key)
        assert code == 3 and "no lease on record" in err
        code, _, err = c.cli_here("results", done)
        assert code == 3 and "no accepted result" in err
        # the right key string under another tenant reads nothing
        code, _, err = c.cli_here("show", key, "--tenant", "initech")
        assert code == 3
        code, stdout, _ = c.cli_here("results", done, "--tenant", "initech", "--json")
        assert json.loads(stdout) == []

        # An operator's forced release in tenant A evicts A's holder only.
        code, stdout, err = c.cli_here("release", key, "--tenant", A, "--force", "--json")
        assert code == 0, err
        assert json.loads(stdout)["evicted"]["owner_id"] == f"owner-{A}"
        ra, rb = store.inspect(scoped(key, A)), store.inspect(scoped(key, B))
        assert ra is not None and not ra.live
        assert rb is not None and rb.live and rb.owner_id == f"owner-{B}"
        assert store.renew(held[B]) is True and store.renew(held[A]) is False
    finally:
        c.close()


# --------------------------------------------------------------------------
# real workers
# --------------------------------------------------------------------------


def test_same_key_under_two_tenants_runs_concurrently_on_real_workers(
    make_redis_server: object, pg_results: str, tmp_path: Path
) -> None:
    redis: RedisServer = make_redis_server(appendonly=False)  # type: ignore[operator]
    c = Cluster(
        tmp_path,
        broker=redis.url(0),
        backend=redis.url(1),
        store_url=redis.url(2),
        results_url=pg_results,
        ttl=5.0,
    )
    try:
        c.worker("tenants", concurrency=2).start()
        key = _key()
        # 1. the task's lease_tenant template (tenant is an argument)
        by_template = {
            tenant: c.tasks.work_for.apply_async((key, tenant), {"sleep": 1.5, "tag": tenant})
            for tenant in (A, B)
        }
        for res in by_template.values():
            res.get(timeout=40)
        # 2. the caller's header, on a task without a tenant template
        key2 = _key()
        by_header = {
            tenant: c.tasks.work.apply_async(
                (key2,), {"sleep": 1.5, "tag": tenant}, headers={"lease_tenant": tenant}
            )
            for tenant in (A, B)
        }
        results = {}
        for name, group in (("template", by_template), ("header", by_header)):
            for tenant, res in group.items():
                results[(name, tenant)] = res.get(timeout=40)

        for name, group, k in (("template", by_template, key), ("header", by_header, key2)):
            starts = {t: c.wait_row("start", r.id) for t, r in group.items()}
            ends = {t: c.wait_row("end", r.id) for t, r in group.items()}
            # both bodies ran at the same time: no conflict, no deferral
            assert max(s["t"] for s in starts.values()) < min(e["t"] for e in ends.values()), (
                name,
                starts,
                ends,
            )
            for tenant, res in group.items():
                assert len(c.rows("start", res.id)) == 1
                accepted = c.table.accepted(scoped(k, tenant), tenant)
                assert accepted is not None, (name, tenant)
                assert accepted.task_id == res.id and accepted.tenant == tenant
                assert accepted.value["tag"] == tenant
                assert accepted.token == results[(name, tenant)]["token"]
            # nothing under the bare key string
            assert c.table.accepted(k, None) is None
        assert "LEASE_DEFERRED" not in c.worker_logs()

        # The task's own reader derives the tenant from the arguments, like the worker.
        for tenant in (A, B):
            got = c.tasks.work_for.accepted(key, tenant)
            assert got is not None and got.task_id == by_template[tenant].id
        assert c.tasks.work.accepted(key2) is None  # unscoped: sees neither tenant's result

        # A bad tenant header is refused with a named error, not run unscoped:
        # at publish, and by the worker for a message from another publisher.
        with pytest.raises(LeaseScopeMismatch, match="a tenant is a non-empty string"):
            c.tasks.work.apply_async((_key(),), headers={"lease_tenant": ""})
        bad = c.app.send_task("leaseapp.work", (_key(),), headers={"lease_tenant": ""})
        _, exc = c.wait_state(bad.id, ("FAILURE",))
        assert type(exc).__name__ == "LeaseScopeMismatch"
        assert "a tenant is a non-empty string" in str(exc)
        assert c.rows("start", bad.id) == []
        wait_for(lambda: c.workers[0].alive(), 5, "worker alive")
    finally:
        c.close()
