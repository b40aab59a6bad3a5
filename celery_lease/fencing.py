"""Fencing for your own tables and services.

A lease tells a worker it *may* act; a fence makes a stale worker's write
fail where it lands. Call :func:`guard` inside your own SQLAlchemy
transaction, right before the protected write::

    with engine.begin() as conn:
        fencing.guard(conn, f"account:{account_id}", self.lease.token)
        conn.execute(update(accounts).where(...).values(balance=accounts.c.balance + delta))

``guard`` records the token in ``celery_lease_fences`` for that resource and
raises :class:`StaleFencingToken` if a newer token was seen there already. The
fence row stays locked until your transaction ends, so two guarded writes to
one resource serialize, and a stale one can never land after a newer one.
The same token may write several times (a retry of the same grant).

For an HTTP service, send the token and key with the request
(:func:`headers`: ``Fencing-Token`` and ``Fencing-Key``) and have the service
keep the highest token per resource and refuse lower ones: the same rule,
enforced where the side effect lands.

Use the lease's key as the resource name to share the fence the lease store
already registers at each claim: a claim then fences out the previous
owner's writes even before the new owner writes anything.
"""

from __future__ import annotations

from typing import Protocol

from sqlalchemy import Connection, text

from celery_lease import db as q
from celery_lease.exceptions import LeaseConfigError, StaleFencingToken

__all__ = ["current", "guard", "headers"]


def guard(connection: Connection, resource: str, token: int) -> None:
    """Accept ``token`` for ``resource`` in the caller's transaction, or raise.

    Raises :class:`StaleFencingToken` when a newer token has been seen for
    ``resource``. Needs the celery-lease tables in that database
    (``celery_lease.migrate(url)``).
    """
    if not isinstance(resource, str) or not resource:
        raise LeaseConfigError(f"a fenced resource is a non-empty string, got {resource!r}")
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise LeaseConfigError(f"a fencing token is a non-negative integer, got {token!r}")
    now = q.NOW.get(connection.dialect.name)
    if now is None:
        raise LeaseConfigError(
            f"fencing.guard supports PostgreSQL and SQLite, not {connection.dialect.name!r}"
        )
    row = connection.execute(
        text(q.GUARD.format(now=now)), {"resource": resource, "token": token}
    ).first()
    if row is None:
        newest = connection.execute(text(q.GUARD_CURRENT), {"resource": resource}).scalar()
        raise StaleFencingToken(
            resource,
            token,
            None if newest is None else int(newest),
            "a newer token has written to this resource",
        )


def current(connection: Connection, resource: str) -> int | None:
    """The newest token seen for ``resource``, or None."""
    v = connection.execute(text(q.GUARD_CURRENT), {"resource": resource}).scalar()
    return None if v is None else int(v)


class _Fenced(Protocol):
    @property
    def key(self) -> str: ...
    @property
    def token(self) -> int: ...


def headers(lease: _Fenced) -> dict[str, str]:
    """HTTP headers that carry the fence to a service: ``Fencing-Token``, ``Fencing-Key``."""
    return {"Fencing-Token": str(lease.token), "Fencing-Key": lease.key}
