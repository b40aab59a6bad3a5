"""Tenant isolation for every publisher, on real workers (issue 17, items 1-5).

Keys and tenant come from the task's own templates; headers are a cache that
must agree, and scope only what a task does not declare; ``lease_authorize``
runs before any look-up; internal records are out of reach of user keys; a
key crafted in the shortened shape never meets the key it imitates; a call
over the limits is refused at publish and in the worker. Each scenario is the
attack that worked before, sent the way an attacker with publish rights would
(``send_task`` with headers, as another service or language does).

Real Redis (broker, backend, lease store), PostgreSQL (results) and
``celery worker`` prefork processes (``tests/sec_cluster.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import celery_lease
from celery_lease import KeyLimitExceeded, LeaseConfigError, LeaseScopeMismatch
from celery_lease.keys import scoped, shorten, user_key
from celery_lease.task import DEFER_MARKER
from tests.sec_cluster import Cluster
from tests.servers import RedisServer, wait_for

pytestmark = pytest.mark.timeout(180)

A, B = "acme", "globex"


@pytest.fixture(scope="module")
def cluster(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    celery_lease.migrate(pg_url)
    base = Path(tmp_path_factory.mktemp("isolation"))
    server = RedisServer(base, appendonly=False)
    server.start()
    c = Cluster(
        base,
        broker=server.url(0),
        backend=server.url(1),
        store_url=server.url(2),
        results_url=pg_url,
        ttl=5.0,
        settings={"lease_defer_max": 3},
    )
    try:
        c.worker("isolation", concurrency=2).start()
        yield c
    finally:
        c.close()
        server.cleanup()


def _doc() -> str:
    return f"doc-{uuid.uuid4().hex[:8]}"


def test_a_send_task_tenant_header_scopes_the_call(cluster: Cluster) -> None:
    """Item 1: ``lease_tenant`` alone (no ``lease_keys``) was ignored: tenants shared a result."""
    c = cluster
    key = _doc()
    got = {}
    for tenant in (A, B):
        res = c.app.send_task(
            "leaseapp.work_once_return", (key,), {"tag": tenant}, headers={"lease_tenant": tenant}
        )
        got[tenant] = res.get(timeout=40)
    assert got[A]["tag"] == A and got[B]["tag"] == B, got
    for tenant in (A, B):
        accepted = c.table.accepted(scoped(key, tenant), tenant)
        assert accepted is not None and accepted.tenant == tenant
        assert accepted.value["tag"] == tenant
    assert c.table.accepted(key, None) is None, "nothing stored unscoped"


def test_a_callers_keys_header_does_not_skip_the_tenant_template(cluster: Cluster) -> None:
    """Item 1, mirror: ``apply_async(headers={"lease_keys": ...})`` dropped the tenant."""
    c = cluster
    doc = _doc()
    got = {
        tenant: c.tasks.report_for.apply_async(
            (doc, tenant), {"tag": tenant}, headers={"lease_keys": [doc]}
        ).get(timeout=40)
        for tenant in (A, B)
    }
    assert got[A]["tag"] == A and got[B]["tag"] == B, got
    for tenant in (A, B):
        accepted = c.table.accepted(scoped(doc, tenant), tenant)
        assert accepted is not None and accepted.value["tag"] == tenant
    assert c.table.accepted(doc, None) is None


def test_forged_headers_are_refused_before_anything_is_read_or_claimed(cluster: Cluster) -> None:
    """Item 2: headers naming acme's key and tenant on a globex call read acme's result,
    and against a new tenant wrote globex's value as that tenant's result."""
    c = cluster
    doc = _doc()
    mine = c.tasks.report_for.apply_async((doc, A), {"tag": "acme-secret"}).get(timeout=40)
    assert mine["tag"] == "acme-secret"

    read = c.app.send_task(
        "tenantapp.report_for",
        (doc, B),
        {"tag": "globex"},
        headers={"lease_keys": [doc], "lease_tenant": A},
    )
    write_doc = _doc()
    write = c.app.send_task(
        "tenantapp.report_for",
        (write_doc, B),
        {"tag": "globex-wrote-this"},
        headers={"lease_keys": [write_doc], "lease_tenant": "initech"},
    )
    for res in (read, write):
        state, exc = c.wait_state(res.id, ("SUCCESS", "FAILURE"))
        assert state == "FAILURE", (state, exc)
        assert type(exc).__name__ == "LeaseScopeMismatch" and "refused" in str(exc)
        assert "acme-secret" not in str(exc)
        assert c.rows("start", res.id) == []
    assert c.table.accepted(scoped(write_doc, "initech"), "initech") is None
    assert c.table.accepted(scoped(write_doc, B), B) is None
    assert c.store.inspect(scoped(write_doc, "initech")) is None, "nothing claimed"
    # The publisher's own client refuses the same headers before sending.
    with pytest.raises(LeaseScopeMismatch):
        c.tasks.report_for.apply_async((doc, B), headers={"lease_tenant": A})
    with pytest.raises(LeaseScopeMismatch):
        c.tasks.report_for.apply_async((doc, B), headers={"lease_keys": ["other"]})


def test_lease_authorize_refuses_before_the_duplicate_decision(cluster: Cluster) -> None:
    """Item 2: without forged headers, ``once`` + ``return`` handed acme's accepted value
    to any caller that produced acme's key and tenant."""
    c = cluster
    doc = _doc()
    mine = c.tasks.guarded.apply_async((doc, A), {"caller": A, "tag": "acme-secret"})
    assert mine.get(timeout=40)["tag"] == "acme-secret"
    theirs = c.tasks.guarded.apply_async((doc, A), {"caller": B, "tag": "globex"})
    state, exc = c.wait_state(theirs.id, ("SUCCESS", "FAILURE"))
    assert state == "FAILURE", (state, exc)
    assert type(exc).__name__ == "LeaseUnauthorized"
    assert "acme-secret" not in str(exc)
    accepted = c.table.accepted(scoped(doc, A), A)
    assert accepted is not None and accepted.task_id == mine.id
    assert str(accepted.token) not in str(exc)
    assert c.rows("start", theirs.id) == []
    (asked,) = c.rows("authorize", theirs.id)
    assert (asked["tenant"], asked["keys"]) == (A, [doc])


