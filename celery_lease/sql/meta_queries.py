"""The Celery result backend's statements (celery_lease/backend.py), by name.

Celery's key-value protocol over ``celery_lease_task_meta``, rendered per
dialect (``{now}``: the database's clock) as ``Database.sql.meta_*`` by
:mod:`celery_lease.sql.dialects`. A row past its ``expires_at`` reads as
absent, as an expired Redis key does, until ``meta_cleanup`` deletes it;
``expires_at`` NULL never expires. ``:ttl`` NULL: no expiry.

**Fencing.** A leased task's writes carry its lease's token (``token``
column): the statements below refuse, atomically, what Celery's key-value
code only checks with a read before its write (a SUCCESS is never
overwritten), and what it cannot check at all (a copy whose lease was taken
over writing over the newer owner's state). The fenced commit writes the
task's SUCCESS record inside its own transaction (``_PG_META_IN_COMMIT``,
``_META_COMMIT``). A row past its expiry is absent for all of them.

Kept apart from :mod:`celery_lease.sql.queries` (the leases and the fenced
results) so that each module stays readable; the same rules hold: parameters
always bound, every statement named once, call sites never assemble text.
"""

from __future__ import annotations

#: The state inside a record's JSON value (``{col}``), per dialect. Only ever
#: evaluated for a row with a token (a leased task's record), never for a
#: chord counter or a group: every use sits behind ``m.token IS NULL`` in a CASE.
STATUS = {
    "postgresql": "(CAST({col} AS json) ->> 'status')",
    "sqlite": "json_extract({col}, '$.status')",
}
#: The row is there but past its expiry: absent, as an expired Redis key is.
_EXPIRED = "m.expires_at IS NOT NULL AND m.expires_at <= {now}"

#: Write a key's value (upsert) and its expiry, ``:ttl`` seconds from now.
#: A write without a token (Celery's own path: a task that is not leased, a
#: leased task's copy that holds no lease, a revoke) never replaces the
#: unexpired SUCCESS of a row that has one (a leased task's record), in the
#: same statement; it keeps the row's token. No row returned: refused.
_META_SET = f"""
INSERT INTO celery_lease_task_meta AS m (key, value, expires_at)
VALUES (:key, :value, {{now}} + CAST(:ttl AS double precision))
ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
WHERE CASE WHEN m.token IS NULL THEN TRUE
           WHEN {_EXPIRED} THEN TRUE
           ELSE COALESCE({{status}}, '') <> 'SUCCESS' END
RETURNING key
"""
#: A leased task's state write, fenced by its writer's token (``:token``),
#: by whether it writes a SUCCESS (``{over_success}``). Refused, in the same
#: statement, over an unexpired row whose token is larger (a newer owner
#: wrote it), and over an unexpired SUCCESS unless this write is a SUCCESS
#: too (with a token at least the row's). The row takes the writer's token.
#: An INSERT ... SELECT, so that the refusals that do not depend on the row
#: refuse the insert too: a newer copy may have written nothing yet
#: (``task_track_started`` off). Those are a lease row of one of the writer's
#: keys (``:keys``, bound per dialect by ``{in_keys}``) granted to this task
#: id (``:task_id``) with a larger token: a newer copy of the task id holds
#: or held the key (leases in this database); and ``{registered}``. No row
#: returned: refused.
_META_FENCED = f"""
INSERT INTO celery_lease_task_meta AS m (key, value, expires_at, token)
SELECT :key, :value, {{now}} + CAST(:ttl AS double precision), :token
WHERE NOT EXISTS (
    SELECT 1 FROM celery_lease_leases AS l
    WHERE l.lease_key {{in_keys}} AND l.fencing_token > :token AND l.task_id = :task_id
){{registered}}
ON CONFLICT (key) DO UPDATE SET
    value = excluded.value, expires_at = excluded.expires_at, token = excluded.token
WHERE CASE WHEN {_EXPIRED} THEN TRUE
           WHEN m.token IS NOT NULL AND m.token > excluded.token THEN FALSE
           ELSE {{over_success}} END
RETURNING key
"""
#: ``_META_FENCED``'s ``{registered}`` for a state that is not final (STARTED,
#: RETRY, a custom state): refused too when a fence row of the writer's keys
#: holds a larger token (registered by any newer grant of the key, whichever
#: task id it ran: the fence row does not say).
_META_NEWER_REGISTERED = """
  AND NOT EXISTS (
    SELECT 1 FROM celery_lease_fences AS fe
    WHERE fe.resource {in_keys} AND fe.fencing_token > :token
)"""
#: ``{registered}`` for a final state and a SUCCESS: refused when a copy of
#: *this* task id registered a larger token for one of the writer's keys
#: (``_REGISTER_TASK``): that copy writes the task id's outcome. Not the fence
#: row: when the newer grant ran another task id, nobody else writes this
#: task id's outcome, and a refusal would leave it PENDING for ever.
_META_NEWER_FOR_TASK = """
  AND NOT EXISTS (
    SELECT 1 FROM celery_lease_registrations AS rg
    WHERE rg.resource {in_keys} AND rg.task_id = :task_id AND rg.fencing_token > :token
)"""
#: Leases elsewhere, right after the key's fence-row registration (``REGISTER``)
#: in its transaction or server function: the task id's registration, taking
#: the token only if the fence row holds it (a registration refused there for
#: a newer token records nothing), never lowering it. A template (``{key}``,
#: ``{token}``, ``{task_id}``, ``{now}``), shared by the client statement
#: (``Dialect.register_task``, SQLite) and ``celery_lease_register_lookup_v2``.
_REGISTER_TASK = """
INSERT INTO celery_lease_registrations AS rg (resource, task_id, fencing_token, registered_at)
SELECT fe.resource, CAST({task_id} AS text), fe.fencing_token, {now}
FROM celery_lease_fences AS fe
WHERE fe.resource = {key} AND fe.fencing_token = {token} AND {task_id} IS NOT NULL
ON CONFLICT (resource, task_id) DO UPDATE SET
    fencing_token = excluded.fencing_token, registered_at = excluded.registered_at
WHERE rg.fencing_token <= excluded.fencing_token"""
#: Sweeper: registrations older than the lease rows' grace. A registration
#: matters only until the newer copy writes a state of its own (its record's
#: token then refuses the stale copy): the same window as the lease rows that
#: fence the same write when the leases are in this database. Deleting one
#: never lets a token fall: a later registration needs the fence row's token,
#: which only grows.
SWEEP_REGISTRATIONS = "DELETE FROM celery_lease_registrations WHERE registered_at < :cutoff"
#: ``{in_keys}``: one of the writer's keys, any number of them in one text:
#: a bound array (PostgreSQL) or a bound JSON array (SQLite).
IN_KEYS = {
    "postgresql": "= ANY(CAST(:keys AS text[]))",
    "sqlite": "IN (SELECT value FROM json_each(:keys))",
}
#: ``_META_FENCED``'s last condition: a SUCCESS may replace a SUCCESS, nothing else may.
_OVER_SUCCESS = {True: "TRUE", False: "COALESCE({status}, '') <> 'SUCCESS'"}
#: What a refused write met: the row's token and state (for the log line).
_META_FENCE = "SELECT token, {status} AS status FROM celery_lease_task_meta WHERE key = :key"
#: The upsert of the fenced commit's record (the accepted SUCCESS and the
#: lease's token): the commit was accepted, so it replaces whatever the row held.
_META_COMMIT_UPSERT = """ON CONFLICT (key) DO UPDATE SET
    value = excluded.value, expires_at = excluded.expires_at, token = excluded.token"""
