"""A chord whose last header member died between its count and the callback's publish
is finished by a worker's look for chords due their callback (``lease+`` backend).

No worker here: the backend is driven as Celery's tracer drives it (``mark_as_done``
counts a member and, for the last one, publishes the callback), on PostgreSQL and
SQLite, with a real Redis broker whose queue the callback's message is read from.
The death is the state it leaves: the last member's SUCCESS stored and its count
made, as Celery's ``on_chord_part_return`` makes it (the header restored, then
``incr``), and nothing after. tests/acceptance/test_chord_crash.py kills a real
worker there.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, states
from celery.app.task import Context
from celery.exceptions import ChordError
from celery.result import AsyncResult, GroupResult
from kombu.simple import SimpleQueue
from sqlalchemy import text

import celery_lease
from celery_lease import backend_chords
from celery_lease.backend import LeaseBackend
from celery_lease.exceptions import StoreUnavailable
from tests.results_helpers import backend_of
from tests.servers import PostgresServer

pytestmark = [pytest.mark.timeout(60), pytest.mark.redis]


@dataclass
class Chord:
    app: Celery
    backend: LeaseBackend
    group_id: str
    ids: list[str]
    callback: Any
    queue: SimpleQueue

    @property
    def counter(self) -> str:
        return str(self.backend.get_key_for_chord(self.group_id))

    def request(self, task_id: str) -> Context:
        return Context(id=task_id, group=self.group_id, chord=self.callback, task="due.member")

    def end(self, i: int, value: Any) -> None:
        """Celery's end of member ``i``: its SUCCESS stored and counted (the last one
        publishes the callback)."""
        self.backend.mark_as_done(self.ids[i], value, request=self.request(self.ids[i]))

    def die_after_count(self, i: int, value: Any, state: str = states.SUCCESS) -> None:
        """Member ``i``'s end up to its count, as Celery makes it, and nothing after."""
        req = self.request(self.ids[i])
        self.backend.store_result(self.ids[i], value, state, request=req)
        with backend_chords.counting(req):
            GroupResult.restore(self.group_id, backend=self.backend)
            self.backend.incr(self.counter)

    def due_rows(self) -> list[Any]:
        with self.backend.db.read() as conn:
            return list(conn.execute(text("SELECT * FROM celery_lease_chord_due")).all())

    def messages(self) -> list[Any]:
        """The callback messages on the broker, taken off it."""
        out = []
        while True:
            try:
                message = self.queue.get(timeout=0.5)
            except self.queue.Empty:
                return out
            message.ack()
            out.append(message)


@pytest.fixture(params=["postgresql", "sqlite"])
def chord(
    request: pytest.FixtureRequest, fresh_redis: Callable[[], str], tmp_path: Path
) -> Iterator[Chord]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'due.sqlite3'}"  # migrated on first use
    else:
        url = request.getfixturevalue("pg_url")
        celery_lease.migrate(url)
    yield from make_chord(url, fresh_redis())


def make_chord(url: str, broker: str, **conf: Any) -> Iterator[Chord]:
    """A chord of three members over the ``lease+`` backend on ``url``, applied."""
    app = Celery("due", broker=broker, backend=f"lease+{url}", set_as_current=False)
    app.conf.update(conf)

    @app.task(name="due.collect", shared=False)
    def collect(values: list[Any]) -> list[Any]:
        return values

    backend = backend_of(app)
    with backend.db.transaction() as conn:  # the module's database: no chord of another test
        conn.execute(text("DELETE FROM celery_lease_chord_due"))
    group_id, ids = str(uuid.uuid4()), [str(uuid.uuid4()) for _ in range(3)]
    callback = collect.s().set(task_id=str(uuid.uuid4()))
    backend.apply_chord((group_id, [AsyncResult(t, app=app) for t in ids]), callback)
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        yield Chord(app, backend, group_id, ids, callback, queue)
        queue.close()
    app.close()


def test_celerys_publish_clears_what_the_last_count_marked(chord: Chord) -> None:
    chord.end(0, "a")
    chord.end(1, "b")
    assert chord.due_rows() == [], "due before the last count"
    chord.end(2, "c")
    (message,) = chord.messages()
    assert message.payload[0] == [["a", "b", "c"]]
    assert chord.due_rows() == [], "the published chord is still due"
    assert backend_chords.recover(chord.backend, 0.0) == 0
    assert chord.messages() == []