def test_a_user_key_cannot_squat_a_deferral_marker(cluster: Cluster) -> None:
    """Item 3: a task whose key was ``celery-lease/defer/<victim id>`` made the victim's
    deferral look queued: the copy was dropped, the victim stayed PENDING.
    Item 5: markers leave no fence entry and expire."""
    c = cluster
    victim_id = str(uuid.uuid4())
    marker = DEFER_MARKER + victim_id
    squatter = c.app.send_task("leaseapp.work", (marker,), {"sleep": 8.0, "tag": "squat"})
    busy = _doc()
    held = c.store.claim(busy, ttl=3.0, owner_id="test-holder")
    assert held is not None
    victim = c.tasks.work.apply_async((busy,), {"tag": "victim"}, task_id=victim_id)
    assert victim.get(timeout=60)["tag"] == "victim"
    assert "LEASE_DEFERRED" in c.worker_logs(), "the victim deferred behind the held key"
    state, exc = c.wait_state(squatter.id, ("SUCCESS", "FAILURE"))
    assert state == "FAILURE" and "reserved" in str(exc), (state, exc)
    assert c.rows("start", squatter.id) == []
    with pytest.raises(LeaseConfigError, match="reserved"):
        c.tasks.work.apply_async((marker,))

    client = redis.Redis.from_url(c.store_url)
    try:
        fences = list(client.scan_iter(match="celery-lease:fence:{celery-lease/*"))
        assert fences == [], f"fence entries for internal markers: {fences}"
        marks = list(client.scan_iter(match="celery-lease:mark:*"))
        assert marks, "the deferral was marked"
        assert all(client.pttl(m) > 0 for m in marks), "every marker expires"
    finally:
        client.close()


