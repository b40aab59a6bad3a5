"""The ``lease+`` backend counts each chord header member once, whichever copies end it.

Two copies of one leased task id can both reach Celery's end of a task
(``mark_as_done`` / ``mark_as_failure``, then ``on_chord_part_return``): a
stale lock-only copy that finishes after a newer copy took the key over, or a
redelivery that stores the accepted value while the committer's tracer is
still writing. Counted twice, a member would let the chord's callback go
before the last member finished. Each test ends two copies of one member, in
both orders and with Celery's own calls, then ends the other members and
checks the callback was sent once, with every member's value.

No worker: the backend is driven as the tracer drives it, with Celery's
request object carrying each copy's ``LeaseWriter`` (its token); the
callback's message is read from the in-memory broker.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, states
from celery.app.task import Context
from celery.result import AsyncResult

import celery_lease
from celery_lease.backend import WRITER_ATTR, LeaseWriter
from tests.results_helpers import backend_of

pytestmark = pytest.mark.timeout(60)

#: (first copy's token, second copy's token): the stale copy first or last.
ORDERS = {"stale-copy-first": (7, 8), "newer-copy-first": (8, 7)}


@pytest.fixture(params=["postgresql", "sqlite"])
def app(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Celery]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'chords.sqlite3'}"  # migrated on first use
    else:
        url = request.getfixturevalue("pg_url")
        celery_lease.migrate(url)
    app = Celery("chords", broker="memory://", backend=f"lease+{url}", set_as_current=False)
    yield app
    app.close()


def member_request(task_id: str, group_id: str, callback: Any, token: int) -> Context:
    req = Context(id=task_id, group=group_id, chord=callback, task="chords.member")
    setattr(req, WRITER_ATTR, LeaseWriter(token))
    return req


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("end", ["success", "failure-then-success"])
def test_a_member_ended_by_two_copies_counts_once(app: Celery, order: str, end: str) -> None:
    backend = backend_of(app)

    @app.task(name="chords.collect", shared=False)
    def collect(values: list[Any]) -> list[Any]:
        return values

    group_id, ids = str(uuid.uuid4()), [str(uuid.uuid4()) for _ in range(3)]
    callback = collect.s()
    backend.apply_chord((group_id, [AsyncResult(t, app=app) for t in ids]), callback)
    counter = backend.get_key_for_chord(group_id)
    first, second = ORDERS[order]
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        # Two copies of the first member end it, one after the other.
        if end == "failure-then-success":
            # The stale copy's error reaches Celery's end (mark_as_failure counts too).
            stale, newer = min(first, second), max(first, second)
            copies = [(stale, "failure"), (newer, "success")]
            if order == "newer-copy-first":
                copies.reverse()
        else:
            copies = [(first, "success"), (second, "success")]
        for token, how in copies:
            req = member_request(ids[0], group_id, callback, token)
            if how == "failure":
                backend.mark_as_failure(ids[0], RuntimeError("stale"), request=req)
            else:
                backend.mark_as_done(ids[0], {"token": token}, request=req)
        assert backend.get(counter) == "1", "one member, counted more than once"
        for i, tid in enumerate(ids[1:], start=1):
            backend.mark_as_done(tid, i, request=member_request(tid, group_id, callback, 5))
        message = queue.get(timeout=5)
        (values,) = message.payload[0]
        message.ack()
        with pytest.raises(queue.Empty):
            queue.get_nowait()  # the callback went once
        queue.close()
    stood = AsyncResult(ids[0], app=app)
    assert stood.state == states.SUCCESS
    assert values == [stood.result, 1, 2]
