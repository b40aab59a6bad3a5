"""PostgreSQL: claim (or register) and look up earlier results in one call.

Before a body runs, a worker claims the key (or, with leases elsewhere,
registers the token in the fence row) and then looks up accepted results:
this task id's (a late redelivery) and, in once mode, the key's (a
duplicate). The look-up must read a snapshot taken *after* the claim's wait
for the key's row lock: a commit that released the key while the claim
waited must be visible to it. Sent as one statement, it would not be (one
statement, one snapshot, taken before the wait). These functions run the two
as two statements on the server: in READ COMMITTED a VOLATILE PL/pgSQL
function takes a fresh snapshot for each statement it runs. One prepared
call, one round trip, where a client-side pipeline cost more than the round
trip it saved.

``celery_lease_claim_lookup``'s claim was the client's single-key claim
(``PG_CLAIM_ONE``); migration 0003 replaces both functions with versioned
ones rendered from the same templates as the client statements. SQLite has no functions here:
it runs the claim and the look-up in one ``BEGIN IMMEDIATE`` transaction.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

NOW = "extract(epoch FROM clock_timestamp())::double precision"

#: The look-ups of PREPARE_LOOKUP, on the function's arguments.
LOOKUPS = """
        (SELECT r.fencing_token FROM celery_lease_results AS r WHERE r.task_id = p_task_id
         ORDER BY r.fencing_token DESC LIMIT 1),
        (SELECT r.fencing_token FROM celery_lease_results AS r
         WHERE r.lease_key = p_key AND p_once ORDER BY r.fencing_token LIMIT 1)"""

CLAIM_LOOKUP = f"""
CREATE OR REPLACE FUNCTION celery_lease_claim_lookup(
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
        SELECT fe.fencing_token FROM celery_lease_fences AS fe
        WHERE fe.resource = p_key FOR UPDATE
    ), t AS (
        SELECT {NOW} AS now
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
    RETURN QUERY SELECT g.fencing_token, g.expires_at, g.acquired_at,{LOOKUPS};
END
$fn$
"""

REGISTER_LOOKUP = f"""
CREATE OR REPLACE FUNCTION celery_lease_register_lookup(
    p_key text, p_token bigint, p_task_id text, p_once boolean
) RETURNS TABLE (registered bigint, task_token bigint, duplicate_token bigint)
LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
DECLARE
    v bigint;
BEGIN
    INSERT INTO celery_lease_fences AS fe (resource, fencing_token, updated_at)
    VALUES (p_key, p_token, {NOW})
    ON CONFLICT (resource) DO UPDATE SET
        fencing_token = EXCLUDED.fencing_token, updated_at = EXCLUDED.updated_at
    WHERE fe.fencing_token <= EXCLUDED.fencing_token
    RETURNING fe.fencing_token INTO v;
    IF NOT FOUND THEN
        RETURN QUERY SELECT NULL::bigint, NULL::bigint, NULL::bigint;  -- a newer token is there
        RETURN;
    END IF;
    -- A new statement: a snapshot taken after the registration's wait for the fence row.
    RETURN QUERY SELECT v,{LOOKUPS};
END
$fn$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(CLAIM_LOOKUP)
    op.execute(REGISTER_LOOKUP)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION IF EXISTS celery_lease_register_lookup(text, bigint, text, boolean)")
    op.execute(
        "DROP FUNCTION IF EXISTS celery_lease_claim_lookup("
        "text, text, double precision, text, text, text, text, boolean)"
    )