def test_a_key_in_the_shortened_shape_never_meets_the_key_it_imitates(cluster: Cluster) -> None:
    """Item 4: a short key equal to the shortened form of a long key passed through,
    so in ``once`` mode the crafted key's result was returned for the long key."""
    c = cluster
    long_key = "victim-" + "x" * 300 + uuid.uuid4().hex
    forged = shorten(long_key)  # the public formula: <head>~<sha256 of the key>
    assert len(forged) <= 200
    first = c.tasks.work_once_return.apply_async((forged,), {"tag": "forger"}).get(timeout=40)
    second = c.tasks.work_once_return.apply_async((long_key,), {"tag": "victim"}).get(timeout=40)
    assert first["tag"] == "forger" and second["tag"] == "victim", (first, second)
    assert second["token"] != first["token"]


def test_calls_over_the_key_limits_are_refused_at_publish_and_in_the_worker(
    cluster: Cluster,
) -> None:
    """Item 5: one claim of 20,000 keys (from a header) blocked Redis and left the keys."""
    c = cluster
    with pytest.raises(KeyLimitExceeded, match="lease_max_keys"):
        c.tasks.many.apply_async((101,))
    with pytest.raises(KeyLimitExceeded, match="lease_max_key_length"):
        c.tasks.work.apply_async(("k" * 20_000,))
    prefix = f"flood-{uuid.uuid4().hex[:6]}-"
    flood = c.app.send_task(
        "tenantapp.plain", ("x",), headers={"lease_keys": [f"{prefix}{i}" for i in range(20_000)]}
    )
    state, exc = c.wait_state(flood.id, ("SUCCESS", "FAILURE"))
    assert state == "FAILURE" and type(exc).__name__ == "KeyLimitExceeded", (state, exc)
    assert c.store.list(prefix) == [] and c.store.inspect(f"{prefix}0") is None
    assert c.rows("start", flood.id) == []
    # Within the limits, a task without templates is scoped by its headers, both read.
    ok = c.app.send_task(
        "tenantapp.plain", ("y",), headers={"lease_keys": [f"{prefix}a"], "lease_tenant": A}
    )
    assert ok.get(timeout=40)["keys"] == [scoped(f"{prefix}a", A)]
    assert c.tasks.many.apply_async((100,)).get(timeout=40) == 100


@pytest.mark.parametrize(
    ("task", "kwargs", "headers", "held"),
    [
        # The templates give keys and tenant: the retry's come from its new arguments.
        ("retry_scoped", {"tenant": A, "to_doc": "{d2}"}, None, ("{d2}", A)),
        ("retry_scoped", {"tenant": A, "to_tenant": B}, None, ("{d1}", B)),
        # A template gives the keys, a header the tenant: only the keys are recomputed.
        ("retry_keyed", {"to_doc": "{d2}"}, {"lease_tenant": A}, ("{d2}", A)),
        # No templates: the headers are the only scope, and the retry keeps them.
        (
            "retry_plain",
            {"to_doc": "{d2}"},
            {"lease_keys": ["{d1}"], "lease_tenant": A},
            ("{d1}", A),
        ),
    ],
    ids=["key-template", "tenant-template", "key-template+tenant-header", "headers-only"],
)
def test_a_retry_with_new_arguments_runs_under_the_scope_they_give(
    cluster: Cluster,
    task: str,
    kwargs: dict[str, str],
    headers: dict[str, object] | None,
    held: tuple[str, str],
) -> None:
    """``self.retry(args=..., kwargs=...)`` re-sent the first message's ``lease_keys`` /
    ``lease_tenant`` headers (Celery copies ``request.headers``) with arguments that gave
    other ones: refused as ``LeaseScopeMismatch``, so Celery rejected the retry and the
    work was lost."""
    c = cluster
    docs = {"d1": _doc(), "d2": _doc()}

    def fill(value: object) -> object:
        if isinstance(value, str):
            return value.format(**docs)
        if isinstance(value, list):
            return [fill(v) for v in value]
        return value

    call = {"doc": docs["d1"], **{k: str(fill(v)) for k, v in kwargs.items()}}
    # The task's own client: it writes the lease_keys / lease_tenant headers a retry copies.
    res = getattr(c.tasks, task).apply_async(
        kwargs=call, headers={k: fill(v) for k, v in (headers or {}).items()}
    )
    got = res.get(timeout=40)
    key, tenant = str(fill(held[0])), held[1]
    assert got == {"keys": [scoped(key, tenant)], "tries": 1}, got


