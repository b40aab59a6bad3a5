"""The SQL layer: the only code in celery-lease that executes SQL.

- :mod:`~celery_lease.sql.queries`: every statement, by name, rendered at import;
- :mod:`~celery_lease.sql.driver`: one :class:`Database` per URL and process
  (the SQLAlchemy engine, the dialect's statements);
- :mod:`~celery_lease.sql.pool`: the hand-written driver layer behind it
  (a free list of driver connections, :class:`Conn`, the PostgreSQL fast path);
- :mod:`~celery_lease.sql.errors`: driver errors as celery-lease's;
- :mod:`~celery_lease.sql.migrate`: Alembic (``celery_lease.migrate(url)``);
- :mod:`~celery_lease.sql.ops`: statements on a caller's own connection (fencing).
"""

from __future__ import annotations

from celery_lease.sql.driver import Database, database, normalize_sql_url
from celery_lease.sql.pool import PG_TRAFFIC, Conn, Rows, count_pg_traffic

__all__ = [
    "PG_TRAFFIC",
    "Conn",
    "Database",
    "Rows",
    "count_pg_traffic",
    "database",
    "normalize_sql_url",
]
