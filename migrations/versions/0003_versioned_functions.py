"""PostgreSQL: the claim/registration + look-up functions, versioned by name.

Creates ``celery_lease_claim_lookup_v1`` and ``celery_lease_register_lookup_v1``
(the functions of 0002 under versioned names, their claim and registration
now rendered from the same templates as the client statements) and drops the
unversioned ones. The texts below are frozen: tests/contract/test_migrations.py checks
that they are celery_lease.sql.functions' texts. A change to a function is a
``_v2`` in a new migration, so code of either version finds its function.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-10
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

CLAIM_ARGS = "text, text, double precision, text, text, text, text, boolean"
REGISTER_ARGS = "text, bigint, text, boolean"

CREATE_CLAIM_LOOKUP = """
CREATE OR REPLACE FUNCTION celery_lease_claim_lookup_v1(
    p_key text, p_owner_id text, p_ttl double precision, p_task_id text,
    p_task_name text, p_root_id text, p_tenant text, p_once boolean
) RETURNS TABLE (
    fencing_token bigint, expires_at double precision, acquired_at double precision,
    task_token bigint, duplicate_token bigint
) LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
DECLARE
    g record;
BEGIN
WITH f AS (
    SELECT fe.fencing_token FROM celery_lease_fences AS fe WHERE fe.resource = p_key FOR UPDATE
), t AS (
    SELECT extract(epoch FROM clock_timestamp())::double precision AS now
), granted AS (
    INSERT INTO celery_lease_leases AS l
        (lease_key, owner_id, fencing_token, ttl, expires_at, acquired_at, renewed_at,
         task_id, task_name, root_id, tenant)
    SELECT p_key, p_owner_id, COALESCE((SELECT f.fencing_token FROM f), 0) + 1, p_ttl,
           t.now + p_ttl, t.now, t.now, p_task_id, p_task_name, p_root_id, p_tenant
    FROM t
    ON CONFLICT (lease_key) DO UPDATE SET
        owner_id = EXCLUDED.owner_id,
        fencing_token = GREATEST(l.fencing_token + 1, EXCLUDED.fencing_token),
        ttl = EXCLUDED.ttl,
        expires_at = EXCLUDED.expires_at,
        acquired_at = EXCLUDED.acquired_at,
        renewed_at = EXCLUDED.renewed_at,
        task_id = EXCLUDED.task_id,
        task_name = EXCLUDED.task_name,
        root_id = EXCLUDED.root_id,
        tenant = EXCLUDED.tenant
    WHERE l.owner_id IS NULL OR l.expires_at <= EXCLUDED.acquired_at
        OR l.owner_id = EXCLUDED.owner_id
    RETURNING l.lease_key, l.fencing_token, l.expires_at, l.acquired_at
), fenced AS (
    INSERT INTO celery_lease_fences AS fe (resource, fencing_token, updated_at)
    SELECT granted.lease_key, granted.fencing_token, granted.acquired_at FROM granted
    ON CONFLICT (resource) DO UPDATE SET
        fencing_token = GREATEST(fe.fencing_token, EXCLUDED.fencing_token),
        updated_at = EXCLUDED.updated_at
)
SELECT granted.fencing_token, granted.expires_at, granted.acquired_at INTO g FROM granted;
    IF NOT FOUND THEN
        RETURN;  -- not granted: no row
    END IF;
    -- A new statement: a snapshot taken after the claim (and any wait for its locks).
    RETURN QUERY SELECT g.fencing_token, g.expires_at, g.acquired_at,
        (SELECT r.fencing_token FROM celery_lease_results AS r WHERE r.task_id = p_task_id
        ORDER BY r.fencing_token DESC LIMIT 1),
        (SELECT r.fencing_token FROM celery_lease_results AS r
        WHERE r.lease_key = p_key AND p_once ORDER BY r.fencing_token LIMIT 1);
END
$fn$
"""

CREATE_REGISTER_LOOKUP = """
CREATE OR REPLACE FUNCTION celery_lease_register_lookup_v1(
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
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(CREATE_CLAIM_LOOKUP)
    op.execute(CREATE_REGISTER_LOOKUP)
    op.execute(f"DROP FUNCTION IF EXISTS celery_lease_claim_lookup({CLAIM_ARGS})")
    op.execute(f"DROP FUNCTION IF EXISTS celery_lease_register_lookup({REGISTER_ARGS})")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    # Back to 0002's state: its functions, by their unversioned names (the
    # bodies are equivalent: the same statements, written with qualified columns).
    op.execute(
        f"ALTER FUNCTION celery_lease_claim_lookup_v1({CLAIM_ARGS}) "
        "RENAME TO celery_lease_claim_lookup"
    )
    op.execute(
        f"ALTER FUNCTION celery_lease_register_lookup_v1({REGISTER_ARGS}) "
        "RENAME TO celery_lease_register_lookup"
    )
