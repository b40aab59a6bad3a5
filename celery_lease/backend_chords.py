"""The ``lease+`` backend's chords: each header member counted once, and no callback lost.

Celery counts a chord's header through the backend (``on_chord_part_return``:
an atomic ``incr`` of the chord's counter; the member whose count reaches the
header's size joins the header's results and publishes the callback).

**Counted once.** Two copies of one leased task id can both reach that end (a
stale lock-only copy finishing after a newer one; a redelivery storing the
accepted value while the committer's tracer still runs), and a second count
would send the callback before the last member finished. So the count marks
the task id in its transaction (``meta_once``): a mark already there, no
count (and a copy whose state write the fence refused counts nothing:
:meth:`celery_lease.backend.LeaseBackend.on_chord_part_return`).

**No callback lost.** Between the last count and the publish, the last
member's SUCCESS is stored; if its worker dies there, Celery's worker finds
that SUCCESS and acknowledges the message ("succeeded before the worker was
lost"), and nothing would ever publish the callback. So the count that
reaches the header's size also writes, in its transaction, a row saying the
chord is due its callback (``celery_lease_chord_due``), and Celery's deletion
of the chord's counter once it is done (published, or the chord failed)
deletes that row with it. A row older than the publish window
(:func:`publish_window`) names a chord whose last member died in between: a
:class:`ChordWatch` thread in every worker using this backend claims it (one
worker only) and does what that member did not: join the header, publish the
callback (or fail the chord, as Celery would), and clean up. A member killed
after the publish but before the clean-up makes the callback go twice: once
more, with the same task id, as Celery's at-least-once delivery allows (a
``LeasedTask`` callback runs its body once). The header's size is Celery's:
the callback's ``chord_size``, else the length of the header's group, which
Celery restores right before the count (:func:`restored`: no read of its own).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from celery import states
from celery.canvas import maybe_signature
from celery.exceptions import ChordError, TimeoutError
from celery.result import GroupResult, allow_join_result
from kombu.utils.json import dumps, loads

from celery_lease.exceptions import StoreUnavailable
from celery_lease.sql import Database
from celery_lease.sql import meta_queries as mq
from celery_lease.sql.chord_queries import CHORD_DUE_CLEAR

if TYPE_CHECKING:
    from celery_lease.backend import LeaseBackend

__all__ = [
    "ChordWatch",
    "count",
    "counting",
    "delete",
    "publish_window",
    "recover",
    "restored",
]

logger = logging.getLogger("celery_lease.backend")

#: The chord member this thread is counting, and its chord: set by :func:`counting`.
_counting = threading.local()


@contextmanager
def counting(request: Any) -> Iterator[None]:
    """Celery's ``on_chord_part_return`` for ``request`` (a header member) runs inside:
    its :func:`count` marks that member, and knows the chord's callback and size."""
    callback = getattr(request, "chord", None)
    size = callback.get("chord_size") if isinstance(callback, dict) else None
    _counting.member = getattr(request, "id", None)
    _counting.chord = (getattr(request, "group", None), callback, size)
    try:
        yield
    finally:
        _counting.member = _counting.chord = None


def restored(group_id: str, group: Any) -> None:
    """Celery restored the header ``group`` while counting one of its members: without
    the callback's ``chord_size``, Celery takes the group's length as the header's
    size (Celery 5.3 to 5.7 give the callback none), and so does :func:`count`."""
    chord = getattr(_counting, "chord", None)
    if chord is not None and chord[0] == group_id and chord[2] is None and group is not None:
        _counting.chord = (chord[0], chord[1], len(group))


def count(db: Database, key: str, ttl: float | None) -> int:
    """Add one to the counter ``key`` and return the new value (atomic).

    A transaction rather than an autocommit statement: a statement is sent
    again only when its connection died before the transaction committed,
    so a lost reply never counts one chord member twice. Counting a chord
    member (inside :func:`counting`), the transaction first marks its task
    id for ``ttl`` seconds; a member marked already returns 0: below any
    header's size, so Celery sends nothing and only renews the chord's
    expiries. The count that reaches the header's size marks the chord due
    its callback (the module's docstring), in the same transaction.
    """
    member = getattr(_counting, "member", None)
    group_id, callback, size = getattr(_counting, "chord", None) or (None, None, None)
    with db.transaction() as conn:
        if member is not None:
            mark = {"key": f"{key}.{member}", "ttl": ttl}
            if conn.execute(db.sql.meta_once, mark).first() is None:
                return 0
        value = int(conn.execute(db.sql.meta_incr, {"key": key}).scalar_one())
        if size is not None and value == size and group_id is not None:
            due = _due_row(key, group_id, callback, ttl)
            if due is not None:
                conn.execute(db.sql.chord_due_mark, due)
    return value


