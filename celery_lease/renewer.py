"""The per-process renewal thread: what is due, when a lease is lost, and the answers.

One daemon thread per process (started lazily, and never inherited across
``fork``: the child starts its own on first use) renews every lease the
process holds, grouped by store, each group in one ``renew_many`` round trip
made on that store's lane (:mod:`celery_lease.renew_lanes`). The thread itself
never waits on a store: a store whose call hangs delays neither another
store's renewals nor the marking lost, on time, of its own leases whose local
view runs out meanwhile. The answers come back to this thread, which applies
them (:meth:`HeldLease.renewed` / :meth:`HeldLease.renew_failed`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

from celery_lease import metrics
from celery_lease.renew_lanes import Batch, Lane

if TYPE_CHECKING:
    from celery_lease.renewal import HeldLease
    from celery_lease.stores.base import LeaseStore

__all__ = ["Renewer", "renewer"]

logger = logging.getLogger(__name__)


class Renewer:
    """The process's renewal thread."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._leases: set[HeldLease] = set()
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        #: Each store's lane, by ``id(store)`` (the lane holds the store, so the
        #: id is not reused while the lane is here). Under ``_lock``.
        self._lanes: dict[int, Lane] = {}
        #: Answers the lanes delivered, not applied yet. Under ``_lock``.
        self._done: list[Batch] = []
        #: When the thread wakes next by itself (monotonic time); None while it
        #: sleeps until notified. Read and written under ``_cond``.
        self._wake_at: float | None = None
        #: The renew interval of the lease added last: how long the thread sleeps
        #: with no lease to renew (a lease due sooner still wakes it).
        self._idle: float | None = None
        self.cycles = 0
        #: Times the thread woke up (notified or timed out): a short task should
        #: not cost one.
        self.wakeups = 0
        #: Times a failed thread was replaced (see :meth:`_run`).
        self.restarts = 0

    def add(self, held: HeldLease) -> None:
        with self._cond:
            self._leases.add(held)
            self._idle = held.renew_interval
            metrics.held_leases.set(len(self._leases))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="celery-lease-renewer", daemon=True
                )
                self._thread.start()
            self._notify_if_sooner(held)

    def reschedule(self, held: HeldLease) -> None:
        """``held`` is due sooner than it was (a failed renewal): wake the thread if needed."""
        with self._cond:
            if held in self._leases:
                self._notify_if_sooner(held)

    def _notify_if_sooner(self, held: HeldLease) -> None:
        # Wake the thread only when ``held`` is due before it would wake anyway:
        # one wake-up per task (a thread switch, the GIL handed over and back)
        # was a measurable share of a short task's cost. A thread that is not
        # waiting (renewing, or about to recompute) sees ``held`` when it loops.
        wake_at = self._wake_at
        due = self._due_at(held)
        if wake_at is None or due < wake_at:
            self._wake_at = due  # no second notify for a later lease meanwhile
            self._cond.notify_all()

    def discard(self, held: HeldLease) -> None:
        # No wake-up: the thread, woken for a lease that is gone, just recomputes.
        with self._cond:
            self._leases.discard(held)
            metrics.held_leases.set(len(self._leases))

    @property
    def leases(self) -> list[HeldLease]:
        with self._cond:
            return list(self._leases)

    def _due_at(self, held: HeldLease) -> float:
        """When ``held`` must be renewed (or declared lost), in monotonic time.

        While its store's lane has a call in flight, only its loss can come due.
        Called under ``_cond``.
        """
        lane = self._lanes.get(id(held.store))
        if lane is not None and lane.busy:
            return held.valid_until
        return min(held.next_renewal, held.valid_until)

    def _run(self, delay: float = 0.0) -> None:
        if delay:
            time.sleep(delay)  # a predecessor failed: no tight loop of failing cycles
        try:
            self._loop()
        finally:
            # _loop never returns: this is an exception (a bug, or an on_lost
            # callback that raised) ending the thread. It goes on to
            # threading.excepthook; a new thread takes over, so the process's
            # other leases are still renewed.
            self._replace_thread()

    def _replace_thread(self) -> None:
        logger.error(
            "the lease renewal thread failed; a new one takes over",
            exc_info=sys.exc_info(),
            extra={"action": "renewer_failed"},
        )
        with self._cond:
            if self._thread is not threading.current_thread() or self.pid != os.getpid():
                return
            self.restarts += 1
            self._wake_at = None
            self._thread = threading.Thread(
                target=self._run, args=(_RESTART_DELAY,), name="celery-lease-renewer", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                done, self._done = self._done, []
                if not done:
                    now = time.monotonic()
                    wake = min((self._due_at(h) for h in self._leases), default=None)
                    if wake is None and self._idle is not None:
                        # Nothing to renew. Sleeping until notified would cost a
                        # wake-up per short task (its lease is gone when the thread
                        # runs); sleep half an interval instead, so the next task's
                        # lease, due a whole interval after its claim, needs none.
                        wake = now + self._idle / 2
                    if wake is None or wake > now:
                        self._wake_at = wake
                        self._cond.wait(None if wake is None else max(0.0, wake - now))
                        self.wakeups += 1
                        continue
                    # With the leases that are due, renew every lease at least half-way
                    # to its next renewal: their schedules then coincide from the next
                    # cycle on, so the process sends one round trip per store per
                    # interval however its claims were spread in time (renewing each
                    # lease exactly when due would keep one round trip per lease).
                    due = [h for h in self._leases if self._due_at(h) - h.renew_interval / 2 <= now]
                # Busy: a lease added meanwhile is seen next loop, without a notify.
                self._wake_at = time.monotonic()
            if done:
                self._apply(done)
            else:
                self._send(due)

    def renew_due(self, due: list[HeldLease]) -> None:
        """Renew ``due`` leases now, one round trip per store, and wait for the answers.

        The thread's cycle, made by a caller (a test, a benchmark): the calls go
        through the stores' lanes as the thread's do, but this waits for them.
        """
        lanes = self._send(due)
        while True:
            with self._cond:
                done, self._done = self._done, []
                if not done:
                    if not any(lane.busy for lane in lanes):
                        return
                    self._cond.wait()
                    continue
            self._apply(done)

    def _send(self, due: list[HeldLease]) -> list[Lane]:
        """Mark lost the ``due`` leases whose view ran out; hand the others, one
        group per store, to the stores' lanes (a busy lane's wait). Never blocks
        on a store. Returns the lanes given a call."""
        self.cycles += 1
        now = time.monotonic()
        by_store: dict[int, list[HeldLease]] = {}
        for h in due:
            if now >= h.valid_until:
                lane = self._lanes.get(id(h.store))  # read unlocked: only the wording depends on it
                h.mark_lost(
                    "the lease's local validity ran out while its store had not answered "
                    "the renewal in flight"
                    if lane is not None and lane.busy
                    else "the lease's local validity ran out before a renewal (process paused?)"
                )
            elif h.held:
                by_store.setdefault(id(h.store), []).append(h)
        sent: list[Lane] = []
        with self._cond:
            for group in by_store.values():
                lane = self._lane(group[0].store)
                if not lane.busy:  # else these wait for the call in flight
                    lane.submit(group)
                    sent.append(lane)
        return sent

    def _lane(self, store: LeaseStore) -> Lane:
        """``store``'s lane, made on first use (under ``_cond``)."""
        lane = self._lanes.get(id(store))
        if lane is None:
            lane = self._lanes[id(store)] = Lane(store, self._lock, self._deliver, self._gone)
        return lane

    def _deliver(self, batch: Batch) -> None:
        # On a lane's thread: the renewal thread (or renew_due) applies it.
        with self._cond:
            self._done.append(batch)
            self._cond.notify_all()

    def _gone(self, lane: Lane) -> None:
        # On the lane's thread, under _cond: it ended, idle.
        if self._lanes.get(id(lane.store)) is lane:
            del self._lanes[id(lane.store)]

    def _apply(self, done: list[Batch]) -> None:
        """Apply the lanes' answers to the leases (on this thread: the only one
        that changes a lease's view from a renewal, and runs its lost callbacks)."""
        for i, batch in enumerate(done):
            try:
                self._apply_one(batch)
            except BaseException:
                # A lost callback raised: the thread ends for it (and is replaced).
                # The answers not applied yet go back, to be applied next loop.
                with self._cond:
                    self._done[:0] = done[i + 1 :]
                raise
            finally:
                with self._cond:
                    batch.lane.busy = False

    def _apply_one(self, batch: Batch) -> None:
        group, sent, e = batch.group, batch.sent, batch.error
        if batch.answers is None:
            # Unreachable, or an error reply (StoreUnavailable or not): the
            # leases are not lost for it, the renewal is retried soon, until
            # their local view runs out.
            logger.warning(
                "lease renewal failed, will retry: keys=%s reason=%s: %s",
                ",".join(h.key for h in group),
                type(e).__name__,
                e,
                extra={"action": "renew_retry"},
            )
            metrics.renewals.labels("error").inc(len(group))
            for h in group:
                h.renew_failed(sent, f"{type(e).__name__}: {e}")
            return
        for h, expires in zip(group, batch.answers):
            metrics.renewals.labels("lost" if expires is None else "renewed").inc()
            h.renewed(sent, expires)


#: Seconds a replacement renewal thread waits before its first cycle.
_RESTART_DELAY = 0.2


_renewer: Renewer | None = None
_renewer_lock = threading.Lock()


def renewer() -> Renewer:
    """This process's :class:`Renewer` (a new one after ``fork``)."""
    global _renewer
    current = _renewer
    if current is not None and current.pid == os.getpid():
        return current  # the common case (twice per task): no lock
    with _renewer_lock:
        if _renewer is None or _renewer.pid != os.getpid():
            _renewer = Renewer()
        return _renewer


def _reset_after_fork() -> None:
    global _renewer, _renewer_lock
    _renewer = None
    _renewer_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
