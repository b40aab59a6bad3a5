"""Leases, fenced results and fences.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "celery_lease_leases",
        sa.Column("lease_key", sa.Text(), nullable=False),
        sa.Column("owner_id", sa.Text(), nullable=True),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        sa.Column("ttl", sa.Double(), nullable=True),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("acquired_at", sa.Double(), nullable=True),
        sa.Column("renewed_at", sa.Double(), nullable=True),
        sa.Column("task_id", sa.Text(), nullable=True),
        sa.Column("task_name", sa.Text(), nullable=True),
        sa.Column("root_id", sa.Text(), nullable=True),
        sa.Column("tenant", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("lease_key", name="pk_celery_lease_leases"),
    )
    op.create_index("ix_celery_lease_leases_expires_at", "celery_lease_leases", ["expires_at"])
    op.create_table(
        "celery_lease_results",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("lease_key", sa.Text(), nullable=False),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        sa.Column("task_id", sa.Text(), nullable=True),
        sa.Column("task_name", sa.Text(), nullable=True),
        sa.Column("owner_id", sa.Text(), nullable=True),
        sa.Column("tenant", sa.Text(), nullable=True),
        sa.Column("root_id", sa.Text(), nullable=True),
        sa.Column(
            "result",
            sa.JSON().with_variant(postgresql.JSONB(), "postgresql"),
            nullable=True,
        ),
        sa.Column("accepted_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_celery_lease_results"),
        sa.UniqueConstraint(
            "lease_key", "fencing_token", name="uq_celery_lease_results_lease_key_fencing_token"
        ),
    )
    op.create_index("ix_celery_lease_results_task_id", "celery_lease_results", ["task_id"])
    op.create_index("ix_celery_lease_results_accepted_at", "celery_lease_results", ["accepted_at"])
    op.create_table(
        "celery_lease_fences",
        sa.Column("resource", sa.Text(), nullable=False),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("resource", name="pk_celery_lease_fences"),
    )


def downgrade() -> None:
    op.drop_table("celery_lease_fences")
    op.drop_index("ix_celery_lease_results_accepted_at", table_name="celery_lease_results")
    op.drop_index("ix_celery_lease_results_task_id", table_name="celery_lease_results")
    op.drop_table("celery_lease_results")
    op.drop_index("ix_celery_lease_leases_expires_at", table_name="celery_lease_leases")
    op.drop_table("celery_lease_leases")