@pytest.mark.parametrize("source", ["templates", "headers", "default-key"])
def test_revoke_terminate_releases_the_key_the_execution_claimed(
    cluster: Cluster, source: str
) -> None:
    """The ``task_revoked`` handler evicts the terminated task's lease under the store key
    the execution claimed, whichever source gave its keys and tenant (a long key, so
    a scope that skipped ``user_key`` would name another store key)."""
    c = cluster
    long_key = "long-" + "k" * 250 + uuid.uuid4().hex
    if source == "templates":
        res = c.tasks.work_for.apply_async((long_key, A, 30.0))
    elif source == "headers":
        res = c.tasks.sleep_plain.apply_async(
            ("x", 30.0), headers={"lease_keys": [long_key], "lease_tenant": A}
        )
    else:
        res = c.tasks.sleep_plain.apply_async((long_key, 30.0))
    start = c.wait_row("start", res.id)
    full = start.get("lease_key") or scoped(user_key(long_key), A)
    record = c.store.inspect(full)
    assert record is not None and record.live and record.task_id == res.id
    c.app.control.revoke(res.id, terminate=True)
    wait_for(
        lambda: (lambda r: r is None or not r.live)(c.store.inspect(full)),
        20,
        "the terminated task's lease evicted",
    )


def _read_result(c: Cluster, path: str, key: str, tenant: str) -> object:
    """The accepted value's tag read by one direct-key path, or None if it finds nothing."""
    import json

    if path == "accepted":
        got = c.tasks.report_for.accepted(key=key, tenant=tenant)
        return None if got is None else got.value["tag"]
    code, out, err = c.cli_here("results", key, "--tenant", tenant, "--json")
    assert code in (0, 3), (out, err)
    rows = json.loads(out) if code == 0 else []
    return rows[0]["value"]["tag"] if rows else None


@pytest.mark.parametrize("path", ["accepted", "cli-results"])
def test_a_direct_key_read_finds_the_key_the_task_stored(cluster: Cluster, path: str) -> None:
    """``accepted(key=..., tenant=...)`` and ``lease results KEY --tenant T`` scoped the key
    without ``user_key``: a tenant's long key was missed, and a key in the shortened shape
    read the result of the long key it imitates."""
    c = cluster
    long_doc = "long-" + "d" * 250 + uuid.uuid4().hex
    forged = shorten(long_doc)
    for doc, tag in ((long_doc, "long"), (forged, "forged")):
        c.tasks.report_for.apply_async((doc, A), {"tag": tag}).get(timeout=40)
    assert _read_result(c, path, long_doc, A) == "long"
    assert _read_result(c, path, forged, A) == "forged"
    assert _read_result(c, path, long_doc, B) is None


