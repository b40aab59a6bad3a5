"""The chords due their callback: ``celery_lease_chord_due``.

One row per chord whose last header member was counted by the ``lease+``
result backend, written in the count's transaction and deleted with the
chord's counter once Celery has published the callback (or failed the
chord). A row that outlives that window names a chord whose last member's
worker died between the count and the publish, which Celery acknowledges
without publishing anything: a worker publishes the callback then
(celery_lease/backend_chords.py).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "celery_lease_chord_due",
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("group_id", sa.Text(), nullable=False),
        sa.Column("callback", sa.Text(), nullable=False),
        sa.Column("due_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=True),
        sa.Column("claimed_until", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("key", name="pk_celery_lease_chord_due"),
    )
    op.create_index("ix_celery_lease_chord_due_due_at", "celery_lease_chord_due", ["due_at"])


def downgrade() -> None:
    op.drop_index("ix_celery_lease_chord_due_due_at", table_name="celery_lease_chord_due")
    op.drop_table("celery_lease_chord_due")
