"""The protocol defects the model found (docs/model.md, "What the model found"),
replayed on real servers: a lease store in the session's private Redis, the
fenced result table in its private PostgreSQL (behind a loopback proxy,
tests/lossy_proxy.py, that makes one read fail), the result backend in Redis.

1. *``not_done`` took an unreadable fact for "no"* (``SPARE_NOT_DONE_READS``).
   A copy of T0 (copy A, token a) runs its body; meanwhile another copy of T0
   (B) takes the key, commits its row and dies before storing SUCCESS. A's
   commit is refused, and its ``not_done`` reads the key's newest accepted row, the
   holder, and whether T0 committed, which fails (the result database
   unreachable for that one read). ``_leave_to_copy`` took the failed read
   for "T0 did not commit" and ``not_done.newer`` stored FAILURE over T0's
   accepted row (which T0's next copy then turns into SUCCESS: a flip; the
   Redis backend refuses to overwrite a SUCCESS, so B's death is the case).
   The newest row can be T0's own (B's: then no read is needed at all, it
   says T0 committed) or another task id's (T1 committed after B: then the
   failed read must defer, not fail).

``task.apply()`` runs the whole path of a leased task in this process (the
claim, the look-up, the body, the fenced commit, ``not_done``); the body
plays the other copies with a second store and table, not behind the proxy.
"""

from __future__ import annotations

import gc
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_lease import LeasedTask, LeaseStore
from celery_lease.results import ResultTable
from tests.lossy_proxy import LossyProxy
from tests.results_helpers import migrated_pg_url
from tests.servers import LOOPBACK
from tests.store_fixtures import new_key

pytestmark = pytest.mark.timeout(60)

#: The bytes of ``ResultTable.for_task``'s statement (celery_lease/sql/queries.py).
FOR_TASK = b"FROM celery_lease_results WHERE task_id"