@pytest.mark.parametrize("path", ["show", "show-stored", "release"])
def test_a_direct_key_lease_command_finds_the_key_the_task_holds(
    cluster: Cluster, path: str
) -> None:
    """``lease show|release KEY --tenant T`` named a tenant's long key in another form
    than the task held it under; ``--stored`` takes the key as ``lease list`` prints it."""
    import json

    c = cluster
    long_key = "long-" + "k" * 250 + uuid.uuid4().hex
    res = c.tasks.work_for.apply_async((long_key, A, 30.0))
    c.wait_row("start", res.id)
    full = scoped(user_key(long_key), A)
    listed = json.loads(c.cli_here("list", "--tenant", A, "--json")[1])
    assert full in {r["key"] for r in listed}
    try:
        if path == "release":
            code, out, err = c.cli_here("release", long_key, "--tenant", A, "--force", "--json")
            assert code == 0 and json.loads(out)["evicted"]["task_id"] == res.id, (out, err)
            return
        args = (
            ("show", full, "--stored")
            if path == "show-stored"
            else ("show", long_key, "--tenant", A)
        )
        code, out, err = c.cli_here(*args, "--json")
        assert code == 0, (out, err)
        assert json.loads(out)["task_id"] == res.id
        # The stored form is not a task's key: read as one, it names another key.
        assert c.cli_here("show", full, "--tenant", A)[0] == 3
    finally:
        c.app.control.revoke(res.id, terminate=True)


def test_a_negative_deferrals_header_does_not_escape_lease_defer_max(cluster: Cluster) -> None:
    """Item 7: ``lease_deferrals=-1000`` must not buy a thousand extra deferrals."""
    c = cluster
    busy = _doc()
    with c.store.hold(busy, ttl=2.0):  # held (and renewed) throughout: every claim conflicts
        res = c.app.send_task(
            "leaseapp.work", (busy,), headers={"lease_keys": [busy], "lease_deferrals": -1000}
        )
        state, exc = c.wait_state(res.id, ("SUCCESS", "FAILURE"), timeout=90)
    assert state == "FAILURE" and type(exc).__name__ == "LeaseNotAcquired", (state, exc)
    assert c.rows("start", res.id) == []
    deferred = c.worker_logs().count(f"LEASE_DEFERRED {res.id}")
    assert deferred == 3, f"{deferred} deferrals, lease_defer_max is 3"


# -- what one tenant sees of another: the CLI, failure messages, events -----------


def test_cli_show_results_and_list_of_one_tenant_show_nothing_of_another(
    cluster: Cluster,
) -> None:
    """The same key string for two tenants: each tenant's ``show`` / ``results`` /
    ``list --tenant`` names its own task, token and result, never the other's."""
    import json

    c = cluster
    doc, key = _doc(), f"held-{uuid.uuid4().hex[:8]}"
    done = {t: c.tasks.report_for.delay(doc, t, tag=f"tag-{t}").get(timeout=40) for t in (A, B)}
    holding = {t: c.tasks.work_for.delay(key, t, 15.0, tag=f"hold-{t}") for t in (A, B)}
    started = {t: c.wait_row("start", holding[t].id) for t in (A, B)}
    try:
        seen: dict[str, dict[str, str]] = {}
        for t in (A, B):
            # The CLI in this process (click, parsed by Celery's own group): six
            # interpreter starts would outlast the holders' leases.
            out = {
                "results": c.cli_here("results", doc, "--tenant", t, "--json"),
                "show": c.cli_here("show", key, "--tenant", t, "--json"),
                "list": c.cli_here("list", "--tenant", t, "--json"),
            }
            for name, (code, stdout, stderr) in out.items():
                assert code == 0, (name, stdout, stderr)
            seen[t] = {name: stdout + stderr for name, (_, stdout, stderr) in out.items()}
            results = json.loads(out["results"][1])
            assert [r["tenant"] for r in results] == [t]
            assert results[0]["value"]["tag"] == f"tag-{t}"
            record = json.loads(out["show"][1])
            assert record["tenant"] == t and record["task_id"] == holding[t].id, record
            assert record["token"] == int(started[t]["token"])
            listed = json.loads(out["list"][1])
            assert listed and {r["tenant"] for r in listed} == {t}, listed
            assert holding[t].id in {r["task_id"] for r in listed}
        for t, other in ((A, B), (B, A)):
            text = "\n".join(seen[t].values())
            for foreign in (
                holding[other].id,
                str(started[other]["token"]),
                str(done[other]["token"]),
                f"tag-{other}",
                f":{other}/",
            ):
                assert foreign not in text, f"tenant {t}'s CLI output shows {foreign!r}:\n{text}"
        # Unscoped, the key is nobody's: an unscoped caller sees neither tenant's.
        assert c.cli_here("show", key)[0] == 3
        assert c.cli("results", doc).returncode == 3  # and once as a real subprocess
    finally:
        for r in holding.values():
            r.get(timeout=60)


