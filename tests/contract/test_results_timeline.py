"""The canonical failure timeline against the fenced result table, without Celery.

DESIGN.md: A claims (token 7), pauses past its lease; the lease expires and B
claims (token 8); B commits; A resumes and its commit with token 7 is
rejected. B's result stands.

Every test runs for each pairing of lease store and result database
(``redis+pg``, ``redis+sqlite`` and ``sqlite+pg``: the register/lock path; ``pg+pg`` and
``sqlite+sqlite``: the one-transaction path) and, where the mode matters,
for both modes. Leases
lapse for real (a 1 s TTL, proven with ``store.inspect``), never by faking a
clock.
"""

from __future__ import annotations

import pytest

from celery_lease import DuplicateResult, Lease, StaleFencingToken
from celery_lease.results import AcceptedResult
from tests.results_helpers import (
    Pairing,
    new_key,
    result_rows,
    wait_until_expired,
)

TTL = 1.0
LONG_TTL = 30.0

pytestmark = pytest.mark.timeout(60)


def claim(p: Pairing, key: str, owner: str, ttl: float = LONG_TTL, **meta: str) -> Lease:
    """Claim ``key`` for ``owner`` and register the token, as a worker does before its body."""
    lease = p.store.claim(key, ttl=ttl, owner_id=owner, meta=meta or None)
    assert lease is not None, f"{owner} could not claim {key}: {p.store.inspect(key)}"
    p.table.register(lease)
    return lease


def a_expires_b_takes_over(p: Pairing, key: str) -> tuple[Lease, Lease]:
    """A claims with a short TTL and lapses (proven); B claims a larger token."""
    a = claim(p, key, "owner-A", ttl=TTL)
    intruder = p.store.claim(key, ttl=LONG_TTL, owner_id="intruder")
    if intruder is not None:
        # Only possible on a machine so slow that A's second already ran out.
        assert intruder.acquired_at >= a.expires_at, "granted while A's lease was live"
        assert p.store.release(intruder)
    wait_until_expired(p.store, a)
    b = claim(p, key, "owner-B")
    assert b.token > a.token
    record = p.store.inspect(key)
    assert record is not None and record.live and record.owner_id == "owner-B"
    assert record.token == b.token
    return a, b


def test_stale_owner_refused_after_new_owner_committed(pairing: Pairing, mode: str) -> None:
    key = new_key("timeline")
    a, b = a_expires_b_takes_over(pairing, key)

    task_a, task_b = new_key("task-A"), new_key("task-B")
    accepted_b = pairing.table.commit(b, {"by": "B"}, mode=mode, task_id=task_b)
    assert (accepted_b.key, accepted_b.token, accepted_b.owner_id) == (key, b.token, "owner-B")
    assert accepted_b.value == {"by": "B"}

    # A resumes and commits with its old token: refused, nothing written.
    with pytest.raises(StaleFencingToken) as refused:
        pairing.table.commit(a, {"by": "A"}, mode=mode, task_id=task_a)
    assert refused.value.key == key
    assert refused.value.token == a.token
    assert refused.value.current is not None and refused.value.current >= b.token
    assert not isinstance(refused.value, DuplicateResult)

    rows = result_rows(pairing.result_url, key)
    assert [(token, owner) for _, token, owner in rows] == [(b.token, "owner-B")]
    newest = pairing.table.accepted(key)
    assert newest is not None and newest.token == b.token and newest.value == {"by": "B"}
    assert pairing.table.for_task(task_a) is None
    found = pairing.table.for_task(task_b)
    assert found is not None and found.token == b.token


def test_stale_owner_refused_while_new_owner_still_works(pairing: Pairing, mode: str) -> None:
    """The overlap: A commits after B claimed but before B commits. A fence that
    only compared with the highest *committed* token would accept A here."""
    key = new_key("overlap")
    a, b = a_expires_b_takes_over(pairing, key)

    with pytest.raises(StaleFencingToken) as refused:
        pairing.table.commit(a, {"by": "A"}, mode=mode)
    assert refused.value.token == a.token
    assert result_rows(pairing.result_url, key) == [], "A's refused commit wrote nothing"
    if not pairing.table.colocated:
        # A late registration of the old token is refused too.
        with pytest.raises(StaleFencingToken):
            pairing.table.register(a)
        assert pairing.table.fence(key) == b.token

    # B, still the owner, is accepted afterwards; A's refusal did not disturb it.
    record = pairing.store.inspect(key)
    assert record is not None and record.live and record.owner_id == "owner-B"
    accepted_b = pairing.table.commit(b, {"by": "B"}, mode=mode)
    assert accepted_b.token == b.token
    rows = result_rows(pairing.result_url, key)
    assert [(token, owner) for _, token, owner in rows] == [(b.token, "owner-B")]