#: SQLite: the fenced commit's record, run right after the result insert
#: accepted it, in the commit's transaction.
_META_COMMIT = f"""
INSERT INTO celery_lease_task_meta AS m (key, value, expires_at, token)
VALUES (:meta_key, :meta_value, {{now}} + CAST(:meta_ttl AS double precision), :token)
{_META_COMMIT_UPSERT}
"""
#: PostgreSQL: the fenced commit's record as a part of the commit's one
#: statement (``queries._pg_commit_colocated``, ``queries._RESULT_INSERT_META``),
#: written only if the result row was: ``ins`` is the insert, its RETURNING
#: one row (accepted) or none.
_PG_META_IN_COMMIT = f"""meta AS (
    INSERT INTO celery_lease_task_meta AS m (key, value, expires_at, token)
    SELECT :meta_key, :meta_value, ins.accepted_at + CAST(:meta_ttl AS double precision), :token
    FROM ins
    {_META_COMMIT_UPSERT}
)"""
#: One key's value, unless expired.
_META_GET = """
SELECT value FROM celery_lease_task_meta
WHERE key = :key AND (expires_at IS NULL OR expires_at > {now})
"""
#: The unexpired values of n keys (``:k0``, ...; rows in no particular order).
_META_MGET = """
SELECT key, value FROM celery_lease_task_meta
WHERE key IN ({keys}) AND (expires_at IS NULL OR expires_at > {now})
"""
#: Forget a key.
META_DELETE = "DELETE FROM celery_lease_task_meta WHERE key = :key"
#: Add one to a key's counter and return it, in one statement (so two chord
#: members finishing at once read 1 and 2, never 1 and 1). A missing or
#: expired key starts again at 1 with no expiry, as Redis's INCR does.
_META_INCR = """
INSERT INTO celery_lease_task_meta AS m (key, value, expires_at)
VALUES (:key, '1', NULL)
ON CONFLICT (key) DO UPDATE SET
    value = CASE WHEN m.expires_at IS NULL OR m.expires_at > {now}
                 THEN CAST(CAST(m.value AS bigint) + 1 AS text) ELSE '1' END,
    expires_at = CASE WHEN m.expires_at IS NULL OR m.expires_at > {now}
                      THEN m.expires_at END
RETURNING value
"""
#: Mark ``:key`` done (a chord member's part: ``<counter>.<task id>``) for
#: ``:ttl`` seconds, unless an unexpired mark is there: a row returned the
#: first time only. Run in the counter's ``_META_INCR`` transaction.
_META_ONCE = """
INSERT INTO celery_lease_task_meta AS m (key, value, expires_at)
VALUES (:key, '1', {now} + CAST(:ttl AS double precision))
ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
WHERE m.expires_at IS NOT NULL AND m.expires_at <= {now}
RETURNING key
"""
#: Set an unexpired key's expiry to ``:ttl`` seconds from now (NULL: never).
_META_EXPIRE = """
UPDATE celery_lease_task_meta SET expires_at = {now} + CAST(:ttl AS double precision)
WHERE key = :key AND (expires_at IS NULL OR expires_at > {now})
"""
#: ``backend.cleanup()`` (Celery beat's ``celery.backend_cleanup``): the expired rows.
_META_CLEANUP = "DELETE FROM celery_lease_task_meta WHERE expires_at <= {now}"
