"""One execution of a leased task in the worker: the executor of ``celery_lease.decide``.

The decisions are :mod:`celery_lease.decide`'s (its docstring holds the table). This
module gathers their facts, with each read done when a decision asks for it
(:meth:`Execution.decide`), and carries their outcomes out: the backend write, the event,
the re-publish, ``Ignore``. Outcomes that are not plain SUCCESS/FAILURE record the
result-backend state themselves (so ``AsyncResult.get()`` returns or raises), send the
custom event last (so Flower shows the custom state), and ``raise Ignore``. A copy of a
task id whose own execution owns the result never writes the backend.

Once it holds its lease, the execution puts a ``LeaseWriter`` (token, keys) on
its request, which a ``lease+`` result backend fences every write of the
request by (other backends ignore it); see :mod:`celery_lease.backend`.

With ``acks_late``, a message that ends in a final state is acked and gone; so whenever
the work was *not* done and nobody newer is doing it (the lease lapsed with no one taking
over, the store was down at the commit), the task is re-published under its own id
instead of failing: no lost work.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Retry
from celery.states import STARTED

from celery_lease import decide, events, metrics
from celery_lease.backend import WRITER_ATTR, commit_record, lease_writer, writer_of
from celery_lease.claiming import claim, jitter
from celery_lease.config import config
from celery_lease.decide import Act, Outcome, Read
from celery_lease.exceptions import (
    DuplicateResult,
    LeaseError,
    LeaseLost,
    LeaseNotAcquired,
    StaleFencingToken,
    StoreUnavailable,
    TaskEnded,
)
from celery_lease.reads import Reads
from celery_lease.renewal import HeldLease, renewer
from celery_lease.requeue import deferrals_of, republish
from celery_lease.results import MetaRecord, Prepared, encode_result
from celery_lease.runtime import runtime
from celery_lease.scope import DEFER_MARKER, authorize, resolve_request

if TYPE_CHECKING:
    from celery_lease.task import LeasedTask

__all__ = ["Execution"]

logger = logging.getLogger(__name__)

_F = TypeVar("_F")


def _with(facts: _F, changes: dict[str, Any]) -> _F:
    """``dataclasses.replace(facts, **changes)`` for decide's frozen facts classes,
    without replace()'s Python loop over the fields (most executions ask for a read)."""
    fields = getattr(facts, "__dict__", None)
    if fields is None:  # a class with __slots__
        return replace(facts, **changes)  # type: ignore[type-var]
    return type(facts)(**{**fields, **changes})


