"""Every SQL statement celery-lease runs, once, by name, rendered at import.

Parameters are always bound (``:name``), never formatted in. A statement
that varies by a flag is a dict of every variant, keyed by the flags. One
whose text differs by dialect (the clock, ``jsonb``, row locks) or by a
number of keys is a template here (``_NAME``), rendered by
:mod:`celery_lease.sql.dialects` (``Database.sql``). Call sites look
statements up; they never assemble text.

Locking order, the same everywhere, so no two operations deadlock:
fence row (``celery_lease_fences``) first, then the lease row.

The PL/pgSQL functions the migrations install are in
:mod:`celery_lease.sql.functions`; the claim, registration and look-ups they
run are the templates below, shared with the client statements.
"""

from __future__ import annotations

import re
from functools import lru_cache

from celery_lease.sql.meta_queries import _PG_META_IN_COMMIT

# ---------------------------------------------------------------------------
# Clocks: the database's own, in epoch seconds.

NOW = {
    "postgresql": "extract(epoch FROM clock_timestamp())::double precision",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}
_PG_NOW = NOW["postgresql"]

_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


@lru_cache(maxsize=1024)
def pyformat(sql: str) -> str:
    """``:name`` placeholders as psycopg's ``%(name)s`` (``::`` casts left alone)."""
    return _PARAM.sub(r"%(\1)s", sql.replace("%", "%%"))


def _bound(*names: str) -> dict[str, str]:
    """``{name: ":name"}``: a shared template rendered as a client statement."""
    return {n: f":{n}" for n in names}


# ---------------------------------------------------------------------------
# Shared by a client statement and a server function (so the two cannot drift).

#: One key's claim: lock its fence row (if any), insert or take over an
#: expired/free lease row with a token larger than both the row's and the
#: fence's, and register that token in the fence row.
CLAIM_CTE = """
WITH f AS (
    SELECT fe.fencing_token FROM celery_lease_fences AS fe WHERE fe.resource = {key} FOR UPDATE
), t AS (
    SELECT {now} AS now
), granted AS (
    INSERT INTO celery_lease_leases AS l
        (lease_key, owner_id, fencing_token, ttl, expires_at, acquired_at, renewed_at,
         task_id, task_name, root_id, tenant)
    SELECT {key}, {owner_id}, COALESCE((SELECT f.fencing_token FROM f), 0) + 1, {ttl},
           t.now + {ttl}, t.now, t.now, {task_id}, {task_name}, {root_id}, {tenant}
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
SELECT granted.fencing_token, granted.expires_at, granted.acquired_at"""
CLAIM_PARAMS = ("key", "owner_id", "ttl", "task_id", "task_name", "root_id", "tenant")

#: Register a token in the key's fence row unless a newer one is there.
REGISTER = """
INSERT INTO celery_lease_fences AS fe (resource, fencing_token, updated_at)
VALUES ({key}, {token}, {now})
ON CONFLICT (resource) DO UPDATE SET
    fencing_token = excluded.fencing_token, updated_at = excluded.updated_at
WHERE fe.fencing_token <= excluded.fencing_token
RETURNING fencing_token"""

#: The task id's accepted token (a late redelivery) and, in once mode, the
#: key's (a duplicate): two scalar subqueries.
_LOOKUP_TASK = """(SELECT r.fencing_token FROM celery_lease_results AS r WHERE r.task_id = {task_id}
        ORDER BY r.fencing_token DESC LIMIT 1)"""
_LOOKUP_DUPLICATE = """(SELECT r.fencing_token FROM celery_lease_results AS r
        WHERE r.lease_key = {key} AND {once} ORDER BY r.fencing_token LIMIT 1)"""


def lookups(params: dict[str, str], sep: str) -> str:
    return _LOOKUP_TASK.format(**params) + sep + _LOOKUP_DUPLICATE.format(**params)


# ---------------------------------------------------------------------------
# Leases

