"""Registrations per task id: ``celery_lease_registrations``, and
``celery_lease_register_lookup_v2`` (PostgreSQL), which writes them.

With the leases outside the result database, each copy's registration (right
after its claim, before its body) now also records its token under its task
id, in the same server-side call: the result backend's fenced write of a
final state (FAILURE, a lock-only copy's SUCCESS) is refused when a newer copy
of the *same* task id registered, which the key's fence row (the newest
registration of any task id) cannot say.

``celery_lease_register_lookup_v1`` stays installed: workers of the previous
release call it during a rolling upgrade (their registrations fence as before,
without the task id's row). The text below is frozen:
tests/contract/test_migrations.py checks that it is celery_lease.sql.functions'.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-14
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

REGISTER_ARGS = "text, bigint, text, boolean"

CREATE_REGISTER_LOOKUP = """
CREATE OR REPLACE FUNCTION celery_lease_register_lookup_v2(
    p_key text, p_token bigint, p_task_id text, p_once boolean
) RETURNS TABLE (registered bigint, task_token bigint, duplicate_token bigint)
LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
DECLARE
    v bigint;
BEGIN
INSERT INTO celery_lease_fences AS fe (resource, fencing_token, updated_at)
VALUES (p_key, p_token, extract(epoch FROM clock_timestamp())::double precision)
ON CONFLICT (resource) DO UPDATE SET
    fencing_token = excluded.fencing_token, updated_at = excluded.updated_at
WHERE fe.fencing_token <= excluded.fencing_token
RETURNING fencing_token INTO v;
    IF NOT FOUND THEN
        RETURN QUERY SELECT NULL::bigint, NULL::bigint, NULL::bigint;  -- a newer token is there
        RETURN;
    END IF;
    -- The task id's registration: the same round trip, after the fence row's.
INSERT INTO celery_lease_registrations AS rg (resource, task_id, fencing_token, registered_at)
SELECT fe.resource, CAST(p_task_id AS text), fe.fencing_token,
       extract(epoch FROM clock_timestamp())::double precision
FROM celery_lease_fences AS fe
WHERE fe.resource = p_key AND fe.fencing_token = p_token AND p_task_id IS NOT NULL
ON CONFLICT (resource, task_id) DO UPDATE SET
    fencing_token = excluded.fencing_token, registered_at = excluded.registered_at
WHERE rg.fencing_token <= excluded.fencing_token;
    -- A new statement: a snapshot taken after the registration's wait for the fence row.
    RETURN QUERY SELECT v,
        (SELECT r.fencing_token FROM celery_lease_results AS r WHERE r.task_id = p_task_id
        ORDER BY r.fencing_token DESC LIMIT 1),
        (SELECT r.fencing_token FROM celery_lease_results AS r
        WHERE r.lease_key = p_key AND p_once ORDER BY r.fencing_token LIMIT 1);
END
$fn$
"""


def upgrade() -> None:
    op.create_table(
        "celery_lease_registrations",
        sa.Column("resource", sa.Text(), nullable=False),
        sa.Column("task_id", sa.Text(), nullable=False),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        sa.Column("registered_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("resource", "task_id", name="pk_celery_lease_registrations"),
    )
    op.create_index(
        "ix_celery_lease_registrations_registered_at",
        "celery_lease_registrations",
        ["registered_at"],
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CREATE_REGISTER_LOOKUP)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS celery_lease_register_lookup_v2({REGISTER_ARGS})")
    op.drop_index(
        "ix_celery_lease_registrations_registered_at", table_name="celery_lease_registrations"
    )
    op.drop_table("celery_lease_registrations")
