"""Re-publishing a task id: a deferral or a re-queue, at most one copy outstanding.

A copy carries the keys and tenant the execution resolved, its own
``lease_defer_id``, the deferral marker it replaces (``lease_defer_replaces``)
and its counted deferrals; its ETA is taken from the runtime's clock (the
store's), not this worker's. A store marker per task id names the newest
copy. It is moved only *after* the copy is published: moved before, a worker
dying in between left a marker with no copy behind it, and the redelivered
message was then dropped as a duplicate of a copy that did not exist.

Why each copy has its own id: a broker restore makes two identical copies.
Had they one id, both would find the marker naming them and both re-publish,
for ever, and every restore would double the task's copies. With one id per
copy, the marker moves from the twins' id to one successor's only (a
compare-and-set, :meth:`LeaseStore.mark`'s ``replace``), and the other
twin's successor is dropped at its next deferral.

Why a copy carries the marker it replaces: the move may not land (the store
refusing writes, a crash right after the publish), and then the marker still
names what the publisher read. The copy goes on under that marker too, and
under any marker when its publisher could not read one.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Ignore, Reject

from celery_lease import decide, events
from celery_lease.decide import ANY_MARKER, Act
from celery_lease.exceptions import StoreUnavailable
from celery_lease.scope import (
    DEFER_MARKER,
    HEADER_DEFER_ID,
    HEADER_DEFER_REPLACES,
    HEADER_DEFERRALS,
    HEADER_DELAY,
    HEADER_KEYS,
    HEADER_NOT_BEFORE,
    HEADER_TENANT,
    header,
)

if TYPE_CHECKING:
    from celery_lease.execution import Execution

__all__ = ["deferrals_of", "republish"]

logger = logging.getLogger(__name__)


def deferrals_of(req: Any) -> int:
    """A copy's counted deferrals so far (a header anyone may set: never below 0)."""
    value = header(req, HEADER_DEFERRALS, 0)
    if isinstance(value, bool):
        return 0
    try:
        return max(0, int(value or 0))
    except (TypeError, ValueError):
        return 0


def republish(ex: Execution, countdown: float, reason: str, deferrals: int) -> NoReturn:
    """Publish ``ex``'s task id again for ``countdown`` seconds on, then Ignore."""
    vt = ex.cfg.visibility_timeout
    if vt is not None:
        # The Redis transport restores (and so multiplies) countdown messages
        # held past its visibility timeout.
        countdown = min(countdown, vt / 2)
    own = header(ex.req, HEADER_DEFER_ID)
    replaces = header(ex.req, HEADER_DEFER_REPLACES)
    outcome = ex.decide(decide.decide_republish, decide.Republish(own, replaces))
    if outcome.act is Act.DROP:
        # Another copy of this task id is deferred already: drop this one.
        ex.event(events.LEASE_REJECTED, reason=outcome.reason)
        raise Ignore()
    defer_id = uuid.uuid4().hex
    headers = dict(getattr(ex.req, "headers", None) or {})
    headers.update(
        {
            # As received: ex.keys / ex.tenant are normalised, and the copy's worker
            # normalises header values again; template-given ones are dropped
            # (LeasedTask.signature_from_request) and derived again at the publish.
            HEADER_KEYS: header(ex.req, HEADER_KEYS),
            HEADER_TENANT: header(ex.req, HEADER_TENANT),
            HEADER_DEFER_ID: defer_id,
            HEADER_DEFER_REPLACES: outcome.replaces,
            HEADER_DEFERRALS: deferrals,
        }
    )
    when = _when(ex, countdown, headers)
    sig = ex.task.signature_from_request(ex.req, ex.args, ex.kwargs, headers=headers, **when)
    _publish(ex, sig)
    _move_marker(ex, defer_id, outcome.replaces, ttl=countdown + max(ex.opts.ttl, 10.0))
    ex.event(events.LEASE_DEFERRED, countdown=round(countdown, 3), reason=reason)
    raise Ignore()


def _publish(ex: Execution, sig: Any) -> None:
    """Hand the copy to the broker; if it cannot take it, give the message back."""
    try:
        sig.apply_async()
    except Exception as e:
        # Under acks_late the message given back is delivered again once the
        # broker (or kombu's connection) is back, and nothing of the task is
        # decided. Ending it FAILURE here would write FAILURE over a task id
        # whose other copy (a broker restore) may still succeed. Any error,
        # not only the transport's: a publish during a reconnect can also
        # fail inside kombu (an AttributeError on a connection torn down under
        # it). A permanent error cannot come from the copy itself: it is the
        # message this worker received, re-encoded with the same serializer.
        # Without acks_late the message is gone already: let the error stand.
        if not ex.task.acks_late:
            raise
        transient = isinstance(e, events.broker_errors(ex.app))
        logger.log(
            logging.WARNING if transient else logging.ERROR,
            "could not re-publish %s: message requeued: key=%s reason=%r",
            ex.task_id,
            ex.key,
            e,
            exc_info=not transient,
            extra={"action": "republish_failed", "task_id": ex.task_id, "lease_key": ex.key},
        )
        raise Reject(e, requeue=True) from e


def _move_marker(ex: Execution, defer_id: str, replaces: str | None, *, ttl: float) -> None:
    """Point the task id's deferral marker at the copy just published."""
    try:
        # False: a twin's successor took the marker first; this copy is then
        # dropped at its next deferral (or runs, if the key is free by then).
        ex.rt.store.mark(
            DEFER_MARKER + ex.task_id,
            defer_id,
            ttl=ttl,
            replace=(replaces,) if replaces not in (None, ANY_MARKER) else (),
        )
    except StoreUnavailable:
        pass


def _when(ex: Execution, countdown: float, headers: dict[str, Any]) -> dict[str, Any]:
    """The copy's schedule (``apply_async`` options); sets its not-before headers."""
    headers[HEADER_NOT_BEFORE] = None
    headers[HEADER_DELAY] = None
    if countdown <= 0:
        return {"countdown": countdown}
    # Celery turns a countdown into an ETA by this worker's clock, and every
    # worker that receives the copy waits for it by its own: a clock one hour
    # fast here would hold the copy an hour everywhere else. Take the ETA from
    # the lease store's clock, the one the lease itself runs on; a receiver
    # whose clock runs ahead waits out the rest (Execution.claim).
    try:
        eta = ex.rt.clock() + countdown
    except StoreUnavailable:
        # No clock answers (the store is down): a countdown would become an ETA
        # by this worker's clock, maybe an hour off. Publish the copy for now
        # instead; its receiver waits the delay out by its monotonic clock,
        # before claiming (Execution._wait_until_not_before).
        headers[HEADER_DELAY] = round(countdown, 3)
        return {"countdown": 0}
    headers[HEADER_NOT_BEFORE] = eta
    return {"eta": datetime.fromtimestamp(eta, tz=timezone.utc)}