#: PostgreSQL, one key, one statement: the claim of ``CLAIM_CTE``.
PG_CLAIM_ONE = CLAIM_CTE.format(now=_PG_NOW, **_bound(*CLAIM_PARAMS)) + " FROM granted\n"
#: Several keys, PostgreSQL, first: make the keys' fence rows exist.
PG_ENSURE_FENCES = f"""
INSERT INTO celery_lease_fences (resource, fencing_token, updated_at)
SELECT k, 0, {_PG_NOW} FROM unnest(CAST(:keys AS text[])) AS k ORDER BY k
ON CONFLICT (resource) DO NOTHING
"""
#: Several keys, PostgreSQL, then: lock the fence rows in key order.
PG_LOCK_FENCES = """
SELECT resource, fencing_token FROM celery_lease_fences
WHERE resource = ANY(CAST(:keys AS text[])) ORDER BY resource FOR UPDATE
"""
_SELECT_FENCES_IN = """
SELECT resource, fencing_token FROM celery_lease_fences WHERE resource IN ({keys})
"""
_SELECT_LEASES_IN = """
SELECT lease_key, owner_id, fencing_token, expires_at FROM celery_lease_leases
WHERE lease_key IN ({keys})
"""
#: Conditional: a row some other claimer made live meanwhile is left alone,
#: and the caller compares the returned row count with the number of keys.
UPSERT_LEASE = """
INSERT INTO celery_lease_leases AS l
    (lease_key, owner_id, fencing_token, ttl, expires_at, acquired_at, renewed_at,
     task_id, task_name, root_id, tenant)
VALUES (:key, :owner_id, :token, :ttl, :now + :ttl, :now, :now,
        :task_id, :task_name, :root_id, :tenant)
ON CONFLICT (lease_key) DO UPDATE SET
    owner_id = excluded.owner_id,
    fencing_token = excluded.fencing_token,
    ttl = excluded.ttl,
    expires_at = excluded.expires_at,
    acquired_at = excluded.acquired_at,
    renewed_at = excluded.renewed_at,
    task_id = excluded.task_id,
    task_name = excluded.task_name,
    root_id = excluded.root_id,
    tenant = excluded.tenant
WHERE (l.owner_id IS NULL OR l.expires_at <= :now OR l.owner_id = :owner_id)
    AND l.fencing_token < excluded.fencing_token
RETURNING lease_key
"""
#: Raise a fence to at least ``token``; never lowers it.
RAISE_FENCE = """
INSERT INTO celery_lease_fences AS fe (resource, fencing_token, updated_at)
VALUES (:key, :token, :now)
ON CONFLICT (resource) DO UPDATE SET
    fencing_token = CASE WHEN fe.fencing_token > excluded.fencing_token
                         THEN fe.fencing_token ELSE excluded.fencing_token END,
    updated_at = excluded.updated_at
"""

