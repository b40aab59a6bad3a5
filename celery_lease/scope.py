"""Where a leased call's keys and tenant come from, and who may use them.

The policy, the same at publish (``apply_async``) and in the worker:

- A task that declares ``lease_key`` (a template or callable) takes its keys
  from the message's *arguments*; one that declares ``lease_tenant`` takes its
  tenant from them. A ``lease_keys`` / ``lease_tenant`` header is then only a
  cache: one that disagrees with what the arguments give is refused
  (:class:`LeaseScopeMismatch`), before anything is claimed or read.
- What a task does not declare comes from the headers, both read together:
  ``lease_keys`` (else the default key, a hash of the arguments) and
  ``lease_tenant`` (else unscoped), each normalised by :func:`user_key` as a
  template's are. A malformed header is refused.
- Every call is held to ``lease_max_keys`` / ``lease_max_key_length``
  (:class:`KeyLimitExceeded`), and reserved keys (``t/...``,
  ``celery-lease/...``) are refused.
- The task's ``lease_authorize(self, tenant, keys, args, kwargs)`` hook, if
  any, runs in the worker before the claim, so no duplicate decision (``once``
  + ``return``) or conflict failure ever answers a call it refuses.

Anyone who can publish to the broker can already choose a task's arguments:
this module makes the headers no stronger than the arguments, and the hook is
where the caller's identity is checked against them. Against an untrusted
broker, use Celery's message signing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery_lease.exceptions import LeaseConfigError, LeaseScopeMismatch, LeaseUnauthorized
from celery_lease.keys import INTERNAL_PREFIX, KeyLimits, check_limits, scoped, user_key

if TYPE_CHECKING:
    from celery_lease.task import LeasedTask

__all__ = [
    "DEFER_MARKER",
    "HEADER_DEFERRALS",
    "HEADER_DEFER_ID",
    "HEADER_DEFER_REPLACES",
    "HEADER_DELAY",
    "HEADER_KEYS",
    "HEADER_NOT_BEFORE",
    "HEADER_TENANT",
    "authorize",
    "header",
    "publish_headers",
    "resent_headers",
    "resolve",
    "resolve_request",
    "resolve_scoped",
    "store_key",
]

HEADER_KEYS = "lease_keys"
HEADER_TENANT = "lease_tenant"
#: Counted deferrals of a task id so far (``lease_defer_max``).
HEADER_DEFERRALS = "lease_deferrals"
#: The id of one re-published copy of a task id (each copy has its own).
HEADER_DEFER_ID = "lease_defer_id"
#: The deferral marker a re-published copy replaces: the value its publisher
#: read (a defer id), or ``decide.ANY_MARKER`` (the marker was unreadable).
HEADER_DEFER_REPLACES = "lease_defer_replaces"
#: Store time before which a deferred copy must not claim (its ETA, in the store's clock).
HEADER_NOT_BEFORE = "lease_not_before"
#: Seconds a copy published without an ETA (no clock answered) waits before claiming.
HEADER_DELAY = "lease_delay"
#: Prefix of the store markers of an outstanding deferral of a task id: in the
#: reserved namespace no user key can reach (celery_lease.keys.scoped refuses it).
DEFER_MARKER = INTERNAL_PREFIX + "defer/"


def header(request: Any, name: str, default: Any = None) -> Any:
    """The ``name`` header of a task's request: a worker sets it on the request itself,
    ``Task.apply()`` (and so ``task_always_eager``) only in ``request.headers``."""
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return default if value is None else value


def resolve_request(
    task: LeasedTask,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    request: Any,
    limits: KeyLimits,
) -> tuple[list[str], str | None, list[str]]:
    """:func:`resolve_scoped` for the call ``request`` runs, from its headers."""
    return resolve_scoped(
        task,
        args,
        kwargs,
        header(request, HEADER_KEYS),
        header(request, HEADER_TENANT),
        limits,
    )


def resolve(
    task: LeasedTask,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    header_keys: Any,
    header_tenant: Any,
    limits: KeyLimits,
) -> tuple[list[str], str | None]:
    """``(keys, tenant)`` of a call: unscoped keys as the task names them, and its tenant."""
    keys, tenant, _ = resolve_scoped(task, args, kwargs, header_keys, header_tenant, limits)
    return keys, tenant


def resolve_scoped(
    task: LeasedTask,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    header_keys: Any,
    header_tenant: Any,
    limits: KeyLimits,
) -> tuple[list[str], str | None, list[str]]:
    """:func:`resolve`, and the keys as stores hold them (:func:`scoped`), made once."""
    tenant_spec = type(task)._lease_tenantspec
    if tenant_spec is not None:
        tenant: str | None = tenant_spec.keys(args, kwargs, limits)[0]
        if header_tenant is not None and header_tenant != tenant:
            raise LeaseScopeMismatch(
                f"task {task.name!r}: the message's lease_tenant header {_short(header_tenant)} "
                f"is not the tenant its arguments give ({_short(tenant)}); refused"
            )
    else:
        tenant = _header_tenant(task, header_tenant, limits)
    if task.lease_key is not None or not header_keys:
        keys = task._spec().keys(args, kwargs, limits)
        if header_keys and task.lease_key is not None and _as_list(header_keys) != keys:
            raise LeaseScopeMismatch(
                f"task {task.name!r}: the message's lease_keys header "
                f"({_short_keys(header_keys)}) is not what its arguments give "
                f"({_short_keys(keys)}); refused"
            )
    else:
        keys = _header_keys(task, header_keys, limits)
    # scoped() also refuses reserved keys (t/..., celery-lease/...).
    return keys, tenant, [scoped(key, tenant) for key in keys]


def store_key(key: str, tenant: str | None) -> tuple[str, str | None]:
    """A key and tenant as a task names them (its ``lease_key``'s output, a header,
    ``accepted(key=...)``, the CLI's KEY and ``--tenant``) as stores hold them: the
    store key, and the tenant as the result table records it. Every direct-key read
    goes through here, so it reads the record the task wrote, and a key in the
    shortened shape never reads the long key it imitates."""
    if not isinstance(key, str) or not key:
        raise LeaseConfigError(f"a lease key is a non-empty string, got {key!r}")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise LeaseConfigError(f"a tenant is a non-empty string, got {tenant!r}")
    normal = None if tenant is None else user_key(tenant)
    return scoped(user_key(key), normal), normal


def publish_headers(
    task: LeasedTask,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    headers: dict[str, Any],
    limits: KeyLimits,
) -> dict[str, Any]:
    """``headers`` checked as the worker will check them (refused here if it would refuse
    them), with the keys and tenant the task's templates give filled in.

    A template's keys and tenant are written as stores hold them: the worker
    compares them with what the arguments give. A caller's own header (the
    only scope of a task without that template) is sent as given: the worker
    normalises it (:func:`user_key`) once, and normalising twice would hash
    a long key again. The default key (a hash of the arguments) is left for
    the worker to derive from the same arguments.
    """
    keys, tenant = resolve(
        task, args, kwargs, headers.get(HEADER_KEYS), headers.get(HEADER_TENANT), limits
    )
    if task.lease_key is not None:
        headers[HEADER_KEYS] = keys
    if type(task)._lease_tenantspec is not None:
        headers[HEADER_TENANT] = tenant
    return headers


def resent_headers(task: LeasedTask, headers: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The headers of a message re-sent from a request (a retry, a deferral), without
    the ``lease_keys`` / ``lease_tenant`` the task's templates give: its arguments may
    have changed (``self.retry(args=...)``), and the publish derives them again.
    A header the task does not declare a template for is its only source: kept."""
    if not headers:
        return None if headers is None else dict(headers)
    out = dict(headers)
    if task.lease_key is not None:
        out.pop(HEADER_KEYS, None)
    if type(task)._lease_tenantspec is not None:
        out.pop(HEADER_TENANT, None)
    return out


