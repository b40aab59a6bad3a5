"""Fencing for your own tables and services.

A lease tells a worker it *may* act; a fence makes a stale worker's write
fail where it lands. Call :func:`guard` inside your own SQLAlchemy
transaction, right before the protected write (and before reading what it
changes), with the lease itself::

    with engine.begin() as conn:
        fencing.guard(conn, f"account:{account_id}", self.lease)
        conn.execute(update(accounts).where(...).values(balance=accounts.c.balance + delta))

``guard`` records the token in ``celery_lease_fences`` for that resource and
raises :class:`StaleFencingToken` if a newer token was seen there already. The
fence row stays locked until your transaction ends, so two guarded writes to
one resource serialize, and a stale one can never land after a newer one.
The same token may write several times (a retry of the same grant).

Given the lease (a :class:`~celery_lease.HeldLease`: ``self.lease`` in a task,
the lease of ``store.hold()``; or a :class:`~celery_lease.Lease` with
``store=``), ``guard`` then asks the lease store, while your transaction
holds the fence row, whether the lease is still the key's current grant, and
refuses it if not. That refuses an old owner that resumes while the new owner
is still working and has not written yet, whatever the store and whichever
database the fence is in: a write accepted with token n comes before every
guarded write of a newer owner to that resource (they wait for the fence
row), and once the lease has lapsed in the store, token n is refused. It costs one
``store.inspect`` per key of the lease (one round trip on Redis and the SQL
stores, two on etcd) per guard, and nothing on the claim.

Given only a token (an ``int``), ``guard`` compares with the newest token
*seen in that fence row*: it refuses the old owner only after a newer token
was recorded there. A claim records it there only when the leases live in
that database (the SQL stores register every claim in the key's fence row)
or when a committing task's claim registered it (``lease_commit=True``, the
result database, the lease's key as the resource). Pass the lease otherwise.

For an HTTP service, send the token and key with the request
(:func:`headers`: ``Fencing-Token`` and ``Fencing-Key``) and have the service
keep the highest token per resource and refuse lower ones: the same rule,
enforced where the side effect lands.
"""

from __future__ import annotations

from typing import Protocol

from sqlalchemy import Connection

from celery_lease.exceptions import LeaseConfigError, StaleFencingToken
from celery_lease.local import LocalLease
from celery_lease.renewal import HeldLease
from celery_lease.sql.ops import fence_current, register_fence
from celery_lease.stores.base import Lease, LeaseStore

__all__ = ["current", "guard", "headers"]


def guard(
    connection: Connection,
    resource: str,
    token: int | HeldLease | Lease | LocalLease,
    *,
    store: LeaseStore | None = None,
) -> None:
    """Accept ``token`` for ``resource`` in the caller's transaction, or raise.

    ``token``: the lease (a :class:`HeldLease`, or a :class:`Lease` with
    ``store=`` its lease store), or its bare token (see the module's doc for
    what a bare token cannot see). Raises :class:`StaleFencingToken` when a
    newer token has been seen for ``resource`` or, given a lease, when the
    lease store no longer grants that lease (it lapsed, was released or was
    evicted, or another owner claimed the key); :class:`StoreUnavailable` when
    the store cannot answer (the caller's transaction then rolls back). Needs
    the celery-lease tables in that database (``celery_lease.migrate(url)``).
    """
    held, lease, store, value = _what_to_check(token, store)
    if not isinstance(resource, str) or not resource:
        raise LeaseConfigError(f"a fenced resource is a non-empty string, got {resource!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LeaseConfigError(f"a fencing token is a non-negative integer, got {value!r}")
    if not register_fence(connection, resource, value):
        raise StaleFencingToken(
            resource,
            value,
            fence_current(connection, resource),
            "a newer token has written to this resource",
        )
    if lease is not None:
        assert store is not None
        # Asked only now, while this transaction holds the fence row: a newer
        # owner's guarded write waits for it, so what the store says here
        # stays true for every write of this transaction relative to theirs.
        _still_granted(resource, lease, store, held)


def _what_to_check(
    token: int | HeldLease | Lease | LocalLease, store: LeaseStore | None
) -> tuple[HeldLease | None, Lease | None, LeaseStore | None, object]:
    """guard's argument as (held lease, lease, its store, the token's value)."""
    if isinstance(token, LocalLease):
        token = token.token  # a direct call's: the bare token 0 (celery_lease/local.py)
    if isinstance(token, HeldLease):
        return token, token.lease, store or token.store, token.lease.token
    if isinstance(token, Lease):
        if store is None:
            raise LeaseConfigError(
                "fencing.guard needs the lease store to check a Lease: pass store=, "
                "or the HeldLease (self.lease in a task, the lease of store.hold())"
            )
        return None, token, store, token.token
    if store is not None:
        raise LeaseConfigError("fencing.guard: store= is for checking a Lease, not a bare token")
    return None, None, None, token


def _still_granted(resource: str, lease: Lease, store: LeaseStore, held: HeldLease | None) -> None:
    """Raise :class:`StaleFencingToken` unless ``store`` still grants ``lease``."""
    if held is not None and not held.held:
        # The local view gave up (lost, released, or out of validity): no store
        # answer can make acting on it safe.
        raise StaleFencingToken(
            resource,
            lease.token,
            None,
            f"the lease is no longer held: {held.lost_reason or 'released or run out'}",
        )
    for key in lease.keys:
        record = store.inspect(key)
        if (
            record is None
            or not record.live
            or record.owner_id != lease.owner_id
            or record.token != lease.token
        ):
            raise StaleFencingToken(
                resource,
                lease.token,
                None if record is None else record.token,
                f"the lease store no longer grants this lease on {key!r} "
                "(it lapsed or was released, evicted or claimed by a newer owner)",
            )


def current(connection: Connection, resource: str) -> int | None:
    """The newest token seen for ``resource``, or None."""
    return fence_current(connection, resource)


class _Fenced(Protocol):
    @property
    def key(self) -> str: ...
    @property
    def token(self) -> int: ...


def headers(lease: _Fenced) -> dict[str, str]:
    """HTTP headers that carry the fence to a service: ``Fencing-Token``, ``Fencing-Key``."""
    return {"Fencing-Token": str(lease.token), "Fencing-Key": lease.key}
