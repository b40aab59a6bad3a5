"""Statements run on a caller's own SQLAlchemy connection (``fencing``), in
its transaction: the SQL stays in this package, the caller keeps its session."""

from __future__ import annotations

from sqlalchemy import Connection, text

from celery_lease.exceptions import LeaseConfigError
from celery_lease.sql.dialects import DIALECTS
from celery_lease.sql.queries import FENCE_CURRENT

__all__ = ["fence_current", "register_fence"]


def register_fence(connection: Connection, resource: str, token: int) -> bool:
    """Register ``token`` as ``resource``'s newest in ``connection``'s
    transaction, locking the fence row; False if a newer token is there."""
    dialect = DIALECTS.get(connection.dialect.name)
    if dialect is None:
        raise LeaseConfigError(
            f"fencing.guard supports PostgreSQL and SQLite, not {connection.dialect.name!r}"
        )
    row = connection.execute(
        text(dialect.register_fence), {"key": resource, "token": token}
    ).first()
    return row is not None


def fence_current(connection: Connection, resource: str) -> int | None:
    """The newest token registered for ``resource``, or None."""
    v = connection.execute(text(FENCE_CURRENT), {"key": resource}).scalar()
    return None if v is None else int(v)
