"""The reads the decisions of ``celery_lease.decide`` ask for, for one execution.

Each read answers one :class:`~celery_lease.decide.Read` with the facts it
fills, an unavailable store or database turned into the "cannot tell" value
the decision expects (``None``, or :class:`~celery_lease.decide.Failed`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from celery_lease.appstate import app_state
from celery_lease.decide import BackendState, EndAnswer, Ended, Failed, Holder, Newer, Read
from celery_lease.exceptions import LeaseError, StoreUnavailable
from celery_lease.results import AcceptedResult
from celery_lease.scope import HEADER_DEFER_ID, header
from celery_lease.stores.base import LeaseRecord

if TYPE_CHECKING:
    from celery_lease.execution import Execution

__all__ = ["Reads"]


class Reads:
    """Reads for ``ex``'s decisions; keeps the accepted result one brought."""

    def __init__(self, ex: Execution) -> None:
        # The execution keeps its Reads: a strong reference back would make the
        # pair a reference cycle, which only the cycle collector frees (late, in
        # a long-running worker, while the heap grows).
        self.ex: Execution = weakref.proxy(ex)
        #: The accepted result a read brought (to store or return).
        self.accepted: AcceptedResult | None = None

    def read(self, what: Read, facts: Any) -> dict[str, Any]:
        """Perform the read ``what`` names: the fields it fills."""
        results = self.ex.rt.results
        if what is Read.HOLDER:
            try:
                return {"holder": _holder(self.ex.rt.store.inspect(self.ex.key))}
            except StoreUnavailable as e:
                return {"holder": Failed(str(e))}
        if what is Read.LATE_COPY:
            return {"late_copy": self._may_be_a_late_copy()}
        if what is Read.OWN_STATE:
            return {"own_state": self._backend_state(self.ex.task_id)}
        if what is Read.HOLDER_STATE:
            return {"holder_state": self._backend_state(facts.holder.task_id)}
        if what is Read.MARKER:
            try:
                return {"marker": self.ex.rt.store.marker(self.ex.marker())}
            except StoreUnavailable as e:
                return {"marker": Failed(str(e))}
        try:
            if what is Read.ACCEPTED_ROW:
                assert self.ex.prepared is not None and self.ex.prepared.task_token is not None
                self.accepted = results.get(self.ex.key, self.ex.prepared.task_token)
                found = self.accepted is not None and self.accepted.task_id == self.ex.task_id
                return {"accepted_row": found}
            if what is Read.ACCEPTED_VALUE:
                self.accepted = results.accepted(self.ex.key, self.ex.tenant)
                return {"accepted_value": self.accepted is not None}
            if what is Read.MINE:
                return {"mine": results.for_task(self.ex.task_id) is not None}
            if what is Read.HOLDER_COMMITTED:
                return {"holder_committed": results.for_task(facts.holder.task_id) is not None}
            if what is Read.END:
                assert self.ex.held is not None
                mark = results.end(self.ex.held.lease, self.ex.task_id, take_over=facts.take_over)
                return {"answer": EndAnswer(Ended(mark.kind), mark.remaining)}
        except StoreUnavailable as e:
            failed = {Read.MINE: None, Read.HOLDER_COMMITTED: None}
            field = "answer" if what is Read.END else what.value
            return {field: failed.get(what, Failed(str(e)))}
        assert what is Read.NEWER_AND_HOLDER, what
        return self._read_newer_and_holder()

    def _read_newer_and_holder(self) -> dict[str, Any]:
        """Each read on its own: one that fails is Failed, never "none"."""
        newer: Newer | Failed | None = None
        try:
            accepted = self.ex.rt.results.accepted(self.ex.key, self.ex.tenant)
            newer = None if accepted is None else Newer(accepted.token, accepted.task_id)
        except StoreUnavailable as e:
            newer = Failed(str(e))
        try:
            holder: Holder | Failed | None = _holder(self.ex.rt.store.inspect(self.ex.key))
        except StoreUnavailable as e:
            holder = Failed(str(e))
        return {"newer": newer, "holder": holder}

    def _backend_state(self, task_id: str) -> BackendState | None:
        meta = self._backend_meta(task_id)
        if meta is None:
            return None
        return BackendState(meta.get("status"), isinstance(meta.get("result"), LeaseError))

    def _backend_meta(self, task_id: str) -> dict[str, Any] | None:
        """The backend's record of ``task_id`` (None: the backend cannot be read)."""
        backend = self.ex.task.backend
        errors = (
            OSError,
            *getattr(backend, "connection_errors", ()),
            *getattr(backend, "channel_errors", ()),
        )
        try:
            meta: dict[str, Any] = backend.get_task_meta(task_id, cache=False)
        except errors:
            return None
        return meta

    def _may_be_a_late_copy(self) -> bool:
        """True unless this message is its task id's first delivery.

        Only a later copy can meet a task id that already ended: the broker's
        redelivery (a Redis restore or requeue, an AMQP redelivery: both
        transports set ``redelivered``), the plugin's own re-publish (a
        deferral, a re-queue: the ``lease_defer_id`` header), or a retry
        (Celery's, or ``task_retry_on_worker_lost``'s). A first delivery skips
        the result-backend read, a round trip on every task. On a transport
        that does not mark redeliveries, every copy is checked.
        """
        req = self.ex.req
        if header(req, HEADER_DEFER_ID) or getattr(req, "retries", 0):
            return True
        info = getattr(req, "delivery_info", None) or {}
        if info.get("redelivered") or getattr(req, "redelivered", False):
            return True
        return not _broker_marks_redeliveries(self.ex.app)


def _holder(record: LeaseRecord | None) -> Holder | None:
    if record is None:
        return None
    return Holder(record.live, record.task_id, record.remaining, record.token)


def _broker_marks_redeliveries(app: Any) -> bool:
    """True if the app's broker transport flags every redelivered message
    (``delivery_info["redelivered"]``): Redis (its restores and requeues)
    and AMQP. Other transports (filesystem, SQS, ...) requeue without it."""
    state = app_state(app)
    known = state.marks_redeliveries
    if known is None:
        try:
            conn = app.connection_for_read()
            try:
                known = getattr(conn.transport, "driver_type", None) in ("redis", "amqp")
            finally:
                conn.release()
        except (ImportError, LookupError, ValueError, AttributeError):
            # What kombu raises resolving a transport it cannot build here (an
            # unknown alias, a missing library, a bad URL): cannot tell, so
            # check every copy.
            known = False
        state.marks_redeliveries = known
    return known
