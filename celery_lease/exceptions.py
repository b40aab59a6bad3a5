"""One exception root for everything celery-lease raises.

Driver errors (redis-py, SQLAlchemy/psycopg, sqlite3) are translated at the
store boundary into :class:`StoreUnavailable` (transient: the caller may retry
within the lease's validity) so no caller ever needs a catch-all handler.
"""

from __future__ import annotations

from celery_lease.redaction import redact

__all__ = [
    "DuplicateResult",
    "KeyLimitExceeded",
    "LeaseConfigError",
    "LeaseError",
    "LeaseLost",
    "LeaseNotAcquired",
    "LeaseScopeMismatch",
    "LeaseUnauthorized",
    "ResultNotSerializable",
    "ResultTooLarge",
    "StaleFencingToken",
    "StoreUnavailable",
    "TaskEnded",
]


class LeaseError(Exception):
    """Root of every error celery-lease raises.

    Text arguments are redacted (:func:`celery_lease.redaction.redact`) when the
    error is made: its message, ``repr``, the log records and events that quote
    it, and its copy in the result backend never show a password from a URL.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class _Structured(LeaseError):
    """An error whose ``args`` are its constructor arguments.

    Celery's JSON result serializer rebuilds an exception as ``cls(*args)``, so
    the arguments, not the formatted message, must be in ``args``.
    """

    _message = ""

    def __init__(self, *args: object) -> None:
        # The arguments are data (keys, tokens) to rebuild the error from, kept
        # as given; only the message shown is redacted.
        Exception.__init__(self, *args)

    def __str__(self) -> str:
        return redact(self._message)


class LeaseNotAcquired(_Structured):
    """Another live owner holds (one of) the key(s)."""

    def __init__(self, key: str, holder: str | None = None, remaining: float | None = None):
        self.key = key
        self.holder = holder
        self.remaining = remaining
        detail = f" (held by {holder}, {remaining:.1f}s left)" if holder and remaining else ""
        super().__init__(key, holder, remaining)
        self._message = f"lease {key!r} is held by another owner{detail}"


class LeaseLost(LeaseError):
    """Ownership is gone: the lease expired, was evicted, or could not be renewed."""


class StaleFencingToken(_Structured):
    """A write carried a token older than the newest one issued for its key or resource."""

    def __init__(self, key: str, token: int, current: int | None = None, reason: str = ""):
        self.key = key
        self.token = token
        self.current = current
        self.reason = reason
        super().__init__(key, token, current, reason)
        msg = f"stale fencing token {token} for {key!r}"
        if current is not None:
            msg += f" (newest is {current})"
        self._message = msg + (f": {reason}" if reason else "")


class TaskEnded(StaleFencingToken):
    """A commit refused because its task id has ended: another execution of it
    was refused and celery-lease recorded the task id's FAILURE (its end mark)
    before storing it, so no copy of that task id is accepted after it.
    ``token`` is that execution's (the mark's), not the refused commit's."""

    def __init__(self, key: str, token: int, task_id: str | None = None):
        super().__init__(key, token, None, f"task {task_id} has ended (its FAILURE stands)")
        self.task_id = task_id
        self.args = (key, token, task_id)  # rebuilt as cls(*args) by Celery's JSON


class DuplicateResult(_Structured):
    """``once`` mode: the key already has an accepted result; this execution is a duplicate."""

    def __init__(self, key: str, accepted_token: int | None = None):
        self.key = key
        self.accepted_token = accepted_token
        super().__init__(key, accepted_token)
        self._message = f"key {key!r} already has an accepted result" + (
            f" (token {accepted_token})" if accepted_token is not None else ""
        )


class LeaseConfigError(LeaseError, ValueError):
    """A ``lease_*`` setting, task option or key template is wrong."""


class KeyLimitExceeded(LeaseConfigError):
    """A call names more keys than ``lease_max_keys``, or a key or tenant longer
    than ``lease_max_key_length`` characters."""


class LeaseScopeMismatch(LeaseError):
    """A message's ``lease_keys`` / ``lease_tenant`` headers disagree with what the
    task's own templates derive from its arguments, or are malformed: refused
    before anything is claimed or read."""


class LeaseUnauthorized(LeaseError):
    """The task's ``lease_authorize`` hook refused this call's tenant and keys."""


class StoreUnavailable(LeaseError):
    """The lease store or result database could not be reached (transient)."""


class ResultNotSerializable(LeaseError, TypeError):
    """A task's return value cannot be stored as JSON."""


class ResultTooLarge(LeaseError, ValueError):
    """A task's JSON-encoded return value exceeds ``lease_result_max_bytes``."""
