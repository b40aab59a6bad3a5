"""The revoke handler never evicts an owner that claimed after it read the lease.

``revoke(terminate=True)``: Celery sends SIGTERM to the child, then runs the
``task_revoked`` handler in the main process, which reads each key's lease
and, if it still names the terminated task, evicts it. Between the read and
the evict the child may still commit and release, and a new task claim the
key. The handler (:func:`celery_lease.signals.release_terminated`) is run here
on real stores with exactly that interleaving: the store's ``inspect`` is
followed, before the handler goes on, by the old owner's release and a new
owner's claim through another real connection. The new owner must keep its
lease (invariant 3: only the owner releases).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from celery_lease import Lease, LeaseRecord, LeaseStore
from celery_lease.signals import release_terminated
from tests.store_fixtures import STORE_KINDS, new_key, store_url

pytestmark = pytest.mark.timeout(60)

TERMINATED = "task-terminated"


def interleaving(url: str, after_inspect: Callable[[], None]) -> LeaseStore:
    """A real store of ``url`` that runs ``after_inspect`` once, right after its
    first ``inspect`` answered (the window between the handler's read and its evict)."""
    probe = LeaseStore.from_url(url)
    base = type(probe)
    probe.close()
    pending = [after_inspect]

    class Interleaving(base):  # type: ignore[valid-type,misc]
        def inspect(self, key: str) -> LeaseRecord | None:
            record = super().inspect(key)
            while pending:
                pending.pop()()
            return record

    return Interleaving(url)  # type: ignore[no-any-return]


@pytest.fixture(params=STORE_KINDS)
def url(request: pytest.FixtureRequest) -> str:
    return store_url(request, request.param)


@pytest.fixture
def other(url: str) -> Iterator[LeaseStore]:
    store = LeaseStore.from_url(url)
    yield store
    store.close()


def test_the_handler_does_not_evict_an_owner_that_claimed_after_its_read(
    url: str, other: LeaseStore
) -> None:
    key = new_key("revoked")
    old = other.claim(key, ttl=30, owner_id="child-1", meta={"task_id": TERMINATED})
    assert old is not None
    taken: list[Lease] = []

    def child_finishes_and_a_new_task_claims() -> None:
        assert other.release(old) is True
        new = other.claim(key, ttl=30, owner_id="child-2", meta={"task_id": "task-new"})
        assert new is not None
        taken.append(new)

    handler_store = interleaving(url, child_finishes_and_a_new_task_claims)
    try:
        evicted = release_terminated(handler_store, [key], None, TERMINATED)
    finally:
        handler_store.close()
    assert taken, "the interleaving did not run: the handler never read the lease"
    new = taken[0]
    record = other.inspect(key)
    assert record is not None
    assert (record.owner_id, record.token, record.task_id, record.live) == (
        "child-2",
        new.token,
        "task-new",
        True,
    ), f"the handler evicted the new owner: {record}"
    assert evicted == []
    assert other.renew(new) is True, "the new owner can no longer renew"
    assert other.fence_token(key) == new.token, "the handler advanced the fence past the new owner"


def test_the_handler_evicts_the_terminated_tasks_own_lease(url: str, other: LeaseStore) -> None:
    key, mine = new_key("revoked"), new_key("not-mine")
    old = other.claim(key, ttl=30, owner_id="child-1", meta={"task_id": TERMINATED})
    theirs = other.claim(mine, ttl=30, owner_id="child-3", meta={"task_id": "task-other"})
    assert old is not None and theirs is not None
    handler_store = LeaseStore.from_url(url)
    try:
        assert release_terminated(handler_store, [key, mine], None, TERMINATED) == [key]
    finally:
        handler_store.close()
    record = other.inspect(key)
    assert record is not None and not record.live
    assert other.renew(old) is False and other.fence_token(key) > old.token
    assert other.renew(theirs) is True, "the handler evicted another task's lease"