def _port(url: str) -> int:
    return int(url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


class Cell:
    def __init__(
        self, redis_url: str, pg_url: str, proxy: LossyProxy, broker: str = "memory://"
    ) -> None:
        port = _port(pg_url)
        proxied = pg_url.replace(f":{port}/", f":{proxy.port}/", 1)
        self.proxy = proxy
        self.store = LeaseStore.from_url(redis_url)
        self.table = ResultTable(pg_url, self.store)
        name = f"findings-{uuid.uuid4().hex[:6]}"
        self.app = Celery(name, broker=broker, backend=redis_url)
        self.app.conf.update(
            lease_store_url=redis_url,
            lease_result_url=proxied,
            lease_ttl=5.0,
            task_store_eager_result=True,  # else apply() ignores results: no backend write
        )
        self.plays: list[Any] = []

        @self.app.task(
            base=LeasedTask, bind=True, shared=False, name="findings.work", lease_key="{key}"
        )
        def work(task: Any, key: str) -> dict[str, Any]:
            for play in self.plays:
                play(task, key)
            return {"copy": "A"}

        self.work = work

    def other_copy_commits(self, task_id: str, key: str, *, store_success: bool) -> int:
        """Another copy of ``task_id`` takes ``key`` from the running one (an evict
        stands for A's pause past its TTL), commits and, if asked, stores SUCCESS."""
        self.store.evict(key)
        meta = {"task_id": task_id, "task_name": self.work.name}
        lease = self.store.claim(key, owner_id=f"copy-{uuid.uuid4().hex[:6]}", ttl=30, meta=meta)
        assert lease is not None
        self.table.register(lease)
        accepted = self.table.commit(lease, {"copy": task_id}, release=True)
        assert accepted.task_id == task_id
        if store_success:
            self.app.backend.mark_as_done(task_id, {"copy": task_id})
        return lease.token

    def state(self, task_id: str) -> str:
        return str(self.app.backend.get_task_meta(task_id, cache=False)["status"])


@pytest.fixture
def cell(redis_url: str, request: pytest.FixtureRequest) -> Iterator[Cell]:
    pg_url = migrated_pg_url(request)
    with LossyProxy(LOOPBACK, _port(pg_url)) as proxy:
        c = Cell(redis_url, pg_url, proxy)
        yield c
        # The deferral's apply_async left an AsyncResult: collected while Redis runs.
        gc.collect()
        c.app.close()
        c.store.close()


@pytest.mark.parametrize("newest", ["its own", "another task id's"])
def test_a_refused_copy_never_fails_its_task_id_when_it_cannot_read_whether_it_committed(
    cell: Cell, newest: str
) -> None:
    t0 = str(uuid.uuid4())
    key = new_key("nd-reads")
    tokens: list[int] = []

    def b_commits_t0(task: Any, k: str) -> None:
        tokens.append(task.lease.token)
        tokens.append(cell.other_copy_commits(t0, k, store_success=False))

    def t1_commits_after(task: Any, k: str) -> None:
        tokens.append(cell.other_copy_commits(str(uuid.uuid4()), k, store_success=True))

    def the_read_fails(task: Any, k: str) -> None:
        cell.proxy.drop_replies(FOR_TASK)  # after A's look-up: only not_done's read

    cell.plays[:] = [b_commits_t0] + ([t1_commits_after] if newest != "its own" else [])
    cell.plays.append(the_read_fails)
    result = cell.work.apply(args=(key,), task_id=t0)
    ended = result.state
    cell.proxy.stop_dropping()
    assert tokens[0] < tokens[1], tokens  # A's token, B's (and T1's)
    assert cell.table.for_task(t0) is not None, "B's row of T0 is accepted"
    print(f"newest row {newest}: A ended {ended}; T0 in the backend: {cell.state(t0)}; "
          f"replies dropped: {len(cell.proxy.dropped)}")  # fmt: skip
    if newest != "its own":
        assert cell.proxy.dropped, "the for_task read never failed: the fault did not happen"
    # B died before storing SUCCESS: a FAILURE now is final to a client, and
    # flips to SUCCESS when T0's next copy finds its row accepted.
    assert cell.state(t0) == "PENDING", (
        "a copy that could not tell whether T0 committed wrote FAILURE over T0's accepted "
        f"row (A ended {ended})"
    )


@pytest.fixture
def held_back(redis_url: str, request: pytest.FixtureRequest) -> Iterator[Cell]:
    """A cell whose broker (Redis) marks redeliveries, so a copy without the
    mark is a first delivery: one that skips the result-backend read."""
    pg_url = migrated_pg_url(request)
    with LossyProxy(LOOPBACK, _port(pg_url)) as proxy:
        c = Cell(redis_url, pg_url, proxy, broker=redis_url)
        yield c
        gc.collect()
        c.app.close()
        c.store.close()


def test_a_task_id_celery_lease_failed_never_turns_successful(held_back: Cell) -> None:
    """2 and 4. *A FAILURE decided from reads, outdated by another copy of the
    same task id* (``SPARE_NOT_DONE_RACE``, ``SPARE_LATE_ORIGINAL``). T0's copy
    A pauses past its TTL (an evict stands for it) and T1 takes the key; A's
    commit is refused, ``not_done`` finds T1 holding the key and stores T0
    FAILURE. T0's other copy, a first delivery the broker held back, runs
    later: it skips the backend read and runs; were its commit accepted,
    SUCCESS would overwrite the FAILURE a client may already have read. A
    records T0's end before its FAILURE, so the commit refuses it."""
    cell = held_back
    t0, t1 = str(uuid.uuid4()), str(uuid.uuid4())
    key = new_key("nd-flip")
    taker: list[Any] = []
    bodies: list[int] = []

    def t1_takes_the_key(task: Any, k: str) -> None:
        bodies.append(task.lease.token)
        cell.store.evict(k)
        meta = {"task_id": t1, "task_name": cell.work.name}
        lease = cell.store.claim(k, owner_id="copy-t1", ttl=30, meta=meta)
        assert lease is not None
        cell.table.register(lease)
        taker.append(lease)

    cell.plays[:] = [t1_takes_the_key]
    cell.work.apply(args=(key,), task_id=t0)
    assert cell.state(t0) == "FAILURE", "A's refused commit ends T0 (T1 took the key)"

    cell.plays[:] = [lambda task, k: bodies.append(task.lease.token)]
    assert cell.store.release(taker[0])  # T1 is done with the key
    cell.work.apply(args=(key,), task_id=t0)  # T0's held-back first delivery
    assert len(bodies) == 2 and bodies[0] < bodies[1], "the held-back copy never ran its body"
    final = cell.state(t0)
    assert cell.table.for_task(t0) is None, f"a copy of T0 was accepted after T0 failed ({final})"
    assert final == "FAILURE", f"T0 flipped from FAILURE to {final}"