def test_third_owner_after_accepted_result(pairing: Pairing, mode: str) -> None:
    """once: C is a duplicate, one row stays. exclusive: C is accepted, tokens grow."""
    key = new_key("third")
    a, b = a_expires_b_takes_over(pairing, key)
    pairing.table.commit(b, {"by": "B"}, mode=mode)
    with pytest.raises(StaleFencingToken):
        pairing.table.commit(a, {"by": "A"}, mode=mode)

    c = claim(pairing, key, "owner-C")  # B's commit released the key
    assert c.token > b.token
    if mode == "once":
        with pytest.raises(DuplicateResult) as duplicate:
            pairing.table.commit(c, {"by": "C"}, mode=mode)
        assert duplicate.value.key == key
        assert duplicate.value.accepted_token == b.token
        rows = result_rows(pairing.result_url, key)
        assert [(token, owner) for _, token, owner in rows] == [(b.token, "owner-B")]
        newest = pairing.table.accepted(key)
        assert newest is not None and newest.token == b.token
        # A duplicate does not keep the key locked: its lease was released.
        record = pairing.store.inspect(key)
        assert record is None or not record.live, record
    else:
        accepted_c = pairing.table.commit(c, {"by": "C"}, mode=mode)
        assert accepted_c.token == c.token
        rows = result_rows(pairing.result_url, key)
        assert [(token, owner) for _, token, owner in rows] == [
            (b.token, "owner-B"),
            (c.token, "owner-C"),
        ]
        tokens = [token for _, token, _ in rows]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
        newest = pairing.table.accepted(key)
        assert newest is not None
        assert (newest.token, newest.owner_id, newest.value) == (c.token, "owner-C", {"by": "C"})
        assert [r.token for r in pairing.table.history(key)] == [c.token, b.token]


def test_for_task_finds_the_committing_task(pairing: Pairing) -> None:
    key = new_key("for-task")
    meta_id, explicit_id = new_key("task-meta"), new_key("task-explicit")
    first = claim(pairing, key, "owner-1", task_id=meta_id, task_name="proj.job")
    pairing.table.commit(first, [1, 2, 3])
    second = claim(pairing, key, "owner-2")
    pairing.table.commit(second, {"n": 2}, task_id=explicit_id, task_name="proj.other")

    found = pairing.table.for_task(meta_id)
    assert found is not None
    assert (found.key, found.token, found.owner_id) == (key, first.token, "owner-1")
    assert (found.value, found.task_name) == ([1, 2, 3], "proj.job")
    found = pairing.table.for_task(explicit_id)
    assert found is not None and found.token == second.token and found.value == {"n": 2}
    assert found.task_name == "proj.other"
    assert pairing.table.for_task("no-such-task") is None


def test_commit_releases_the_lease(pairing: Pairing, mode: str) -> None:
    key = new_key("release")
    a = claim(pairing, key, "owner-A")
    pairing.table.commit(a, "done", mode=mode)

    record = pairing.store.inspect(key)
    assert record is None or not record.live, f"commit must release the lease: {record}"
    assert pairing.store.renew(a) is False
    nxt = pairing.store.claim(key, ttl=LONG_TTL, owner_id="owner-next")
    assert nxt is not None and nxt.token > a.token, "a claim right after the commit succeeds"


def test_commit_without_release_keeps_the_lease(pairing: Pairing, mode: str) -> None:
    key = new_key("keep")
    a = claim(pairing, key, "owner-A")
    accepted_a = pairing.table.commit(a, "done", mode=mode, release=False)
    assert accepted_a.token == a.token

    record = pairing.store.inspect(key)
    assert record is not None and record.live and record.owner_id == "owner-A"
    assert record.token == a.token
    assert pairing.store.claim(key, ttl=LONG_TTL, owner_id="owner-other") is None
    assert pairing.store.renew(a) is True
    assert pairing.store.release(a) is True
    nxt = pairing.store.claim(key, ttl=LONG_TTL, owner_id="owner-other")
    assert nxt is not None and nxt.token > a.token


@pytest.mark.parametrize("release", [True, False], ids=["release", "keep"])
def test_retried_commit_returns_the_accepted_result(
    pairing: Pairing, mode: str, release: bool
) -> None:
    """A commit retried after its reply was lost returns the row it wrote."""
    key = new_key("retry")
    a = claim(pairing, key, "owner-A")
    first = pairing.table.commit(a, {"v": "é", "n": [1, None]}, mode=mode, release=release)
    again = pairing.table.commit(a, {"v": "é", "n": [1, None]}, mode=mode, release=release)
    assert isinstance(again, AcceptedResult)
    assert again == first
    assert [t for _, t, _ in result_rows(pairing.result_url, key)] == [a.token]


def test_retried_commit_after_takeover_returns_the_accepted_result(
    pairing: Pairing, mode: str
) -> None:
    """Even once the lease lapsed and a newer owner claimed, a retry of an
    accepted commit reports the acceptance, not StaleFencingToken."""
    key = new_key("retry-late")
    a = claim(pairing, key, "owner-A", ttl=TTL)
    first = pairing.table.commit(a, {"by": "A"}, mode=mode, release=False)
    wait_until_expired(pairing.store, a)
    b = claim(pairing, key, "owner-B")
    assert b.token > a.token
    again = pairing.table.commit(a, {"by": "A"}, mode=mode)
    assert again == first
    # B, the owner now, is unaffected by A's retry.
    record = pairing.store.inspect(key)
    assert record is not None and record.live and record.owner_id == "owner-B"
    assert [t for _, t, _ in result_rows(pairing.result_url, key)] == [a.token]