def authorize(
    task: LeasedTask,
    tenant: str | None,
    keys: Sequence[str],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> None:
    """Run the task's ``lease_authorize`` hook; anything but ``True`` refuses the call."""
    hook = getattr(task, "lease_authorize", None)
    if hook is None:
        return
    if hook(tenant, list(keys), tuple(args), dict(kwargs)) is not True:
        raise LeaseUnauthorized(
            f"task {task.name!r}: lease_authorize refused tenant {_short(tenant)} for "
            f"{_short_keys(keys)}"
        )


def _header_tenant(task: LeasedTask, value: Any, limits: KeyLimits) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise LeaseScopeMismatch(
            f"task {task.name!r}: the lease_tenant header must be a non-empty string (a tenant "
            f"is a non-empty string), got {_short(value)}"
        )
    check_limits(task.name, [value], limits)
    # As a template's tenant is (KeySpec): a tenant in the shortened shape must
    # not land in the scope of the tenant whose shortened form it imitates.
    return user_key(value)


def _header_keys(task: LeasedTask, value: Any, limits: KeyLimits) -> list[str]:
    keys = _as_list(value)
    if keys is None:
        raise LeaseScopeMismatch(
            f"task {task.name!r}: the lease_keys header must be a list of keys, got "
            f"{type(value).__name__}"
        )
    check_limits(task.name, keys, limits)
    if not all(isinstance(k, str) and k for k in keys):
        raise LeaseScopeMismatch(
            f"task {task.name!r}: the lease_keys header must hold non-empty strings"
        )
    return [user_key(k) for k in keys]


def _as_list(value: Any) -> list[Any] | None:
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _short_keys(keys: Any) -> str:
    if not isinstance(keys, (list, tuple)):
        return _short(keys)
    head = ", ".join(_short(k) for k in keys[:3])
    return f"{len(keys)} keys: {head}{', ...' if len(keys) > 3 else ''}"
