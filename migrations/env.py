"""Alembic environment for celery-lease's own tables.

Used by :func:`celery_lease.migrate` (and ``celery -A proj lease migrate``).
Only tables named ``celery_lease_*`` are compared or touched, so the
package's migrations can share a database with the application's own, and
the version is kept in ``celery_lease_alembic_version``.
"""

from __future__ import annotations

from typing import Any

from alembic import context
from sqlalchemy import create_engine, pool

from celery_lease.schema import VERSION_TABLE, metadata

config = context.config


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    if type_ == "table":
        return bool(name and name.startswith("celery_lease_") and name != VERSION_TABLE)
    return True


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        engine = create_engine(
            config.get_main_option("sqlalchemy.url") or "", poolclass=pool.NullPool
        )
        with engine.connect() as conn:
            _run(conn)
        engine.dispose()
    else:
        _run(connection)


def _run(connection: Any) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
        include_name=include_name,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
        include_name=include_name,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
