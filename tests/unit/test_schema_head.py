"""The revision a worker expects (``celery_lease.sql.migrate.HEAD``) is the newest
migration Alembic finds: a worker compares databases with it without loading
Alembic, so a new migration that forgets to move it would let a worker run on a
schema one revision behind."""

from __future__ import annotations

from alembic.script import ScriptDirectory

from celery_lease.sql.migrate import HEAD, _alembic_config


def test_head_is_the_newest_migration() -> None:
    script = ScriptDirectory.from_config(_alembic_config("sqlite://"))
    assert script.get_heads() == [HEAD]
