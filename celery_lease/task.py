"""``LeasedTask``: claim at start, renew from a timer, fenced commit, release.

In the worker child (:class:`celery_lease.execution.Execution`)::

    keys (from the message header, else derived) -> claim -> prepare
    body (self.lease held, renewed by the process's timer thread)
    detach the renewer -> commit (fenced) + release in one step

What happens at each point (busy, a redelivery of an accepted or ended task,
a duplicate, a refused commit, a lost lease, an outage...) is decided by
:mod:`celery_lease.decide`, whose docstring holds the table, one line a row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from celery import Task

from celery_lease.config import CONFLICT_POLICIES, DUPLICATE_POLICIES, MODES, Config, limits
from celery_lease.exceptions import LeaseConfigError
from celery_lease.execution import Execution
from celery_lease.keys import KeySpec, scoped
from celery_lease.local import LocalLease
from celery_lease.reads import _broker_marks_redeliveries as _broker_marks_redeliveries
from celery_lease.renewal import HeldLease
from celery_lease.results import AcceptedResult
from celery_lease.runtime import Runtime, runtime
from celery_lease.scope import DEFER_MARKER as DEFER_MARKER
from celery_lease.scope import HEADER_DEFER_ID as HEADER_DEFER_ID
from celery_lease.scope import HEADER_DEFERRALS as HEADER_DEFERRALS
from celery_lease.scope import HEADER_DELAY as HEADER_DELAY
from celery_lease.scope import HEADER_KEYS as HEADER_KEYS
from celery_lease.scope import HEADER_NOT_BEFORE as HEADER_NOT_BEFORE
from celery_lease.scope import HEADER_TENANT as HEADER_TENANT
from celery_lease.scope import publish_headers, resent_headers, store_key
from celery_lease.setting_readers import check_max_ttl, check_renew_interval, choice

__all__ = ["LeasedTask", "Runtime", "runtime"]


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

    def signature_from_request(
        self, request: Any = None, args: Any = None, kwargs: Any = None, **options: Any
    ) -> Any:
        """Celery's copy of a request (``retry``, and our own deferrals), with the
        scope headers the templates give left for :meth:`apply_async` to derive
        from the copy's arguments, which ``self.retry(args=...)`` may change."""
        sig = super().signature_from_request(request, args, kwargs, **options)
        if "headers" in sig.options:
            sig.options["headers"] = resent_headers(self, sig.options["headers"])
        return sig

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
            # The key as the task names it: normalised like the templates' output.
            full, tenant = store_key(kwargs["key"], kwargs.get("tenant"))
        else:
            key = spec.keys_for_lookup(args, kwargs)[0]
            tenant = tenant_spec.keys_for_lookup(args, kwargs)[0] if tenant_spec else None
            full = scoped(key, tenant)
        return runtime(self.app).results.accepted(full, tenant)

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
        return Execution(self, args, kwargs).run()

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
