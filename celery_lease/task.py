"""``LeasedTask``: claim at start, renew from a timer, fenced commit, release.

In the worker child, before the body::

    keys (from the message header, else derived) -> claim -> prepare
      busy by another task id  -> lease_on_conflict: defer | reject | wait
      busy by this task id     -> defer (a redelivered copy met the live owner:
                                  dropping it would ack the owner's message too)
      this task id accepted    -> LEASE_REJECTED, backend untouched
      this task id ended FENCED, LEASE_LOST, ...
                               -> LEASE_REJECTED, backend untouched (read from
                                  the result backend for a redelivered,
                                  deferred or retried copy only: a first
                                  delivery cannot meet its own end)
      once mode, key accepted  -> lease_on_duplicate: reject | return
    body (self.lease held, renewed by the process's timer thread)
    detach the renewer -> commit (fenced) + release in one step

Outcomes that are not plain SUCCESS/FAILURE record the result-backend state
themselves (so ``AsyncResult.get()`` returns or raises), send the custom
event last (so Flower shows the custom state), and ``raise Ignore``. A copy
of a task id whose own execution owns the result never writes the backend.

With ``acks_late``, a message that ends in a final state is acked and gone;
so whenever the work was *not* done and nobody newer is doing it (the lease
lapsed with no one taking over, the store was down at the commit), the task
is re-published under its own id instead of failing: no lost work.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, ClassVar, NoReturn

from celery import Task
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Reject, Retry
from celery.states import FAILURE, STARTED, SUCCESS

from celery_lease import events, metrics
from celery_lease.appstate import app_state
from celery_lease.config import (
    CONFLICT_POLICIES,
    DUPLICATE_POLICIES,
    MODES,
    Config,
    check_max_ttl,
    check_renew_interval,
    choice,
    config,
    limits,
)
from celery_lease.exceptions import (
    DuplicateResult,
    LeaseConfigError,
    LeaseError,
    LeaseLost,
    LeaseNotAcquired,
    StaleFencingToken,
    StoreUnavailable,
)
from celery_lease.keys import KeySpec, scoped
from celery_lease.local import LocalLease
from celery_lease.renewal import HeldLease, renewer
from celery_lease.results import AcceptedResult, Prepared, encode_result
from celery_lease.runtime import Runtime, runtime
from celery_lease.scope import (
    DEFER_MARKER,
    HEADER_DEFER_ID,
    HEADER_DEFERRALS,
    HEADER_DELAY,
    HEADER_KEYS,
    HEADER_NOT_BEFORE,
    HEADER_TENANT,
    authorize,
    publish_headers,
    resolve,
)
from celery_lease.stores.base import LeaseRecord, new_owner_id

__all__ = ["LeasedTask", "Runtime", "runtime"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Options:
    ttl: float
    renew_interval: float | None
    mode: str
    on_conflict: str
    on_duplicate: str
    commit: bool


class LeasedTask(Task):  # type: ignore[misc]
    """A Celery task that runs only while it holds a lease on its key.

    Options (task keywords or class attributes): ``lease_key``, ``lease_ttl``,
    ``lease_renew_interval``, ``lease_mode``, ``lease_on_conflict``,
    ``lease_on_duplicate``, ``lease_tenant``, ``lease_commit``. Unset ones
    take the app's ``lease_*`` settings.
    """

    lease_key: ClassVar[str | Callable[..., Any] | None] = None
    lease_ttl: ClassVar[float | None] = None
    lease_renew_interval: ClassVar[float | None] = None
    lease_mode: ClassVar[str | None] = None
    lease_on_conflict: ClassVar[str | None] = None
    lease_on_duplicate: ClassVar[str | None] = None
    lease_tenant: ClassVar[str | Callable[..., Any] | None] = None
    lease_commit: ClassVar[bool] = True
    #: ``lease_authorize(self, tenant, keys, args, kwargs) -> bool``: called in the
    #: worker before the claim; anything but ``True`` refuses the call
    #: (``LeaseUnauthorized``) before any look-up or duplicate decision.
    lease_authorize: ClassVar[Callable[..., Any] | None] = None

    _lease_track_started: ClassVar[bool] = False
    _lease_keyspec: ClassVar[KeySpec | None] = None
    _lease_tenantspec: ClassVar[KeySpec | None] = None

    # -- registration --------------------------------------------------------

    @classmethod
    def on_bound(cls, app: Any) -> None:
        super().on_bound(app)
        if cls.name is None or "run" not in _own_attrs(cls):
            return  # the base class itself, or an abstract subclass
        # The tracer would store STARTED before __call__, so a rejected copy
        # would overwrite the owner's final state: write STARTED ourselves
        # once we own the key.
        if cls.track_started:
            cls._lease_track_started = True
            cls.track_started = False
        run_static = _is_static(cls)
        func = cls.run.__func__ if hasattr(cls.run, "__func__") else cls.run
        cls._lease_keyspec = KeySpec(cls.name, func, cls.lease_key, bound=not run_static)
        if cls.lease_tenant is not None:
            cls._lease_tenantspec = KeySpec(cls.name, func, cls.lease_tenant, bound=not run_static)
        for attr, allowed in (
            ("lease_mode", MODES),
            ("lease_on_conflict", CONFLICT_POLICIES),
            ("lease_on_duplicate", DUPLICATE_POLICIES),
        ):
            value = getattr(cls, attr)
            if value is not None:
                choice(f"task {cls.name!r}: {attr}", value, allowed)
        for attr in ("lease_ttl", "lease_renew_interval"):
            value = getattr(cls, attr)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 < value < float("inf")
            ):
                raise LeaseConfigError(
                    f"task {cls.name!r}: {attr} must be a positive number of seconds, got "
                    + repr(value)
                )
        if cls.lease_ttl is not None:
            check_max_ttl(cls.lease_ttl, f"task {cls.name!r}: lease_ttl")
        if cls.lease_renew_interval is not None and cls.lease_ttl is not None:
            check_renew_interval(
                cls.lease_renew_interval, cls.lease_ttl, f"task {cls.name!r}: lease_renew_interval"
            )
        from celery_lease import signals

        signals.install(app)

    # -- publishing ----------------------------------------------------------

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Publish with the lease keys computed once, in a message header.

        Retries and redeliveries then use the same keys; a key template that
        does not fit the call fails here, naming the task and the argument.
        """
        headers = publish_headers(
            self,
            args or (),
            kwargs or {},
            dict(options.pop("headers", None) or {}),
            limits(self.app),
        )
        return super().apply_async(
            args, kwargs, task_id, producer, link, link_error, shadow, headers=headers, **options
        )

    def lease_keys_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[str]:
        """The lease keys of a call with these arguments (unscoped)."""
        return self._spec().keys(args, kwargs)

    def lease_tenant_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        spec = type(self)._lease_tenantspec
        if spec is None:
            return None
        return spec.keys(args, kwargs)[0]

    def _spec(self) -> KeySpec:
        spec = type(self)._lease_keyspec
        if spec is None:
            func = self.run.__func__ if hasattr(self.run, "__func__") else self.run
            spec = KeySpec(self.name, func, self.lease_key, bound=False)
            type(self)._lease_keyspec = spec
        return spec

    # -- reading results -------------------------------------------------------

    def accepted(self, *args: Any, **kwargs: Any) -> AcceptedResult | None:
        """The accepted result for the key of a call with these arguments, or None.

        Only the arguments the key needs are required: a template's fields, a
        callable's own parameters (the default key, a hash of every argument,
        needs them all). ``accepted(key="...")`` reads one key directly (with
        ``tenant="..."`` for a tenant-scoped task), unless the task's templates
        name an argument ``key`` themselves.
        """
        spec = self._spec()
        tenant_spec = type(self)._lease_tenantspec
        fields = set(spec.fields) | set(tenant_spec.fields if tenant_spec else ())
        if (
            not args
            and "key" in kwargs
            and "key" not in fields
            and set(kwargs) <= {"key", "tenant"}
        ):
            key, tenant = kwargs["key"], kwargs.get("tenant")
        else:
            key = spec.keys_for_lookup(args, kwargs)[0]
            tenant = tenant_spec.keys_for_lookup(args, kwargs)[0] if tenant_spec else None
        return runtime(self.app).results.accepted(scoped(key, tenant), tenant)

    @property
    def lease(self) -> HeldLease | LocalLease | None:
        """The lease the current execution holds; in a direct call ``task(...)``,
        a :class:`~celery_lease.local.LocalLease` (no store, token 0); else None."""
        req = self.request_stack.top
        held = getattr(req, "_celery_lease", None)
        if held is None and req is not None and req.called_directly:
            held = req._celery_lease = LocalLease(self, req.args or (), req.kwargs or {})
        return held

    # -- execution -------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request
        if req.called_directly or not req.id:
            # A direct call `task(...)` runs the body in the caller, unleased,
            # as Celery runs it without retries or a result backend.
            return super().__call__(*args, **kwargs)
        return _Execution(self, args, kwargs).run()

    def _options(self, cfg: Config) -> _Options:
        # Worked out once per (settings, task options), not on every execution.
        own = (
            self.lease_ttl,
            self.lease_renew_interval,
            self.lease_mode,
            self.lease_on_conflict,
            self.lease_on_duplicate,
            self.lease_commit,
        )
        cached = self.__dict__.get("_lease_options_cache")
        if cached is not None and cached[0] is cfg and cached[1] == own:
            opts: _Options = cached[2]
            return opts
        opts = self._make_options(cfg)
        self._lease_options_cache = (cfg, own, opts)
        return opts

    def _make_options(self, cfg: Config) -> _Options:
        ttl = float(self.lease_ttl if self.lease_ttl is not None else cfg.ttl)
        renew = self.lease_renew_interval
        if renew is None and self.lease_ttl is None:
            renew = cfg.renew_interval
        # Checked before the claim (and for every task at worker start): a lease
        # granted with a schedule the timer refuses, or whose local view ends
        # before its first renewal, would stay blocked until its TTL ran out.
        check_max_ttl(ttl, f"task {self.name!r}: lease_ttl")
        if cfg.clock_drift is not None and not cfg.clock_drift < ttl:
            raise LeaseConfigError(
                f"task {self.name!r}: lease_clock_drift ({cfg.clock_drift}) must be below the "
                f"task's lease_ttl ({ttl})"
            )
        check_renew_interval(
            renew, ttl, f"task {self.name!r}: lease_renew_interval", cfg.clock_drift
        )
        return _Options(
            ttl=ttl,
            renew_interval=renew,
            mode=self.lease_mode or cfg.mode,
            on_conflict=self.lease_on_conflict or cfg.on_conflict,
            on_duplicate=self.lease_on_duplicate or cfg.on_duplicate,
            commit=bool(self.lease_commit),
        )