#: Renew many leases at once, each all or nothing: a lease is extended only
#: if every one of its rows still names its owner and token and is live and
#: not released. A released row keeps owner and token (see ``release_in``),
#: and after a row-lock wait PostgreSQL re-checks the row against the clock
#: read when the statement started, before the release: ``expires_at >
#: renewed_at`` is what refuses it then. PostgreSQL: one statement for any
#: number of leases; ``held`` locks the rows of the multi-key leases in key
#: order and sees their latest versions, so the unit check is exact. Single-key
#: leases skip it: one row is its own unit, and locking it would only slow a
#: cycle of many leases.
PG_RENEW_MANY = f"""
WITH v AS (
    SELECT u.*, count(*) OVER (PARTITION BY u.lease) AS n
    FROM unnest(CAST(:leases AS int[]), CAST(:keys AS text[]), CAST(:owners AS text[]),
                CAST(:tokens AS bigint[]), CAST(:ttls AS double precision[]))
        AS u(lease, lease_key, owner_id, fencing_token, ttl)
), t AS (SELECT {_PG_NOW} AS now),
held AS MATERIALIZED (
    SELECT v.lease, v.n FROM celery_lease_leases AS l JOIN v ON l.lease_key = v.lease_key, t
    WHERE v.n > 1 AND l.owner_id = v.owner_id AND l.fencing_token = v.fencing_token
        AND l.expires_at > t.now AND l.expires_at > l.renewed_at
    ORDER BY l.lease_key
    FOR UPDATE OF l
), whole AS (
    SELECT lease FROM held GROUP BY lease, n HAVING count(*) = n
)
UPDATE celery_lease_leases AS l
SET expires_at = t.now + v.ttl, renewed_at = t.now, ttl = v.ttl
FROM v, t
WHERE l.lease_key = v.lease_key AND l.owner_id = v.owner_id
    AND l.fencing_token = v.fencing_token
    AND l.expires_at > t.now AND l.expires_at > l.renewed_at
    AND (v.n = 1 OR v.lease IN (SELECT lease FROM whole))
RETURNING l.lease_key, l.owner_id, l.fencing_token, l.expires_at
"""
_RENEW_LEASE = """
UPDATE celery_lease_leases SET expires_at = :now + :ttl, renewed_at = :now, ttl = :ttl
WHERE lease_key IN ({keys}) AND owner_id = :owner_id AND fencing_token = :token
    AND expires_at > :now AND expires_at > renewed_at
    AND (SELECT count(*) FROM celery_lease_leases
         WHERE lease_key IN ({keys}) AND owner_id = :owner_id AND fencing_token = :token
             AND expires_at > :now AND expires_at > renewed_at) = :n
RETURNING lease_key, expires_at
"""
#: Release keeps the row (and its token) and marks it released: expires_at =
#: renewed_at = now (a grant or renewal always leaves expires_at > renewed_at).
#: Only this owner and token release; releasing again answers yes (idempotent,
#: so a retry after a lost reply is not mistaken for a lost lease).
_RELEASE_IN = """
UPDATE celery_lease_leases SET expires_at = t.now, renewed_at = t.now
FROM (SELECT {now} AS now) AS t
WHERE lease_key IN ({keys}) AND owner_id = :owner_id AND fencing_token = :token
    AND (expires_at > t.now OR renewed_at = expires_at)
RETURNING lease_key
"""
_INSPECT = """
SELECT l.lease_key, l.owner_id, l.fencing_token, l.expires_at, l.acquired_at, l.renewed_at,
       l.ttl, l.task_id, l.task_name, l.root_id, l.tenant,
       (SELECT fencing_token FROM celery_lease_fences WHERE resource = :key) AS fence,
       {now} AS now
FROM (SELECT 1) AS one
LEFT JOIN celery_lease_leases AS l ON l.lease_key = :key
"""
_LIST = r"""
SELECT lease_key, owner_id, fencing_token, expires_at, acquired_at, renewed_at, ttl,
       task_id, task_name, root_id, tenant, {now} AS now
FROM celery_lease_leases
WHERE lease_key LIKE :pattern ESCAPE '\'
    AND (:expired OR (owner_id IS NOT NULL AND expires_at > {now}))
ORDER BY lease_key
"""
#: Force release: free the row (the caller raises the fence one past the
#: evicted token, so the evicted owner's guarded writes are refused).
EVICT = """
UPDATE celery_lease_leases SET owner_id = NULL, expires_at = :now, renewed_at = :now
WHERE lease_key = :key
"""
#: Evict only the unreleased lease of one token (a released row has
#: renewed_at = expires_at); the caller raises the fence only if a row changed.
EVICT_TOKEN = """
UPDATE celery_lease_leases SET owner_id = NULL, expires_at = :now, renewed_at = :now
WHERE lease_key = :key AND fencing_token = :token AND owner_id IS NOT NULL
    AND renewed_at < expires_at
"""
#: The largest token the key's fence row or lease row holds (0: none).
FENCE_TOKEN = """
SELECT COALESCE(MAX(t), 0) FROM (
    SELECT fencing_token AS t FROM celery_lease_fences WHERE resource = :key
    UNION ALL
    SELECT fencing_token AS t FROM celery_lease_leases WHERE lease_key = :key
) AS both_tokens
"""
#: The token registered in the key's fence row (results, ``fencing.current``).
FENCE_CURRENT = "SELECT fencing_token FROM celery_lease_fences WHERE resource = :key"


# ---------------------------------------------------------------------------
# Fenced results. See celery_lease/results.py for the reasoning.

