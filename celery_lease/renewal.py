"""The per-process renewal timer and the handle a holder works with.

The process's renewal thread, :class:`Renewer` (in :mod:`celery_lease.renewer`,
importable from here), renews every lease the process holds, grouped by
store, each group in one ``renew_many`` round trip made on the store's own
thread, so a store whose call hangs holds back no other store's renewals.

The *local view* of a lease: a renewal sent at monotonic time ``s`` and
confirmed by the store keeps the lease valid locally until
``s + ttl - clock_drift``. The store extended it from a moment after ``s``,
so the local view never outlives the store's. When a renewal is refused,
or the store stays unreachable until the local view runs out (a paused
process wakes up past it, a store outage outlasts it), the lease is *lost*:
``held`` turns False, ``ensure()`` raises :class:`LeaseLost`, and the
``on_lost`` callbacks run once. A lost lease stays lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery_lease.exceptions import LeaseConfigError, LeaseError, LeaseLost, StoreUnavailable
from celery_lease.renewer import Renewer, renewer

if TYPE_CHECKING:
    from celery_lease.stores.base import Lease, LeaseStore

__all__ = [
    "HeldLease",
    "Renewer",
    "check_schedule",
    "default_clock_drift",
    "renewer",
    "retry_delay",
]

logger = logging.getLogger(__name__)


def default_clock_drift(ttl: float) -> float:
    """The margin taken off the local view of a lease: 2 % of the TTL + 50 ms, at most 1 s."""
    return min(1.0, 0.02 * ttl + 0.05)


def retry_delay(renew_interval: float) -> float:
    """How long after a renewal the store did not answer it is sent again."""
    return min(renew_interval / 3, 1.0)


def check_schedule(
    ttl: float,
    renew_interval: float | None,
    clock_drift: float | None,
    *,
    names: tuple[str, str, str] = ("TTL", "renew interval", "clock drift"),
) -> None:
    """Refuse a (TTL, renew interval, clock drift) whose renewals cannot keep a lease.

    ``None`` is the default (TTL / 3; :func:`default_clock_drift`). The local
    view of a lease ends ``ttl - clock_drift`` after its claim, and the first
    renewal is due ``renew_interval`` after it. The renewal and one retry of
    it (:func:`retry_delay` later, for a store that did not answer once) must
    both be due before the view ends: a store blip at the first renewal must
    not lose every lease. ``names`` are the TTL's, interval's and drift's names
    in the error (the settings' names for a worker).
    """
    ttl_name, renew_name, drift_name = names
    renew = ttl / 3 if renew_interval is None else renew_interval
    drift = default_clock_drift(ttl) if clock_drift is None else clock_drift
    if not 0 < renew <= ttl / 2:
        raise LeaseConfigError(
            f"{renew_name} ({renew!r}) must be > 0 and at most half the {ttl_name} ({ttl}) "
            "so a renewal can fail once and still be retried before the lease runs out"
        )
    if not 0 <= drift < ttl:
        raise LeaseConfigError(f"{drift_name} ({drift!r}) must be >= 0 and below the {ttl_name}")
    view = ttl - drift
    retry = retry_delay(renew)
    if not renew + retry < view:
        shown = f"{renew:g}" + (" = TTL / 3, the default" if renew_interval is None else "")
        dshown = f"{drift:g}" + (", the default" if clock_drift is None else "")
        raise LeaseConfigError(
            f"{renew_name} ({shown}) does not fit {ttl_name} ({ttl:g}) less {drift_name} "
            f"({dshown}): the local view of a lease ends {view:g} s after its claim, before "
            f"the first renewal and one retry ({retry:g} s later) are due; need "
            f"{renew_name} + {retry:g} < {ttl_name} - {drift_name}"
        )


LostCallback = Callable[["HeldLease", str], None]

#: (TTL, renew interval, clock drift) schedules check_schedule accepted: a
#: process's tasks share a few, and every grant builds a HeldLease.
_fitting: set[tuple[float, float, float]] = set()


class HeldLease:
    """A lease this process holds: the grant's facts plus the local view.

    Exposes ``key``, ``keys``, ``token``, ``owner_id``, ``expires_at`` (store
    time, as of the last renewal), ``held``, ``ensure()``, ``renew()`` and
    ``release()``.
    """

    def __init__(
        self,
        store: LeaseStore,
        lease: Lease,
        *,
        renew_interval: float | None = None,
        clock_drift: float | None = None,
        sent_at: float | None = None,
        on_lost: LostCallback | None = None,
    ) -> None:
        self.store = store
        self.lease = lease
        self.ttl = lease.ttl
        self.renew_interval = renew_interval if renew_interval is not None else lease.ttl / 3
        self.clock_drift = (
            clock_drift if clock_drift is not None else default_clock_drift(lease.ttl)
        )
        schedule = (self.ttl, self.renew_interval, self.clock_drift)
        if schedule not in _fitting:  # one check per schedule, not one per grant
            check_schedule(*schedule)
            if len(_fitting) < 256:
                _fitting.add(schedule)
        start = sent_at if sent_at is not None else time.monotonic()
        self.valid_until = start + self.ttl - self.clock_drift
        self.next_renewal = start + self.renew_interval
        self.expires_at = lease.expires_at
        self.lost_reason: str | None = None
        self.released = False
        #: Out of the renewer: nobody renews this lease any more.
        self.detached = False
        #: ``on_lost`` silenced: a commit decides the outcome from here on.
        self.silenced = False
        self.renewals = 0
        self._lock = threading.RLock()
        self._on_lost: list[LostCallback] = [on_lost] if on_lost else []

    # -- the grant's facts ---------------------------------------------------

    @property
    def key(self) -> str:
        return self.lease.key

    @property
    def keys(self) -> tuple[str, ...]:
        return self.lease.keys

    @property
    def token(self) -> int:
        return self.lease.token

    @property
    def owner_id(self) -> str:
        return self.lease.owner_id

    # -- the local view --------------------------------------------------

    @property
    def held(self) -> bool:
        """True while this process may act as the owner (local view, drift margin taken)."""
        return (
            self.lost_reason is None and not self.released and time.monotonic() < self.valid_until
        )

    @property
    def remaining(self) -> float:
        """Seconds left in the local view (0 once lost)."""
        return max(0.0, self.valid_until - time.monotonic()) if self.held else 0.0

    def ensure(self) -> None:
        """Raise :class:`LeaseLost` unless the lease is still held."""
        if self.held:
            return
        if self.lost_reason is None and not self.released:
            self.mark_lost("the lease's local validity ran out before a renewal")
        raise LeaseLost(
            f"lease {self.key!r} (token {self.token}) is no longer held: "
            f"{self.lost_reason or 'released'}"
        )

    def add_lost_callback(self, callback: LostCallback) -> None:
        self._on_lost.append(callback)

    def renew(self) -> bool:
        """Renew now, synchronously. False (and the lease lost) if the store refused."""
        if not self.held:
            return False
        sent = time.monotonic()
        try:
            expires = self.store.renew_many([self.lease])[0]
        except StoreUnavailable as e:
            self.renew_failed(sent, str(e))
            # The retry is due sooner than the timer thread may be sleeping for.
            renewer().reschedule(self)
            return self.held
        self.renewed(sent, expires)
        return expires is not None

    def renewed(self, sent: float, expires_at: float | None) -> None:
        """Apply a renewal's answer (called by the renewer or :meth:`renew`).

        An answer that arrives after the lease was released (or committed) is
        ignored: the renewal was sent before, and whatever the store said then,
        the lease is over.
        """
        with self._lock:
            if self.released:
                return
            if expires_at is None:
                self.mark_lost("renewal refused: the lease expired or another owner took it")
                return
            if self.lost_reason is not None:
                return
            self.valid_until = max(self.valid_until, sent + self.ttl - self.clock_drift)
            self.next_renewal = sent + self.renew_interval
            self.expires_at = expires_at
            self.renewals += 1

    def renew_failed(self, sent: float, error: str = "") -> None:
        """The store did not answer the renewal (``error``, if given, says why):
        retry soon, until the local view runs out."""
        with self._lock:
            if time.monotonic() >= self.valid_until:
                self.mark_lost(
                    "the store stayed unreachable until the lease's validity ran out"
                    + (f" (last error: {error})" if error else "")
                )
            else:
                self.next_renewal = sent + retry_delay(self.renew_interval)

    def mark_lost(self, reason: str) -> None:
        """Declare the lease lost (once); runs the ``on_lost`` callbacks unless detached."""
        with self._lock:
            if self.lost_reason is not None or self.released:
                return
            self.lost_reason = reason
            renewer().discard(self)
            if self.silenced:
                # A commit is deciding (it may have released the lease already,
                # so a renewal racing it is refused): its answer is the outcome.
                logger.debug("lease %s: %s (during the commit)", self.key, reason)
                return
            task_id = self.lease.meta.get("task_id")
            logger.warning(
                "lease lost: key=%s token=%s task=%s reason=%s",
                self.key,
                self.token,
                task_id or "-",
                reason,
                extra={
                    "action": "lease_lost",
                    "lease_key": self.key,
                    "token": self.token,
                    "task_id": task_id,
                },
            )
            for cb in self._on_lost:
                cb(self, reason)

    def silence(self) -> None:
        """Silence ``on_lost`` but go on renewing (while a commit decides the outcome).

        A commit can wait for the result database's lock (SQLite's one writer,
        busy with a hundred threads' commits; a row lock) for longer than the
        lease has left: renewed meanwhile, the lease is still held when the
        commit asks the store. Waits for a renewal answer being applied to this
        lease, so a lost-lease callback can never run after the caller moved on.
        """
        with self._lock:
            self.silenced = True

    def detach(self) -> None:
        """Stop renewing and silence ``on_lost`` (before a commit decides the
        outcome, or after it did). Waits as :meth:`silence` does."""
        if self.detached:
            return  # detached already: out of the renewer, and past any renewal answer
        renewer().discard(self)
        with self._lock:
            self.silenced = True
            self.detached = True
            # Silenced for good, so the callbacks can never run: drop them. A callback
            # bound to its owner (a task's Execution, which holds this lease) is a
            # reference cycle only the cycle collector frees; in a long-running worker,
            # cycles that reach its oldest generation wait for a full collection.
            self._on_lost.clear()

    def release(self) -> bool:
        """Stop renewing and release. True if it was still the owner."""
        return self._releasing() and self.store.release(self.lease)

    def release_after_error(self) -> None:
        """:meth:`release` when the holder's block raised: the block's exception
        is what its caller must see, so a release that fails is logged (the lease
        expires at its TTL) and never replaces it."""
        try:
            self.release()
        except LeaseError as e:  # a store's errors all arrive as LeaseError
            logger.warning(
                "could not release (it will expire): key=%s token=%s reason=%s",
                self.key,
                self.token,
                e,
                extra={"action": "release_failed", "lease_key": self.key, "token": self.token},
            )

    def release_later(self, failed: Callable[[LeaseError], None]) -> None:
        """:meth:`release` by :meth:`LeaseStore.release_later`: no waiting for the answer."""
        if self._releasing():
            self.store.release_later(self.lease, failed)

    def _releasing(self) -> bool:
        """Stop renewing; True the first time, unless the lease was lost."""
        self.detach()
        with self._lock:
            first, self.released = not self.released, True
        return first and self.lost_reason is None

    def __repr__(self) -> str:
        state = (
            "held"
            if self.held
            else f"lost ({self.lost_reason})"
            if self.lost_reason
            else "released"
        )
        return f"<HeldLease {self.key!r} token={self.token} {state}>"