class Execution:
    """One execution of a leased task in the worker (or in ``apply()``)."""

    def __init__(self, task: LeasedTask, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.task = task
        self.app = task.app
        self.args = args
        self.kwargs = kwargs
        self.req = task.request
        self.cfg = config(self.app)
        self.rt = runtime(self.app)
        self.opts = task._options(self.cfg)
        self.task_id: str = self.req.id
        self.hostname: str | None = self.req.hostname
        # Templates first, headers checked against them (celery_lease.scope):
        # a publisher's headers never override the task's own definition.
        self.keys, self.tenant, self.scoped = resolve_request(
            task, args, kwargs, self.req, self.cfg.limits
        )
        self.key = self.scoped[0]
        self.meta = {
            "task_id": self.task_id,
            "task_name": task.name,
            "root_id": self.req.root_id,
            "tenant": self.tenant,
        }
        self.held: HeldLease | None = None
        #: Leases and results in one database: the claim brings the look-up
        #: :meth:`prepare` needs (ResultTable.claim_prepared, one round trip).
        self.prepared: Prepared | None = None

    @cached_property  # most executions decide without a read
    def reads(self) -> Reads:
        return Reads(self)

    # -- the whole path ----------------------------------------------------------

    def run(self) -> Any:
        authorize(self.task, self.tenant, self.keys, self.args, self.kwargs)
        held = self.held = self.claim()
        setattr(self.req, WRITER_ATTR, lease_writer(self.task, held, self.rt.results.db))
        finished = False
        try:
            # Renewed from the grant on: the look-up and the STARTED write below can
            # outlast the TTL on a loaded worker (threads queued on SQLite's writer).
            held.add_lost_callback(self._on_lost)
            renewer().add(held)
            if self.opts.commit:
                self.prepare(held)
            self._store_started()
            start = decide.decide_body_start(decide.BodyStart(held=held.held))
            if start.act is Act.REQUEUE:
                self.release()
                self.republish(0.0, reason=start.reason)
            self.req._celery_lease = held
            try:
                retval = self.task.run(*self.args, **self.kwargs)
            except LeaseLost as e:
                held.detach()
                finished = True
                self.not_done(e, events.LEASE_LOST)
            except StaleFencingToken as e:
                # A fenced write in the body (fencing.guard) was refused: a newer
                # owner registered. The same outcome as a refused commit, so a
                # stale copy never writes FAILURE over its own task id's owner.
                held.detach()
                finished = True
                self.release()
                metrics.stale_commits.inc()
                self.not_done(e, events.FENCED)
            except Retry:
                held.detach()
                self._unless_overtaken(held)
                self.release()  # the retry claims again, with a newer token
                finished = True
                raise
            except Exception:  # any error of the user's body, always re-raised:
                # Celery stores it, unless a copy of this task id owns the outcome.
                held.detach()
                self._unless_overtaken(held)
                raise
            return self._after_body(held, retval)
        finally:
            held.detach()
            self.req._celery_lease = None
            if not finished:
                self.release()

    def _store_started(self) -> None:
        """STARTED, written once this execution owns the key (LeasedTask.on_bound)."""
        if self.task._lease_track_started and not self._ignore_result():
            self.task.backend.store_result(
                self.task_id,
                {"pid": os.getpid(), "hostname": self.hostname},
                STARTED,
                request=self.req,
            )

    def _after_body(self, held: HeldLease, retval: Any) -> Any:
        if not held.held and held.lost_reason is None:
            # The local view ran out while the body ran (a pause): say so now,
            # so LEASE_LOST is sent before the commit decides FENCED.
            held.mark_lost("the lease's local validity ran out while the body ran")
        if self.opts.commit and self.rt.renew_through_commit:
            held.silence()
        else:
            held.detach()
        if not self.opts.commit:
            self.release()
            return retval
        return self.commit(held, retval)

    # -- gathering facts -----------------------------------------------------------

    def decide(self, fn: Callable[[_F], Outcome | Read], facts: _F) -> Outcome:
        """Ask ``fn``, reading each fact it asks for, until it decides."""
        while True:
            answer = fn(facts)
            if isinstance(answer, Outcome):
                return answer
            facts = _with(facts, self.reads.read(answer, facts))

    # -- claiming, and before the body ----------------------------------------------

    def claim(self) -> HeldLease:
        return claim(self)

    def prepare(self, held: HeldLease) -> None:
        deadline = held.valid_until
        prepared = self.prepared  # brought by the claim (leases in the result database)
        while prepared is None:
            facts = decide.Lookup(self.opts.ttl)
            try:
                prepared = self.rt.results.prepare(
                    held.lease, self.task_id, once=self.opts.mode == "once"
                )
                break
            except StaleFencingToken:
                facts = replace(facts, stale=True)
            except StoreUnavailable as e:
                facts = replace(facts, error=str(e), retry_left=time.monotonic() + 0.5 < deadline)
            outcome = decide.decide_lookup(facts)
            assert outcome is not None
            if outcome.act is Act.RETRY:
                time.sleep(0.2)
                continue
            self.release()
            self.carry_out(outcome)
        self.prepared = prepared
        outcome = self.decide(
            decide.decide_start,
            decide.Start(
                self.opts.ttl,
                accepted=prepared.task_token is not None,
                duplicate=prepared.duplicate_token is not None,
                backend=self._backend_enabled(),
            ),
        )
        if outcome.act is Act.RUN:
            return
        if outcome.act is Act.STORE_ACCEPTED_THEN_REJECT:
            # While this copy still holds the lease.
            assert self.reads.accepted is not None
            self.task.backend.mark_as_done(
                self.task_id, self.reads.accepted.value, request=self.req
            )
        self.release()
        if outcome.act is Act.DUPLICATE:
            token = self._shown_token(prepared.duplicate_token)
            self.duplicate(DuplicateResult(self.key, token))
        if outcome.act is Act.DEFER:
            self.carry_out(outcome)
        metrics.claims.labels("redelivery").inc()
        self.event(events.LEASE_REJECTED, reason=outcome.reason)
        raise Ignore()

    # -- the commit ----------------------------------------------------------------

    def commit(self, held: HeldLease, retval: Any) -> Any:
        encoded = encode_result(
            retval, task_name=self.task.name, max_bytes=self.cfg.result_max_bytes
        )
        record = commit_record(self.task, self.req, self.task_id, retval, self.rt.results.db)
        delay = 0.1
        # Retries end when the lease's validity as of the body's end does: the
        # renewals that go on through the commit must not keep a commit retrying
        # against a result database that stays down.
        deadline = held.valid_until
        while True:
            try:
                self._commit_once(held, retval, encoded, record)
                facts = decide.Commit(decide.CommitResult.ACCEPTED)
            except StaleFencingToken as e:  # TaskEnded is one: stored as what it is, fenced
                ended = isinstance(e, TaskEnded)
                stale = StaleFencingToken(e.key, e.token, e.current, e.reason) if ended else e
                result = decide.CommitResult.ENDED if ended else decide.CommitResult.STALE
                facts = decide.Commit(result)
            except DuplicateResult as e:
                dup = e
                facts = decide.Commit(decide.CommitResult.DUPLICATE)
            except StoreUnavailable as e:
                retry_left = time.monotonic() + delay < deadline
                facts = decide.Commit(decide.CommitResult.UNAVAILABLE, str(e), retry_left)
            outcome = decide.decide_commit(facts)
            if outcome.act is Act.RETRY:
                time.sleep(jitter(delay))
                delay = min(delay * 2, 1.0)
                continue
            if outcome.act is Act.REQUEUE:
                self.event(events.FENCED, reason=outcome.note)
                self.republish(0.0, reason=outcome.reason)
            held.released = True
            if outcome.act in (Act.NOT_DONE, Act.STORE_FAILURE):  # STORE_FAILURE: commit.ended
                metrics.stale_commits.inc()
                after = self.not_done if outcome.act is Act.NOT_DONE else self.end
                after(stale, events.FENCED)
            if outcome.act is Act.DUPLICATE:
                self.duplicate(DuplicateResult(dup.key, self._shown_token(dup.accepted_token)))
            return retval

    def _commit_once(
        self, held: HeldLease, retval: Any, encoded: str, record: MetaRecord | None
    ) -> None:
        """One attempt of the fenced commit (and release); with ``record``, the
        task's SUCCESS in the same transaction, the tracer's write then a no-op."""
        self.rt.results.commit(
            held.lease,
            retval,
            mode=self.opts.mode,
            release=True,
            task_id=self.task_id,
            task_name=self.task.name,
            tenant=self.tenant,
            root_id=self.req.root_id,
            encoded=encoded,
            meta=record,
        )
        writer = writer_of(self.req)
        if record is not None and writer is not None:
            writer.committed(self.req)

    # -- outcomes --------------------------------------------------------------------

    def not_done(self, exc: LeaseError, state: str) -> NoReturn:
        """The body ran but its result was not accepted (fenced, or the lease was lost)."""
        token = self.held.token if self.held else None
        facts = decide.NotDone(self.task_id, self.opts.ttl, self._backend_enabled(), token)
        outcome = self.decide(decide.decide_not_done, facts)
        if outcome.note is not None:
            self.event(state, token=token, reason=outcome.note)
        if outcome.act is Act.STORE_FAILURE:
            self.end(exc, state, take_over=outcome.row == "not_done.taken_over")
        self.carry_out(outcome)

    def end(self, exc: LeaseError, state: str, *, take_over: bool = False) -> NoReturn:
        """Store the FAILURE ``exc`` once the task id's end is recorded (decide_end)."""
        fenced = self.opts.commit and self._backend_enabled()
        outcome = self.decide(decide.decide_end, decide.End(self.opts.ttl, fenced, take_over))
        if outcome.act is Act.STORE_FAILURE:
            self._store_failure(exc)
            self.event(state, token=self.held.token if self.held else None, reason=str(exc))
            raise Ignore()
        self.carry_out(outcome)

    def _unless_overtaken(self, held: HeldLease) -> None:
        """The body raised (an error, ``Retry``): let Celery store that, unless
        this execution lost its lease and another copy of its task id owns the
        outcome (then raise, storing nothing)."""
        facts = decide.BodyError(
            self.task_id, self.opts.ttl, self._backend_enabled(), held.held, held.token
        )
        outcome = self.decide(decide.decide_body_error, facts)
        if outcome.act is Act.RAISE:
            return
        if outcome.note is not None:
            self.event(events.LEASE_LOST, token=held.token, reason=outcome.note)
        self.carry_out(outcome)

    def duplicate(self, exc: DuplicateResult) -> NoReturn:
        metrics.claims.labels("duplicate").inc()
        outcome = self.decide(
            decide.decide_duplicate, decide.Duplicate(self.opts.ttl, self.opts.on_duplicate)
        )
        if outcome.act is Act.RETURN_ACCEPTED:
            if not self._ignore_result():
                value = self.reads.accepted.value if self.reads.accepted else None
                self.task.backend.mark_as_done(self.task_id, value, request=self.req)
            self.event(events.LEASE_REJECTED, reason=outcome.reason)
            raise Ignore()
        self.carry_out(outcome, exc)

    def carry_out(self, outcome: Outcome, exc: LeaseError | None = None) -> NoReturn:
        """Carry out a DEFER, REQUEUE, LEAVE_TO_COPY, REJECT_ENDED or REJECT (of ``exc``)."""
        if outcome.act is Act.DEFER:
            self.defer(outcome.countdown, outcome.reason, counted=outcome.counted)
        if outcome.act is Act.REQUEUE:
            self.republish(0.0, reason=outcome.reason)
        if outcome.act is Act.LEAVE_TO_COPY:
            raise Ignore()
        if outcome.act is Act.REJECT_ENDED:
            metrics.claims.labels("redelivery").inc()
            self.event(events.LEASE_REJECTED, reason=outcome.reason)
            raise Ignore()
        assert outcome.act is Act.REJECT, outcome
        if exc is None:
            metrics.claims.labels("rejected").inc()
            # The caller learns the key is busy, not who holds it: an owner id
            # names another execution (with its token, all a forged release needs).
            exc = LeaseNotAcquired(self.key, None, outcome.countdown)
        self.reject(exc, reason=outcome.reason)

    def _shown_token(self, token: int | None) -> int | None:
        """The accepted token a duplicate's failure names: none in a tenant's scope,
        where it would tell the caller about another execution's grant."""
        return None if self.tenant is not None else token

    def reject(self, exc: LeaseError, reason: str) -> NoReturn:
        self._store_failure(exc)
        self.event(events.LEASE_REJECTED, reason=f"{reason}: {exc}")
        raise Ignore()

    def defer(self, remaining: float, reason: str, *, counted: bool = True) -> NoReturn:
        """Re-publish this task id for after the holder's lease, backend untouched.

        ``lease_defer_max`` bounds deferrals behind *other* task ids' live
        leases (``counted``): see celery_lease.decide. An outage of any length
        delays the work, it never turns it into a FAILURE.
        """
        deferrals = deferrals_of(self.req)
        facts = decide.Defer(counted, deferrals, self.cfg.defer_max, remaining, reason)
        outcome = decide.decide_defer(facts)
        if outcome.act is Act.REJECT:
            self.carry_out(outcome)
        countdown = remaining + random.uniform(0.05, 0.05 + min(1.0, 0.1 * self.opts.ttl))
        metrics.claims.labels("deferred").inc()
        self.republish(countdown, reason=reason, deferrals=outcome.deferrals)

    def republish(self, countdown: float, *, reason: str, deferrals: int | None = None) -> NoReturn:
        """Publish this task id again (at most one outstanding copy), then Ignore."""
        republish(
            self, countdown, reason, deferrals_of(self.req) if deferrals is None else deferrals
        )

    def marker(self) -> str:
        return DEFER_MARKER + self.task_id

    # -- helpers ---------------------------------------------------------------------

    def release(self) -> None:
        """Give the lease up without waiting for the store's answer (nothing here needs
        it); a failure is logged when it comes, and the lease expires at its TTL."""
        held = self.held
        if held is None or held.released:
            return
        key, token, task_id = self.key, held.token, self.task_id

        def failed(e: BaseException) -> None:  # holds no reference to this execution
            logger.warning(
                "could not release (it will expire): key=%s token=%s task=%s reason=%s",
                key,
                token,
                task_id,
                e,
                exc_info=not isinstance(e, LeaseError),
                extra={"action": "release_failed", "lease_key": key, "token": token},
            )

        try:
            held.release_later(failed)
        except Exception as e:  # noqa: BLE001 - a defect: still never the task's outcome
            failed(e)

    def _on_lost(self, held: HeldLease, reason: str) -> None:
        # Runs in the renewal thread: self.req is not this thread's request, so
        # only values captured at claim time are used.
        metrics.leases_lost.inc()
        self.event(events.LEASE_LOST, token=held.token, reason=reason, later=True)

    def event(self, state: str, *, later: bool = False, **fields: Any) -> None:
        """Send ``state`` as a task event (``later``: from the events thread) and log it."""
        if self.cfg.send_events:
            (events.send_later if later else events.send)(
                self.app,
                state,
                task_id=self.task_id,
                hostname=self.hostname,
                lease_key=self.key,
                **fields,
            )
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "%s %s key=%s token=%s reason=%s",
                state,
                self.task_id,
                self.key,
                fields.get("token", "-"),
                fields.get("reason", "-"),
                extra={
                    "action": state.lower(),
                    "lease_key": self.key,
                    "task_id": self.task_id,
                    "token": fields.get("token"),
                    "reason": fields.get("reason"),
                },
            )

    def _store_failure(self, exc: BaseException) -> None:
        if not self._ignore_result():
            self.task.backend.mark_as_failure(self.task_id, exc, request=self.req)

    def _ignore_result(self) -> bool:
        return bool(self.task.ignore_result or getattr(self.req, "ignore_result", False))

    def _backend_enabled(self) -> bool:
        return not self._ignore_result() and not isinstance(self.task.backend, DisabledBackend)