#: Before the body, after the registration (leases elsewhere): whether this
#: task id already has an accepted result (a late redelivery) and, in once
#: mode, whether the key has one (a duplicate).
PREPARE_LOOKUP = (
    "SELECT "
    + lookups(_bound("task_id", "key", "once"), " AS task_token,\n       ")
    + " AS duplicate_token\n"
)
#: Same database as the leases, SQLite: check ownership on the lease rows and
#: release them (or only touch them), in the result insert's transaction.
_RESULT_OWN_LEASE = """
UPDATE celery_lease_leases SET {set}
WHERE lease_key IN ({keys}) AND owner_id = :owner_id AND fencing_token = :token
    AND expires_at > :now
RETURNING lease_key
"""
#: Once mode, after a refused insert: the key's accepted token.
RESULT_DUPLICATE = """
SELECT fencing_token FROM celery_lease_results WHERE lease_key = :key
ORDER BY fencing_token LIMIT 1
"""
#: The result row, written only if (once mode) the key has no accepted row yet;
#: run after the caller holds the key's lock, so its snapshot is fresh. A row
#: with this key and token already there (a retried commit) is left alone.
#: No row returned: a duplicate, or this very commit accepted earlier.
_RESULT_INSERT = """
INSERT INTO celery_lease_results
    (lease_key, fencing_token, task_id, task_name, owner_id, tenant, root_id, result, accepted_at)
SELECT :key, :token, :task_id, :task_name, :owner_id, :tenant, :root_id, {result}, {now}
{guards}
ON CONFLICT (lease_key, fencing_token) DO NOTHING
RETURNING accepted_at
"""
#: The result's JSON text as the insert stores it (``{result}`` above), by
#: dialect. SQLite gives a column declared JSON numeric affinity: the text of
#: a top-level number would be stored as an INTEGER or a REAL (``2.0`` reads
#: back as ``2``, ``2**80`` loses digits), so a number's text goes in as a
#: BLOB, which no affinity converts. PostgreSQL keeps jsonb.
RESULT_VALUE = {
    "sqlite": "CASE WHEN json_type(:result) IN ('integer', 'real') "
    "THEN CAST(:result AS BLOB) ELSE :result END",
    "postgresql": "CAST(:result AS jsonb)",
}
_RESULT_ONCE_GUARD = "WHERE NOT EXISTS (SELECT 1 FROM celery_lease_results WHERE lease_key = :key)"
#: No row for a task id that has ended (celery_lease/result_end.py): the
#: commit's transaction holds the key's lock, so it sees every end mark made before.
_ENDED_GUARD = "NOT EXISTS (SELECT 1 FROM celery_lease_ended WHERE task_id = :task_id)"
#: The insert's WHERE, by once mode.
_RESULT_GUARDS = {
    True: f"{_RESULT_ONCE_GUARD}\n  AND {_ENDED_GUARD}",
    False: f"WHERE {_ENDED_GUARD}",
}
#: PostgreSQL, with a result backend's record to write (the task's SUCCESS in
#: ``celery_lease_task_meta``, the ``lease+`` backend in this database): the
#: insert (``{insert}``, ``_RESULT_INSERT`` rendered) and the record, written
#: only if the insert was, in one statement (the commit's last round trip).
_RESULT_INSERT_META = f"""
WITH ins AS ({{insert}}),
{_PG_META_IN_COMMIT}
SELECT accepted_at FROM ins
"""
_RESULT_COLUMNS = """
lease_key, fencing_token, task_id, task_name, owner_id, tenant, root_id, result, accepted_at
"""
#: The accepted row of one key and token.
RESULT_BY_KEY_TOKEN = f"""
SELECT {_RESULT_COLUMNS} FROM celery_lease_results WHERE lease_key = :key AND fencing_token = :token
"""
#: The newest accepted row of a key, in a tenant's scope.
RESULT_ACCEPTED = f"""
SELECT {_RESULT_COLUMNS} FROM celery_lease_results
WHERE lease_key = :key
    AND ((CAST(:tenant AS TEXT) IS NULL AND tenant IS NULL) OR tenant = CAST(:tenant AS TEXT))
ORDER BY fencing_token DESC LIMIT 1
"""
#: The newest accepted row a task id committed.
RESULT_FOR_TASK = f"""
SELECT {_RESULT_COLUMNS} FROM celery_lease_results WHERE task_id = :task_id
ORDER BY fencing_token DESC LIMIT 1
"""
#: A key's accepted rows, newest first.
RESULT_HISTORY = f"""
SELECT {_RESULT_COLUMNS} FROM celery_lease_results
WHERE lease_key = :key
    AND ((CAST(:tenant AS TEXT) IS NULL AND tenant IS NULL) OR tenant = CAST(:tenant AS TEXT))
ORDER BY fencing_token DESC LIMIT :limit
"""
#: Sweeper: results past retention.
SWEEP_RESULTS = "DELETE FROM celery_lease_results WHERE accepted_at < :cutoff"
#: Sweeper: end marks past the same retention.
SWEEP_ENDED = "DELETE FROM celery_lease_ended WHERE ended_at < :cutoff"
#: Sweeper: copy long-expired lease rows' tokens into the fence rows first, so
#: a later claim still gets a larger one.
SWEEP_KEEP_FENCES = """
INSERT INTO celery_lease_fences AS fe (resource, fencing_token, updated_at)
SELECT lease_key, fencing_token, :now FROM celery_lease_leases
WHERE expires_at < :cutoff AND substr(lease_key, 1, :internal_len) <> :internal
ORDER BY lease_key
ON CONFLICT (resource) DO UPDATE SET
    fencing_token = CASE WHEN fe.fencing_token > excluded.fencing_token
                         THEN fe.fencing_token ELSE excluded.fencing_token END
"""
#: Sweeper: then delete those lease rows.
SWEEP_LEASES = "DELETE FROM celery_lease_leases WHERE expires_at < :cutoff"
#: Sweeper: internal markers (``celery-lease/...``, never a lease key) keep no
#: fence: their fence rows go with their expired lease rows.
SWEEP_INTERNAL_FENCES = """
DELETE FROM celery_lease_fences
WHERE substr(resource, 1, :internal_len) = :internal
  AND NOT EXISTS (SELECT 1 FROM celery_lease_leases l
                  WHERE l.lease_key = celery_lease_fences.resource AND l.expires_at >= :cutoff)
"""


