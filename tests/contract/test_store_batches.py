"""The lease-store contract for batches, repeats and fork, on every store (real servers).

Three properties a store must keep whatever its transport: a batch of many
leases renews and releases like one (etcd splits its transactions to stay
within the server's limit); a repeated release of the same grant by its
owner answers True (a retry after a lost reply is not a lost lease); and a
store object used in a parent keeps answering correctly in forked children
(no connection shared across processes, so no reply crosses to the wrong
process).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections.abc import Iterator

import pytest

from celery_lease import LeaseStore
from tests.etcd_cluster import etcd_cluster, etcd_url  # noqa: F401 - fixtures
from tests.store_fixtures import ALL_STORE_KINDS, new_key, store_url

pytestmark = pytest.mark.timeout(120)

A = "worker-a:1:aaaa"
B = "worker-b:2:bbbb"


@pytest.fixture(params=ALL_STORE_KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[LeaseStore]:
    s = LeaseStore.from_url(store_url(request, request.param))
    try:
        yield s
    finally:
        s.close()


def test_200_separate_leases_renew_and_release_in_batches(store: LeaseStore) -> None:
    leases = [store.claim(new_key("b"), owner_id=A, ttl=30) for _ in range(200)]
    assert all(lease is not None for lease in leases)
    answers = store.renew_many(leases)  # type: ignore[arg-type]
    assert all(a is not None for a in answers)
    assert store.release(leases[3]) is True  # type: ignore[arg-type]
    answers = store.renew_many(leases)  # type: ignore[arg-type]
    assert [i for i, a in enumerate(answers) if a is None] == [3]
    assert all(store.release(lease) for lease in leases)  # type: ignore[arg-type]


def test_a_64_key_lease_is_one_grant_from_claim_to_release(store: LeaseStore) -> None:
    keys = [new_key("w") for _ in range(64)]
    lease = store.claim(keys, owner_id=A, ttl=30)
    assert lease is not None
    assert store.claim(keys[-1], owner_id=B, ttl=30) is None
    assert store.renew(lease) is True
    assert store.release(lease) is True
    records = [store.inspect(k) for k in keys]
    assert all(r is None or not r.live for r in records)


@pytest.mark.parametrize("width", [1, 3])
def test_a_repeated_release_by_the_owner_answers_true(store: LeaseStore, width: int) -> None:
    keys = [new_key("rr") for _ in range(width)]
    lease = store.claim(keys, owner_id=A, ttl=30)
    assert lease is not None
    assert store.release(lease) is True
    assert store.release(lease) is True, "the same owner and token releasing again"
    assert store.renew(lease) is False
    assert store.release(dataclasses.replace(lease, owner_id=B)) is False
    assert store.release(dataclasses.replace(lease, token=lease.token + 1)) is False
    taker = store.claim(keys, owner_id=B, ttl=30)
    assert taker is not None and taker.token > lease.token
    assert store.release(lease) is False, "another owner holds it now"
    assert store.release(taker) is True


CHILDREN = 4
ROUNDS = 40


def _child_work(store: LeaseStore, name: str, parent_key: str, parent_token: int) -> str | None:
    """Claim/inspect/renew/release own keys; None if every answer was this process's own."""
    for i in range(ROUNDS):
        key = f"{name}-{i}"
        lease = store.claim(key, owner_id=name, ttl=30)
        if lease is None:
            return f"claim of {key} refused"
        record = store.inspect(key)
        if record is None or (record.key, record.owner_id, record.token) != (
            key,
            name,
            lease.token,
        ):
            return f"inspect({key}) answered {record}"
        if store.renew(lease) is not True:
            return f"renew of {key} failed"
        shared = store.inspect(parent_key)
        if shared is None or (shared.owner_id, shared.token) != (A, parent_token):
            return f"inspect({parent_key}) answered {shared}"
        if store.release(lease) is not True:
            return f"release of {key} failed"
    return None


def test_a_store_used_in_the_parent_answers_correctly_in_forked_children(
    store: LeaseStore,
) -> None:
    parent_key = new_key("parent")
    held = store.claim(parent_key, owner_id=A, ttl=60)
    assert held is not None
    assert store.inspect(parent_key) is not None  # the parent's connection is open and idle
    base = new_key("fork")
    children: list[tuple[int, int]] = []
    for c in range(CHILDREN):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report and exit, never return into pytest
            code = 1
            try:
                os.close(read)
                signal.alarm(90)
                problem = _child_work(store, f"{base}-c{c}", parent_key, held.token)
                os.write(write, json.dumps(problem).encode())
                code = 0
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                os.write(write, json.dumps(f"{type(e).__name__}: {e}"[:500]).encode())
            finally:
                os._exit(code)
        os.close(write)
        children.append((pid, read))
    # The parent keeps using the same store meanwhile.
    problems = [_child_work(store, f"{base}-p", parent_key, held.token)]
    for pid, read in children:
        chunks = []
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
        os.close(read)
        _, status = os.waitpid(pid, 0)
        report = json.loads(b"".join(chunks) or b'"no report (killed?)"')
        problems.append(report if os.waitstatus_to_exitcode(status) == 0 or report else "died")
    assert problems == [None] * (CHILDREN + 1), problems
    assert store.release(held) is True
