"""The end marks: ``celery_lease_ended``.

One row per task id whose FAILURE celery-lease decided after its result was
refused; every commit checks it, so no copy of that task id is accepted over
the FAILURE (celery_lease/result_end.py).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "celery_lease_ended",
        sa.Column("task_id", sa.Text(), nullable=False),
        sa.Column("lease_key", sa.Text(), nullable=False),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        sa.Column("ended_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("task_id", name="pk_celery_lease_ended"),
    )
    op.create_index("ix_celery_lease_ended_ended_at", "celery_lease_ended", ["ended_at"])


def downgrade() -> None:
    op.drop_index("ix_celery_lease_ended_ended_at", table_name="celery_lease_ended")
    op.drop_table("celery_lease_ended")