# ---------------------------------------------------------------------------
# End marks (celery_lease/result_end.py): a task id whose FAILURE celery-lease
# decided, recorded under the key's lock before that FAILURE is stored.

#: A task id's end mark (its token), if any.
ENDED_FOR_TASK = "SELECT fencing_token FROM celery_lease_ended WHERE task_id = :task_id"
#: Record a task id's end (a second mark of the same task id changes nothing).
ENDED_INSERT = """
INSERT INTO celery_lease_ended (task_id, lease_key, fencing_token, ended_at)
VALUES (:task_id, :key, :token, :now)
ON CONFLICT (task_id) DO NOTHING
"""
#: Leases in this database: one key's lease row and the clock, to lock it
#: (PostgreSQL appends FOR UPDATE: the colocated commit updates that row).
_LEASE_ROW = """
SELECT lease_key, owner_id, fencing_token, expires_at, acquired_at, renewed_at, ttl,
       task_id, task_name, root_id, tenant, {now} AS now
FROM celery_lease_leases WHERE lease_key = :key
"""


def _pg_commit_colocated(*, release: bool, once: bool, one_key: bool, meta: bool = False) -> str:
    """PostgreSQL, leases in this database: check ownership on the lease rows
    (and release them), and insert the result, in one statement (one round
    trip); with ``meta``, also the task's SUCCESS record in
    ``celery_lease_task_meta`` (``meta_queries._PG_META_IN_COMMIT``, written
    only if the result row was). Returns ``owned`` (lease rows still this
    owner's), ``duplicate`` (once mode: the key's accepted token) and
    ``accepted_at`` (None: nothing written). The duplicate look-up reads the
    statement's snapshot: only the lease's owner commits, and every earlier
    owner's commit preceded this owner's claim. So does the end-mark guard: a
    mark made while this statement waits for the lease row is refused while
    that row names this grant unreleased (``result_end._mark``).
    """
    match = "l.lease_key = :key" if one_key else "l.lease_key = ANY(CAST(:keys AS text[]))"
    owned = "EXISTS (SELECT 1 FROM own)" if one_key else "(SELECT count(*) FROM own) = :n"
    dup = (
        "dup AS (\n    SELECT fencing_token FROM celery_lease_results WHERE lease_key = :key\n"
        "    ORDER BY fencing_token LIMIT 1\n),\n"
        if once
        else ""
    )
    release_set = (
        "expires_at = t.now, renewed_at = t.now" if release else "renewed_at = l.renewed_at"
    )
    return f"""
WITH t AS (SELECT {_PG_NOW} AS now),
own AS (
    UPDATE celery_lease_leases AS l SET {release_set}
    FROM t
    WHERE {match} AND l.owner_id = :owner_id
        AND l.fencing_token = :token AND l.expires_at > t.now
    RETURNING l.lease_key
),
{dup}ins AS (
    INSERT INTO celery_lease_results
        (lease_key, fencing_token, task_id, task_name, owner_id, tenant, root_id, result,
         accepted_at)
    SELECT :key, :token, :task_id, :task_name, :owner_id, :tenant, :root_id,
           CAST(:result AS jsonb), t.now
    FROM t
    WHERE {owned}{" AND NOT EXISTS (SELECT 1 FROM dup)" if once else ""}
        AND {_ENDED_GUARD}
    ON CONFLICT (lease_key, fencing_token) DO NOTHING
    RETURNING accepted_at
){"," + chr(10) + _PG_META_IN_COMMIT if meta else ""}
SELECT (SELECT count(*) FROM own) AS owned,
       {"(SELECT fencing_token FROM dup)" if once else "CAST(NULL AS bigint)"} AS duplicate,
       (SELECT accepted_at FROM ins) AS accepted_at
"""