def test_conflict_duplicate_messages_and_events_carry_nothing_of_another_tenant(
    cluster: Cluster,
) -> None:
    """Tenant A's conflict and duplicate failures (the exceptions its caller gets)
    and every LEASE_* event of A's tasks, as an event receiver reads them from
    the broker, name A's holder and token only: tenant B holds the same key
    string at the same time and has an accepted result for it."""
    import json

    from tests.event_capture import EventCapture

    c = cluster
    if len(c.workers) < 2:
        c.worker("isolation-2", concurrency=2).start()  # room for both holders and both callers
    doc = _doc()
    with EventCapture(c.app) as events:
        hold = {t: c.tasks.once_for.delay(doc, t, 8.0, tag=f"hold-{t}") for t in (A, B)}
        for t in (A, B):
            c.wait_row("start", hold[t].id)
        holders = {t: c.store.inspect(scoped(doc, t)) for t in (A, B)}
        for t in (A, B):
            assert holders[t] is not None and holders[t].task_id == hold[t].id  # type: ignore[union-attr]
        # While both hold: A's second call meets A's holder (reject on conflict).
        conflict = c.tasks.once_for.delay(doc, A, 0.0, tag="conflict-A")
        with pytest.raises(celery_lease.LeaseNotAcquired) as conflict_info:
            conflict.get(timeout=40)
        for r in hold.values():
            r.get(timeout=60)
        # Both accepted: A's third call is a duplicate of A's result.
        duplicate = c.tasks.once_for.delay(doc, A, 0.0, tag="duplicate-A")
        with pytest.raises(celery_lease.DuplicateResult) as duplicate_info:
            duplicate.get(timeout=40)
        ids = {hold[A].id, conflict.id, duplicate.id}
        wanted = {"task-LEASE_REJECTED"}
        got = wait_for_events(events, ids, wanted)
    mine, theirs = holders[A], holders[B]
    assert mine is not None and theirs is not None
    messages = {
        "conflict": str(conflict_info.value),
        "duplicate": str(duplicate_info.value),
        "events": json.dumps(got, default=str),
    }
    # Proof: A's own key was met, held (the conflict) and then accepted (the duplicate).
    assert conflict_info.value.key == scoped(doc, A), messages
    assert duplicate_info.value.key == scoped(doc, A), messages
    assert {e["type"] for e in got if e["uuid"] in (conflict.id, duplicate.id)} == {
        "task-LEASE_REJECTED"
    }, got
    for name, text in messages.items():
        for foreign in (theirs.owner_id, hold[B].id, str(theirs.token), f"hold-{B}", f":{B}/"):
            assert foreign not in text, f"A's {name} shows B's {foreign!r}:\n{text}"


def wait_for_events(events: object, ids: set[str], types: set[str]) -> list[dict[str, object]]:
    """Every LEASE_*/FENCED event of ``ids``, once those of ``types`` arrived for the callers."""
    from tests.servers import wait_for

    def ready() -> list[dict[str, object]] | None:
        got = [e for e in events.snapshot() if e.get("uuid") in ids]  # type: ignore[attr-defined]
        kinds = {str(e["type"]) for e in got}
        return got if types <= kinds and len([e for e in got if e["type"] in types]) >= 2 else None

    got = wait_for(ready, 40, f"events {types} of {ids}")
    return [e for e in got if str(e["type"]).startswith(("task-LEASE", "task-FENCED"))]
