"""Each store's renewal calls, made on a thread of that store's own (its *lane*).

The renewal thread (:mod:`celery_lease.renewer`) decides what is due and when
a lease is lost; it never waits on a store. A store call can hang for minutes:
a PostgreSQL connection gone half-open (a dead host, a NAT dropping the flow,
a frozen server) waits in psycopg, which has no read timeout, until the kernel
gives the connection up. Made on the renewal thread, that call held back every
other store's renewals, and the marking lost of every lease whose local view
ran out meanwhile (so no ``LEASE_LOST``, no lost callback, no metric).

A lane makes one ``renew_many`` at a time for its store; while one is in
flight, that store's due leases wait (a second call would most likely hang
behind the first, and leases renewed twice at once gain nothing). Its answer
goes back to the renewal thread as a :class:`Batch`, which that thread
applies: a lease's local view, and its lost callbacks, only ever change there.

The common case costs what it did: one round trip per store per interval. A
lane's thread stays for :data:`IDLE` seconds after its last call, so a process
renewing every interval starts no thread per cycle, let alone per task.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from celery_lease.exceptions import LeaseError

if TYPE_CHECKING:
    from celery_lease.renewal import HeldLease
    from celery_lease.stores.base import LeaseStore

__all__ = ["IDLE", "Batch", "Lane"]

logger = logging.getLogger(__name__)

#: Seconds a lane's thread waits for its next call before it ends. Long
#: enough for any renew interval a process renews every few seconds with;
#: short enough that a store object its user dropped (the lane holds it) goes.
IDLE = 60.0


@dataclass
class Batch:
    """One ``renew_many`` of a lane: the leases, when it was sent, and its answer
    (new expiries, per lease) or the error that came instead."""

    lane: Lane
    group: list[HeldLease]
    sent: float
    answers: list[float | None] | None = None
    error: BaseException | None = None


class Lane:
    """One store's renewal calls, one in flight at a time, on the lane's own thread.

    ``lock`` is the renewal thread's: :meth:`submit` is called, and ``busy``
    read and cleared, with it held, so a lane that ends for idleness (and
    removes itself with ``gone``) is never handed a call at that moment.
    """

    def __init__(
        self,
        store: LeaseStore,
        lock: threading.RLock,
        deliver: Callable[[Batch], None],
        gone: Callable[[Lane], None],
    ) -> None:
        self.store = store
        #: A call was submitted and its answer is not applied yet: the
        #: store's due leases wait. Cleared by whoever applies the answer.
        self.busy = False
        self._deliver = deliver
        self._gone = gone
        self._cond = threading.Condition(lock)
        self._work: list[HeldLease] | None = None
        self._thread: threading.Thread | None = None

    def submit(self, group: list[HeldLease]) -> None:
        """Renew ``group`` on the lane's thread (the caller holds the lock; the lane is idle)."""
        self.busy = True
        self._work = group
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="celery-lease-renewer-lane", daemon=True
            )
            self._thread.start()
        else:
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._work is None:
                    self._cond.wait(IDLE)
                    if self._work is None:  # idle for IDLE seconds: the lane goes
                        self._thread = None
                        self._gone(self)
                        return
                group, self._work = self._work, None
            self._deliver(self._call(group))

    def _call(self, group: list[HeldLease]) -> Batch:
        batch = Batch(self, group, time.monotonic())
        try:
            batch.answers = self.store.renew_many([h.lease for h in group])
        except LeaseError as e:  # the store's answer: retried soon, until the view runs out
            batch.error = e
        except BaseException as e:
            # Not a store's answer: a bug. The leases go back (retried as for an
            # outage), and the error ends this thread (threading.excepthook logs
            # it); the lane's next call starts a new one.
            batch.error = e
            with self._cond:
                self._thread = None
            self._deliver(batch)
            raise
        return batch