#: The colocated commit (:func:`_pg_commit_colocated`) by (release, once, one key):
#: one text each, with nothing left for the planner to fold, so that PostgreSQL
#: settles on a generic plan after its first five executions of the prepared
#: statement. A parameter such as ``AND :once`` would be folded by a custom plan,
#: which then always looks cheaper and is planned anew at every execution.
PG_COMMIT_COLOCATED: dict[tuple[bool, bool, bool], str] = {
    (release, once, one_key): _pg_commit_colocated(release=release, once=once, one_key=one_key)
    for release in (True, False)
    for once in (True, False)
    for one_key in (True, False)
}
#: The same, with the task's SUCCESS record in the result backend's table.
PG_COMMIT_COLOCATED_META: dict[tuple[bool, bool, bool], str] = {
    flags: _pg_commit_colocated(release=flags[0], once=flags[1], one_key=flags[2], meta=True)
    for flags in PG_COMMIT_COLOCATED
}


# ---------------------------------------------------------------------------
# The PostgreSQL hot paths' statements in psycopg's ``%(name)s`` form
# (``Database.pg_first``): converted once here, not per call. The server
# receives the same text as through ``Conn.execute``.

#: The server functions' names (:mod:`celery_lease.sql.functions` creates them).
CLAIM_LOOKUP_FN = "celery_lease_claim_lookup_v1"
REGISTER_LOOKUP_FN = "celery_lease_register_lookup_v2"

PG_CLAIM_ONE_PY = pyformat(PG_CLAIM_ONE)
#: Leases in the result database, one key: the claim, then the look-ups.
PG_CLAIM_LOOKUP_PY = (
    f"SELECT * FROM {CLAIM_LOOKUP_FN}(%(key)s, %(owner_id)s, %(ttl)s, %(task_id)s, "
    "%(task_name)s, %(root_id)s, %(tenant)s, %(once)s)"
)
#: Leases elsewhere: the registration, then the look-ups; one row.
PG_REGISTER_LOOKUP_PY = (
    f"SELECT * FROM {REGISTER_LOOKUP_FN}(%(key)s, %(token)s, %(task_id)s, %(once)s)"
)
PG_COMMIT_COLOCATED_PY = {flags: pyformat(sql) for flags, sql in PG_COMMIT_COLOCATED.items()}
PG_COMMIT_COLOCATED_META_PY = {
    flags: pyformat(sql) for flags, sql in PG_COMMIT_COLOCATED_META.items()
}
