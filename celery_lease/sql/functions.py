"""The PL/pgSQL functions the migrations install (PostgreSQL).

Before a body runs, a worker claims the key (or, with leases elsewhere,
registers the token) and then looks up accepted results. The look-up must
read a snapshot taken *after* the claim's wait for the key's row lock, which
one statement cannot (one statement, one snapshot); in READ COMMITTED a
VOLATILE PL/pgSQL function takes a fresh snapshot for each statement it runs.
One prepared call, one round trip, where a client-side pipeline cost more
than the round trip it saved.

Versioned by name: the text here is the text of the migration that created
the function (tests/contract/test_migrations.py compares them). A change is a new
``_v2`` function in a new migration, never an edit of ``_v1``. The claim and
the registration are the templates of :mod:`celery_lease.sql.queries` that
``PG_CLAIM_ONE`` and ``register_fence`` render (and the task id's registration
:mod:`~celery_lease.sql.meta_queries`' that ``register_task`` renders), so the
two cannot drift.

``celery_lease_register_lookup_v2`` (migration 0006) is ``_v1`` plus the task
id's registration (``celery_lease_registrations``); ``_v1`` stays installed,
for workers of the previous release during a rolling upgrade.
"""

from __future__ import annotations

from celery_lease.sql.meta_queries import _REGISTER_TASK
from celery_lease.sql.queries import (
    CLAIM_CTE,
    CLAIM_LOOKUP_FN,
    CLAIM_PARAMS,
    NOW,
    REGISTER,
    REGISTER_LOOKUP_FN,
    lookups,
)

__all__ = ["CREATE_CLAIM_LOOKUP", "CREATE_REGISTER_LOOKUP"]


def _args(*names: str) -> dict[str, str]:
    """``{name: "p_name"}``: a shared template inside a server function."""
    return {n: f"p_{n}" for n in names}


_FN_LOOKUPS = lookups(_args("task_id", "key", "once"), ",\n        ")
_FN_CLAIM = CLAIM_CTE.format(now=NOW["postgresql"], **_args(*CLAIM_PARAMS)).strip()
_FN_REGISTER = REGISTER.format(now=NOW["postgresql"], **_args("key", "token")).strip()
_FN_REGISTER_TASK = _REGISTER_TASK.format(
    now=NOW["postgresql"], **_args("key", "token", "task_id")
).strip()

#: Creates :data:`CLAIM_LOOKUP_FN`: the claim of ``_CLAIM_CTE`` (the same as
#: :data:`PG_CLAIM_ONE`), then, granted, the look-ups; no row: not granted.
CREATE_CLAIM_LOOKUP = f"""
CREATE OR REPLACE FUNCTION {CLAIM_LOOKUP_FN}(
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
{_FN_CLAIM} INTO g FROM granted;
    IF NOT FOUND THEN
        RETURN;  -- not granted: no row
    END IF;
    -- A new statement: a snapshot taken after the claim (and any wait for its locks).
    RETURN QUERY SELECT g.fencing_token, g.expires_at, g.acquired_at,
        {_FN_LOOKUPS};
END
$fn$
"""
#: Creates :data:`REGISTER_LOOKUP_FN`: the registration of :data:`REGISTER`,
#: then the task id's (``_REGISTER_TASK``), then the look-ups; ``registered``
#: NULL when a newer token was registered (and the task id's registration not made).
CREATE_REGISTER_LOOKUP = f"""
CREATE OR REPLACE FUNCTION {REGISTER_LOOKUP_FN}(
    p_key text, p_token bigint, p_task_id text, p_once boolean
) RETURNS TABLE (registered bigint, task_token bigint, duplicate_token bigint)
LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
DECLARE
    v bigint;
BEGIN
{_FN_REGISTER} INTO v;
    IF NOT FOUND THEN
        RETURN QUERY SELECT NULL::bigint, NULL::bigint, NULL::bigint;  -- a newer token is there
        RETURN;
    END IF;
    -- The task id's registration: the same round trip, after the fence row's.
{_FN_REGISTER_TASK};
    -- A new statement: a snapshot taken after the registration's wait for the fence row.
    RETURN QUERY SELECT v,
        {_FN_LOOKUPS};
END
$fn$
"""