def test_a_last_member_dead_before_the_publish_leaves_its_chord_to_a_worker(
    chord: Chord,
) -> None:
    chord.end(0, "a")
    chord.end(1, "b")
    chord.die_after_count(2, "c")
    # The fault's state: every member counted, nothing published, the chord due.
    assert chord.backend.get(chord.counter) == "3"
    assert chord.messages() == []
    (row,) = chord.due_rows()
    assert (row.key, row.group_id) == (chord.counter, chord.group_id)

    # Within the publish window the last member may still be publishing: left alone.
    assert backend_chords.recover(chord.backend, 60.0) == 0
    assert chord.messages() == [] and len(chord.due_rows()) == 1

    assert backend_chords.recover(chord.backend, 0.0) == 1
    (message,) = chord.messages()
    assert message.headers["id"] == chord.callback.id, "the callback's own task id"
    assert message.payload[0] == [["a", "b", "c"]], "the header's values, in order"
    assert chord.due_rows() == []
    assert chord.backend.get(chord.counter) is None, "the chord was not cleaned up"
    assert chord.backend.restore_group(chord.group_id, cache=False) is None
    assert backend_chords.recover(chord.backend, 0.0) == 0
    assert chord.messages() == [], "the callback went twice"


def test_a_chord_due_is_claimed_by_one_worker_at_a_time(chord: Chord) -> None:
    chord.end(0, "a")
    chord.end(1, "b")
    chord.die_after_count(2, "c")
    db = chord.backend.db
    claim = {"grace": 0.0, "hold": 60.0}
    with db.transaction() as conn:
        first = conn.execute(db.sql.chord_due_claim, claim).first()
    with db.transaction() as conn:
        second = conn.execute(db.sql.chord_due_claim, claim).first()
    assert first is not None and first.key == chord.counter
    assert second is None, "two workers claimed one chord"
    assert backend_chords.recover(chord.backend, 0.0) == 0, "a claimed chord was taken over"
    assert chord.messages() == []


def test_a_failed_member_fails_the_callback_instead(chord: Chord) -> None:
    chord.end(0, "a")
    chord.end(1, "b")
    chord.die_after_count(2, RuntimeError("boom"), states.FAILURE)
    assert backend_chords.recover(chord.backend, 0.0) == 1
    assert chord.messages() == [], "a callback published over a failed header"
    failed = AsyncResult(chord.callback.id, app=chord.app)
    assert failed.state == states.FAILURE
    assert isinstance(failed.result, ChordError) and "boom" in str(failed.result)
    assert chord.due_rows() == []


def test_a_chord_whose_group_is_gone_is_no_longer_due(chord: Chord) -> None:
    """Celery deletes the header's group right after the publish, before the
    counter: a member that died in between had published the callback."""
    chord.end(0, "a")
    chord.end(1, "b")
    chord.die_after_count(2, "c")
    chord.backend.delete_group(chord.group_id)
    assert backend_chords.recover(chord.backend, 0.0) == 0
    assert chord.messages() == []
    assert chord.due_rows() == []


def test_the_cleanup_sweeps_the_due_rows_of_expired_chords(chord: Chord) -> None:
    chord.end(0, "a")
    chord.end(1, "b")
    chord.die_after_count(2, "c")
    with chord.backend.db.transaction() as conn:
        conn.execute(text("UPDATE celery_lease_chord_due SET expires_at = 0"))
    assert backend_chords.recover(chord.backend, 0.0) == 0, "an expired chord was finished"
    chord.backend.cleanup()
    assert chord.due_rows() == []


def test_a_database_outage_during_the_join_leaves_the_chord_due_not_failed(
    make_pg_server: Callable[..., PostgresServer], fresh_redis: Callable[[], str]
) -> None:
    """The recovery cannot read the header because the database is down, not because a
    member failed: it fails nothing, the chord stays due, and a later look publishes
    the callback. (Taking the join's error for a member's, the backend's retries,
    spanning the outage here, wrote the callback's ChordError once it was back.)"""
    pg = make_pg_server()
    url = pg.create_database("due")
    celery_lease.migrate(url)
    # The backend's retries span the outage; its cache (off by default) keeps the
    # header's group, so the outage meets the recovery at the join, after the
    # group's read, as a blip between the two would.
    made = make_chord(url, fresh_redis(), result_backend_max_retries=100, result_cache_max=100)
    chord = next(made)
    try:
        chord.end(0, "a")
        chord.end(1, "b")
        chord.die_after_count(2, "c")  # the header's group is now in the backend's cache
        db = chord.backend.db
        with db.transaction() as conn:
            row = conn.execute(db.sql.chord_due_claim, {"grace": 0.0, "hold": 0.0}).first()
        assert row is not None
        pg.stop("immediate")
        with pytest.raises(StoreUnavailable):  # the fault is real: the database is down
            chord.backend.get(chord.counter)
        back = threading.Timer(1.0, pg.start)
        back.start()
        try:
            with pytest.raises(chord.backend.connection_errors):
                backend_chords._finish(chord.backend, row)
        finally:
            back.join()
        callback = AsyncResult(chord.callback.id, app=chord.app)
        assert callback.state == states.PENDING, "the chord was failed by an outage"
        assert backend_chords.recover(chord.backend, 0.0) == 1
        (message,) = chord.messages()
        assert message.payload[0] == [["a", "b", "c"]]
    finally:
        made.close()