def _due_row(key: str, group_id: str, callback: Any, ttl: float | None) -> dict[str, Any] | None:
    try:
        text = dumps(dict(callback))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as e:  # a callback only pickle can carry
        logger.warning(
            "result backend: chord %s: its callback is not JSON (%s): if the last member's "
            "worker dies before publishing it, nothing will",
            group_id,
            e,
            extra={"action": "chord_due_unmarked", "group_id": group_id},
        )
        return None
    return {"key": key, "group_id": group_id, "callback": text, "ttl": ttl}


def delete(db: Database, key: str, *, chord: bool) -> None:
    """Forget ``key``; a chord's counter (``chord``) takes its due row along."""
    if not chord:
        with db.single() as conn:
            conn.execute(mq.META_DELETE, {"key": key})
        return
    with db.transaction() as conn:
        conn.execute(mq.META_DELETE, {"key": key})
        conn.execute(CHORD_DUE_CLEAR, {"key": key})


def publish_window(app: Any) -> float:
    """Seconds a live last member can take from its count to the callback's publish:
    Celery's join of the header (``result_chord_join_timeout``) and the publish,
    with as much again for a loaded machine, and 5 s."""
    return 2 * float(app.conf.result_chord_join_timeout) + 5.0


def recover(backend: LeaseBackend, window: float) -> int:
    """Finish every chord due its callback for more than ``window`` seconds, one
    claimed at a time (another worker's claim is left alone); how many were."""
    finished = 0
    while True:
        with backend.db.transaction() as conn:
            row = conn.execute(
                backend.db.sql.chord_due_claim, {"grace": window, "hold": window}
            ).first()
        if row is None:
            return finished
        if _finish(backend, row):
            finished += 1


def _finish(backend: LeaseBackend, row: Any) -> bool:
    """What the last member did not do: Celery's end of ``on_chord_part_return``."""
    app = backend.app
    callback = maybe_signature(loads(row.callback), app=app)  # type: ignore[no-untyped-call]
    deps = GroupResult.restore(row.group_id, backend=backend)
    if deps is None:  # Celery deletes the group right after the publish: it was sent
        delete(backend.db, row.key, chord=True)
        return False
    logger.warning(
        "result backend: chord %s: its last member was counted %.1f s ago and its callback "
        "%s[%s] was not published (that worker died?): publishing it now",
        row.group_id,
        row.waited,
        callback.task,
        callback.id,
        extra={"action": "chord_callback_recovered", "group_id": row.group_id},
    )
    # The members' records, not join_native(propagate=True): that raises a member's
    # error and the database's alike, and only a member's may fail the chord. A
    # database error passes: the row stays, claimed for the window, and the next
    # look (this worker's or another's) finishes the chord. So does a failed publish.
    try:
        with allow_join_result():
            metas = dict(deps.iter_native(timeout=app.conf.result_chord_join_timeout))
    except TimeoutError as exc:  # a member's record gone (expired): Celery fails the chord too
        _fail(backend, callback, f"Cannot join the header: {exc!r}")
    else:
        ids = [r.id for r in deps.results]
        failed = [t for t in ids if metas[t]["status"] in states.PROPAGATE_STATES]
        if failed:
            culprit = failed[0]
            _fail(backend, callback, f"Dependency {culprit} raised {metas[culprit]['result']!r}")
        else:
            callback.delay([metas[t]["result"] for t in ids])
    deps.delete()
    backend.delete(row.key)
    for dep in deps.results:
        backend.expire(backend.get_key_for_task(dep.id), backend.expires)
    return True


def _fail(backend: LeaseBackend, callback: Any, reason: str) -> None:
    """Fail the chord's callback with a ChordError, as Celery does: from inside an
    ``except`` (Celery's error path records the exception being handled)."""
    try:
        raise ChordError(reason)
    except ChordError as exc:
        backend.chord_error_from_stack(callback, exc)


class ChordWatch:
    """A worker's thread that finishes the chords whose last member died before
    publishing the callback (:func:`recover`), every half publish window."""

    def __init__(self, backend: LeaseBackend) -> None:
        self.backend = backend
        self.window = publish_window(backend.app)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="celery-lease-chords", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.window / 2):
            try:
                recover(self.backend, self.window)
            except StoreUnavailable as e:
                logger.warning(
                    "result backend: could not look for chords due their callback: %s",
                    e,
                    extra={"action": "chord_watch_failed"},
                )
            except Exception:  # a defect, or a publish that failed: said, and looked for again
                logger.exception("result backend: finishing a chord due its callback failed")
