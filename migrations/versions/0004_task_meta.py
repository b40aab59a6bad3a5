"""The Celery result backend's table: task metadata as JSON.

``celery_lease_task_meta`` holds the records of ``celery_lease.backend.LeaseBackend``
(``result_backend = "lease+postgresql+psycopg://..."``): one row per key of
Celery's key-value protocol, the JSON Celery encoded, an expiry in the
database's clock, and ``token``, reserved for fencing a leased task's state
writes (nullable, written by nothing yet), so that change needs no migration.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-12
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "celery_lease_task_meta",
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=True),
        sa.Column("token", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("key", name="pk_celery_lease_task_meta"),
    )
    op.create_index(
        "ix_celery_lease_task_meta_expires_at", "celery_lease_task_meta", ["expires_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_celery_lease_task_meta_expires_at", table_name="celery_lease_task_meta")
    op.drop_table("celery_lease_task_meta")