class _Execution:
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
        self.keys, self.tenant = resolve(
            task,
            args,
            kwargs,
            getattr(self.req, HEADER_KEYS, None),
            getattr(self.req, HEADER_TENANT, None),
            self.cfg.limits,
        )
        self.scoped = [scoped(k, self.tenant) for k in self.keys]
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

    # -- the whole path ----------------------------------------------------------

    def run(self) -> Any:
        authorize(self.task, self.tenant, self.keys, self.args, self.kwargs)
        held = self.claim()
        self.held = held
        finished = False
        try:
            # Renewed from the grant on: the look-up and the STARTED write below
            # can take longer than the TTL on a loaded worker (seen: 1.4 s with a
            # 100-thread pool on SQLite), and the lease must not lapse meanwhile.
            held.add_lost_callback(self._on_lost)
            renewer().add(held)
            if self.opts.commit:
                self.prepare(held)
            if self.task._lease_track_started and not self._ignore_result():
                self.task.backend.store_result(
                    self.task_id,
                    {"pid": _pid(), "hostname": self.hostname},
                    STARTED,
                    request=self.req,
                )
            if not held.held:
                # The lease lapsed before the body began (the worker stalled, the
                # store was away): run nothing without it. Released, re-queued;
                # the copy claims again (not a deferral: no lease_defer_max count).
                self.release()
                self.republish(0.0, reason="the lease lapsed before the body started")
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
            except Exception:  # the body's own error, re-raised for Celery to store
                held.detach()
                self._unless_overtaken(held)
                raise
            if not held.held and held.lost_reason is None:
                # The local view ran out while the body ran (a pause): say so
                # now, so LEASE_LOST is sent before the commit decides FENCED.
                held.mark_lost("the lease's local validity ran out while the body ran")
            if self.opts.commit and self.rt.renew_through_commit:
                held.silence()
            else:
                held.detach()
            if not self.opts.commit:
                finished = True
                self.release()
                return retval
            result = self.commit(held, retval)
            finished = True
            return result
        finally:
            held.detach()
            self.req._celery_lease = None
            if not finished:
                self.release()

    # -- claiming ------------------------------------------------------------------

    def claim(self) -> HeldLease:
        store = self.rt.store
        self._wait_until_not_before()
        deadline = time.monotonic() + self.cfg.store_retry
        waited_until = time.monotonic() + self.cfg.wait_timeout
        delay = 0.05
        owner_id = _new_owner_id()
        while True:
            sent = time.monotonic()
            started = time.perf_counter()
            try:
                if self.opts.commit and self.rt.results.colocated:
                    lease, self.prepared = self.rt.results.claim_prepared(
                        self.scoped,
                        ttl=self.opts.ttl,
                        owner_id=owner_id,
                        meta=self.meta,
                        task_id=self.task_id,
                        once=self.opts.mode == "once",
                    )
                else:
                    lease = store.claim(
                        self.scoped, ttl=self.opts.ttl, owner_id=owner_id, meta=self.meta
                    )
            except StoreUnavailable as e:
                if time.monotonic() < deadline:
                    time.sleep(_jitter(delay))
                    delay = min(delay * 2, 1.0)
                    continue
                metrics.claims.labels("store_unavailable").inc()
                self.defer(
                    self._default_countdown(), f"lease store unavailable: {e}", counted=False
                )
            metrics.claim_latency.observe(time.perf_counter() - started)
            if lease is not None:
                metrics.claims.labels("granted").inc()
                if logger.isEnabledFor(logging.INFO):
                    logger.info(
                        "lease granted",
                        extra={
                            "action": "claim",
                            "lease_key": self.key,
                            "token": lease.token,
                            "task_id": self.task_id,
                        },
                    )
                return HeldLease(
                    store,
                    lease,
                    renew_interval=self.opts.renew_interval,
                    clock_drift=self.cfg.clock_drift,
                    sent_at=sent,
                )
            try:
                holder = store.inspect(self.key)
            except StoreUnavailable:
                holder = None
            remaining = holder.remaining if holder is not None else self.opts.ttl
            if holder is not None and holder.task_id == self.task_id:
                # A redelivered copy of this very task met its live owner: defer,
                # never drop (acking it would ack the owner's message too).
                self.defer(remaining, "a copy of this task id holds the lease", counted=False)
            policy = self.opts.on_conflict
            if policy == "reject":
                metrics.claims.labels("rejected").inc()
                # The caller learns the key is busy, not who holds it: an owner
                # id names another execution (with its token, all a forged
                # release needs).
                self.reject(LeaseNotAcquired(self.key, None, remaining), reason="conflict")
            if policy == "wait" and time.monotonic() < waited_until:
                time.sleep(min(_jitter(delay), max(0.0, waited_until - time.monotonic())))
                delay = min(delay * 2, 2.0)
                continue
            self.defer(remaining, "another owner holds the lease")

    def _wait_until_not_before(self) -> None:
        """A deferred copy that arrived early (this worker's clock runs ahead of
        the store's, so Celery's ETA passed too soon) waits out the rest here,
        before claiming, instead of deferring again at once, over and over."""
        delay = getattr(self.req, HEADER_DELAY, None)
        if isinstance(delay, (int, float)) and not isinstance(delay, bool) and delay > 0:
            time.sleep(min(float(delay), self.opts.ttl + 1.0))
            return
        not_before = getattr(self.req, HEADER_NOT_BEFORE, None)
        if not isinstance(not_before, (int, float)) or isinstance(not_before, bool):
            return
        try:
            early = float(not_before) - self.rt.clock()
        except StoreUnavailable:
            return
        if early > 0:
            time.sleep(min(early, self.opts.ttl + 1.0))

    def prepare(self, held: HeldLease) -> None:
        deadline = held.valid_until
        prepared = self.prepared  # brought by the claim (leases in the result database)
        while prepared is None:
            try:
                prepared = self.rt.results.prepare(
                    held.lease, self.task_id, once=self.opts.mode == "once"
                )
            except StaleFencingToken:
                self.release()
                self.defer(
                    self._default_countdown(),
                    "a newer owner claimed before the body",
                    counted=False,
                )
            except StoreUnavailable as e:
                if time.monotonic() + 0.5 < deadline:
                    time.sleep(0.2)
                    continue
                self.release()
                self.defer(
                    self._default_countdown(), f"result database unavailable: {e}", counted=False
                )
        if prepared.task_token is not None:
            # A late redelivery of a task whose result was accepted: never run it
            # again. The execution that committed may have died before Celery
            # stored SUCCESS (SIGKILL, OOM kill, a hard time limit; or a commit
            # whose reply was lost, re-published as "outcome unknown"): then the
            # backend would say PENDING forever. Make it say what the table says,
            # while this copy still holds the lease.
            self._store_accepted(prepared.task_token)
            self.release()
            metrics.claims.labels("redelivery").inc()
            self.event(events.LEASE_REJECTED, reason="redelivery of an accepted task")
            raise Ignore()
        if self._may_be_a_late_copy() and self._ended_with_a_lease_outcome():
            # Likewise a late copy (a restored message, a deferred copy) of a task
            # that an execution already ended as FENCED, LEASE_LOST, duplicate...:
            # run again, it would turn a final FAILURE into SUCCESS after the fact.
            self.release()
            metrics.claims.labels("redelivery").inc()
            self.event(events.LEASE_REJECTED, reason="redelivery of a task that already ended")
            raise Ignore()
        if prepared.duplicate_token is not None:
            self.release()
            self.duplicate(DuplicateResult(self.key, self._shown_token(prepared.duplicate_token)))

    def _store_accepted(self, token: int) -> None:
        """Store SUCCESS with this task id's accepted value unless the backend has it.

        Read first, write only if needed: a write also returns a chord part, and
        the execution that committed returned it already if it stored SUCCESS.
        """
        if self._ignore_result() or isinstance(self.task.backend, DisabledBackend):
            return
        try:
            accepted = self.rt.results.get(self.key, token)
        except StoreUnavailable as e:
            self.release()
            self.defer(
                self._default_countdown(), f"result database unavailable: {e}", counted=False
            )
        if accepted is None or accepted.task_id != self.task_id:
            return  # swept by retention: nothing left to say
        meta = self._backend_meta(self.task_id)
        if meta is None:
            self.release()
            self.defer(self._default_countdown(), "result backend unavailable", counted=False)
        if meta.get("status") != SUCCESS:
            self.task.backend.mark_as_done(self.task_id, accepted.value, request=self.req)

    def _backend_meta(self, task_id: str) -> dict[str, Any] | None:
        """The backend's record of ``task_id`` (None: the backend cannot be read)."""
        backend = self.task.backend
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
        req = self.req
        if getattr(req, HEADER_DEFER_ID, None) or getattr(req, "retries", 0):
            return True
        info = getattr(req, "delivery_info", None) or {}
        if info.get("redelivered") or getattr(req, "redelivered", False):
            return True
        return not _broker_marks_redeliveries(self.app)

    def _ended_with_a_lease_outcome(self, task_id: str | None = None) -> bool:
        """True if the backend state of ``task_id`` (default: this task's) is a
        FAILURE celery-lease decided."""
        backend = self.task.backend
        if self._ignore_result() or isinstance(backend, DisabledBackend):
            return False
        meta = self._backend_meta(self.task_id if task_id is None else task_id)
        if meta is None:
            return False  # cannot tell: run (the commit is fenced anyway)
        return meta.get("status") == FAILURE and isinstance(meta.get("result"), LeaseError)

    # -- the commit ----------------------------------------------------------------

    def commit(self, held: HeldLease, retval: Any) -> Any:
        encoded = encode_result(
            retval, task_name=self.task.name, max_bytes=self.cfg.result_max_bytes
        )
        delay = 0.1
        # Retries end when the lease's validity as of the body's end does: the
        # renewals that go on through the commit must not keep a commit retrying
        # against a result database that stays down.
        deadline = held.valid_until
        while True:
            try:
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
                )
                held.released = True
                return retval
            except StaleFencingToken as e:
                held.released = True
                metrics.stale_commits.inc()
                self.not_done(e, events.FENCED)
            except DuplicateResult as e:
                held.released = True
                self.duplicate(DuplicateResult(e.key, self._shown_token(e.accepted_token)))
            except StoreUnavailable as e:
                if time.monotonic() + delay < deadline:
                    time.sleep(_jitter(delay))
                    delay = min(delay * 2, 1.0)
                    continue
                # The outcome is unknown and the lease has run out: redo. If the
                # commit did land, the re-run is rejected as a redelivery.
                self.event(events.FENCED, reason=f"store unavailable at commit: {e}")
                self.republish(0.0, reason="commit outcome unknown")

    # -- outcomes --------------------------------------------------------------------

    def not_done(self, exc: LeaseError, state: str) -> NoReturn:
        """The body ran but its result was not accepted (fenced, or the lease was lost)."""
        token = self.held.token if self.held else None
        newer: AcceptedResult | None = None
        holder = None
        try:
            newer = self.rt.results.accepted(self.key, self.tenant)
            holder = self.rt.store.inspect(self.key)
        except StoreUnavailable:
            pass
        self._leave_to_own_copy(state, token, holder)
        taken_over = (newer is not None and token is not None and newer.token > token) or (
            holder is not None and holder.live and not self._finished_elsewhere(holder, newer)
        )
        if not taken_over:
            # Nobody newer did or is doing this key's work: redo, never lose it.
            self.event(state, token=token, reason="lease lapsed with no new owner: re-queued")
            self.republish(0.0, reason="lease lapsed with no new owner")
        self._store_failure(exc)
        self.event(state, token=token, reason=str(exc))
        raise Ignore()

    def _leave_to_own_copy(self, state: str, token: int | None, holder: LeaseRecord | None) -> None:
        """Raise (storing nothing) if another execution of this task id owns its outcome.

        A copy that lost its lease must never write the backend state of a task
        id another copy finished (a stalled copy 1 resuming with an error or a
        ``Retry`` after copy 2 stored SUCCESS), nor of one another copy is
        running. Returns if no other execution of this task id committed or
        holds the key.
        """
        try:
            mine = self.rt.results.for_task(self.task_id)
        except StoreUnavailable:
            mine = None  # cannot tell: the key's holder still can
        if mine is not None:
            # Another execution of this task id won: its SUCCESS stands. It may
            # have died before storing it; then a copy stores it (prepare()).
            self.event(state, token=token, reason="another execution of this task id committed")
            meta = None if self._ignore_result() else self._backend_meta(self.task_id)
            if meta is not None and meta.get("status") != SUCCESS:
                self.defer(self._default_countdown(), "store the accepted result", counted=False)
            raise Ignore()
        if holder is not None and holder.live and holder.task_id == self.task_id:
            # Another execution of this task id holds the key: maybe a restored
            # copy of this very message, sharing its delivery tag, whose unacked
            # entry this execution's ack would remove: a SIGKILL of it would then
            # requeue nothing. Leave a deferred copy behind as its crash cover,
            # as a redelivered copy that meets its live owner does.
            self.event(state, token=token, reason="another execution of this task id holds it")
            self.defer(holder.remaining, "a copy of this task id holds the lease", counted=False)

    def _unless_overtaken(self, held: HeldLease) -> None:
        """The body raised (an error, ``Retry``): let Celery store that, unless
        this execution lost its lease and another copy of its task id owns the
        outcome (then raise, storing nothing)."""
        if held.held:
            return  # still the owner: the outcome is this execution's to store
        try:
            holder = self.rt.store.inspect(self.key)
        except StoreUnavailable:
            holder = None
        if holder is not None and holder.token == held.token:
            holder = None  # this execution's own lease, not yet expired in the store
        self._leave_to_own_copy(events.LEASE_LOST, held.token, holder)

    def _finished_elsewhere(self, holder: LeaseRecord, newer: AcceptedResult | None) -> bool:
        """True if ``holder`` is a late copy of a task that already ended.

        Such a copy holds the key only until its :meth:`prepare` rejects it:
        the same two checks, here on the holder's task id (its result was
        accepted, or its backend state is a FAILURE celery-lease decided). It
        will not do this key's work, so it has not taken over (seen in a chaos
        run: a redelivered copy of the key's last task claimed the key that
        this execution's lease left when the store stalled past the TTL, and
        this task ended FAILURE with nobody left to do its work).
        """
        if holder.task_id is None:
            return False
        if newer is not None and newer.task_id == holder.task_id:
            return True
        try:
            if self.rt.results.for_task(holder.task_id) is not None:
                return True
        except StoreUnavailable:
            pass  # the result database cannot tell: the backend still may
        return self._ended_with_a_lease_outcome(holder.task_id)

    def duplicate(self, exc: DuplicateResult) -> NoReturn:
        metrics.claims.labels("duplicate").inc()
        if self.opts.on_duplicate == "return":
            try:
                accepted = self.rt.results.accepted(self.key, self.tenant)
            except StoreUnavailable as e:
                # Not a FAILURE (a later copy would be rejected as "ended"): wait it out.
                self.defer(
                    self._default_countdown(), f"result database unavailable: {e}", counted=False
                )
            if not self._ignore_result():
                self.task.backend.mark_as_done(
                    self.task_id, accepted.value if accepted else None, request=self.req
                )
            self.event(events.LEASE_REJECTED, reason="duplicate: returned the accepted result")
            raise Ignore()
        self.reject(exc, reason="duplicate")

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

        ``lease_defer_max`` bounds deferrals behind *other* task ids' live leases
        (``counted``): it exists to end an endless conflict, so only such a
        deferral spends it. Waiting behind a copy of this very task id (the
        chain ends when that copy commits, or takes over if it dies), and
        waiting out an unreachable lease store or result database, never do:
        an outage of any length delays the work, it never turns it into a
        FAILURE (with the defaults a 17-minute outage did).
        """
        deferrals = self._deferrals()
        if counted and deferrals >= self.cfg.defer_max:
            metrics.claims.labels("rejected").inc()
            self.reject(
                LeaseNotAcquired(self.key, None, remaining),
                reason=f"deferred {deferrals} times behind other tasks (lease_defer_max)",
            )
        countdown = remaining + random.uniform(0.05, 0.05 + min(1.0, 0.1 * self.opts.ttl))
        metrics.claims.labels("deferred").inc()
        self.republish(countdown, reason=reason, deferrals=deferrals + 1 if counted else deferrals)

    def _deferrals(self) -> int:
        """Counted deferrals so far (a header anyone may set: never below 0)."""
        value = getattr(self.req, HEADER_DEFERRALS, 0)
        if isinstance(value, bool):
            return 0
        try:
            return max(0, int(value or 0))
        except (TypeError, ValueError):
            return 0

    def republish(self, countdown: float, *, reason: str, deferrals: int | None = None) -> NoReturn:
        """Publish this task id again (at most one outstanding copy), then Ignore."""
        vt = self.cfg.visibility_timeout
        if vt is not None:
            # The Redis transport restores (and so multiplies) countdown messages
            # held past its visibility timeout.
            countdown = min(countdown, vt / 2)
        defer_id = getattr(self.req, HEADER_DEFER_ID, None) or uuid.uuid4().hex
        marker = DEFER_MARKER + self.task_id
        # The marker says "a copy of this chain is queued", so it is set only
        # *after* the copy is published: set before, a worker dying in between
        # left a marker with no copy behind it, and the redelivered message
        # was then dropped as a duplicate of a copy that did not exist.
        try:
            queued_by = self.rt.store.marker(marker)
            queued_elsewhere = queued_by is not None and queued_by != defer_id
        except StoreUnavailable:
            queued_elsewhere = False  # cannot check: a second copy beats losing the work
        if queued_elsewhere:
            # Another copy of this task id is deferred already: drop this one.
            self.event(events.LEASE_REJECTED, reason="a deferred copy is already queued")
            raise Ignore()
        headers = dict(getattr(self.req, "headers", None) or {})
        headers.update(
            {
                HEADER_KEYS: self.keys,
                HEADER_TENANT: self.tenant,
                HEADER_DEFER_ID: defer_id,
                HEADER_DEFERRALS: deferrals if deferrals is not None else self._deferrals(),
            }
        )
        when: dict[str, Any] = {"countdown": countdown}
        headers[HEADER_NOT_BEFORE] = None
        headers[HEADER_DELAY] = None
        if countdown > 0:
            # Celery turns a countdown into an ETA by this worker's clock, and every
            # worker that receives the copy waits for it by its own: a clock one
            # hour fast here would hold the copy an hour everywhere else. Take the
            # ETA from the lease store's clock, the one the lease itself runs on;
            # a receiver whose clock runs ahead waits out the rest (see claim()).
            try:
                eta = self.rt.clock() + countdown
                when = {"eta": datetime.fromtimestamp(eta, tz=timezone.utc)}
                headers[HEADER_NOT_BEFORE] = eta
            except StoreUnavailable:
                # No clock answers (the store is down): a countdown would become
                # an ETA by this worker's clock, maybe an hour off. Publish the
                # copy for now instead; its receiver waits the delay out by its
                # monotonic clock, before claiming (_wait_until_not_before).
                when = {"countdown": 0}
                headers[HEADER_DELAY] = round(countdown, 3)
        sig = self.task.signature_from_request(
            self.req, self.args, self.kwargs, headers=headers, **when
        )
        try:
            sig.apply_async()
        except events.broker_errors(self.app) as e:
            # The copy could not be handed to the broker (it is restarting): give
            # this message back instead of ending the task FAILURE (or acking the
            # work away); the broker delivers it again once it is back. Without
            # acks_late the message is gone already: let the error stand.
            if not self.task.acks_late:
                raise
            logger.warning(
                "could not re-publish %s (%s): message requeued",
                self.task_id,
                e,
                extra={"action": "republish_failed", "task_id": self.task_id},
            )
            raise Reject(e, requeue=True) from e
        try:
            # False: another chain marked meanwhile; two copies are harmless.
            self.rt.store.mark(marker, defer_id, ttl=countdown + max(self.opts.ttl, 10.0))
        except StoreUnavailable:
            pass
        self.event(events.LEASE_DEFERRED, countdown=round(countdown, 3), reason=reason)
        raise Ignore()

    # -- helpers ---------------------------------------------------------------------

    def release(self) -> None:
        held = self.held
        if held is None or held.released:
            return
        try:
            held.release()
        except StoreUnavailable as e:
            logger.warning(
                "could not release %s (it will expire): %s",
                self.key,
                e,
                extra={"action": "release_failed", "lease_key": self.key},
            )

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
                "%s %s",
                state,
                self.task_id,
                extra={"action": state.lower(), "lease_key": self.key, "task_id": self.task_id},
            )

    def _store_failure(self, exc: BaseException) -> None:
        if not self._ignore_result():
            self.task.backend.mark_as_failure(self.task_id, exc, request=self.req)

    def _ignore_result(self) -> bool:
        return bool(self.task.ignore_result or getattr(self.req, "ignore_result", False))

    def _default_countdown(self) -> float:
        return min(self.opts.ttl, 5.0)


#: (pid, "hostname:pid:") of this process, for owner ids.
_owner_prefix: tuple[int, str] | None = None


def _new_owner_id() -> str:
    """``hostname:pid:random``, as :func:`new_owner_id` makes it, without a
    ``gethostname()`` call per task."""
    global _owner_prefix
    pid = os.getpid()
    prefix = _owner_prefix
    if prefix is None or prefix[0] != pid:
        prefix = _owner_prefix = (pid, new_owner_id().rsplit(":", 1)[0] + ":")
    return prefix[1] + secrets.token_hex(8)


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


def _jitter(delay: float) -> float:
    return delay * random.uniform(0.5, 1.5)


def _pid() -> int:
    return os.getpid()


def _own_attrs(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in (LeasedTask, Task, object):
            break
        names.update(vars(klass))
    return names


def _is_static(cls: type) -> bool:
    import inspect

    return isinstance(inspect.getattr_static(cls, "run"), staticmethod)
