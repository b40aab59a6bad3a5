"""The Celery result backend's statements (celery_lease/backend.py), by name.

Celery's key-value protocol over ``celery_lease_task_meta``, rendered per
dialect (``{now}``: the database's clock) as ``Database.sql.meta_*`` by
:mod:`celery_lease.sql.dialects`. A row past its ``expires_at`` reads as
absent, as an expired Redis key does, until ``meta_cleanup`` deletes it;
``expires_at`` NULL never expires. ``:ttl`` NULL: no expiry.

Kept apart from :mod:`celery_lease.sql.queries` (the leases and the fenced
results) so that each module stays readable; the same rules hold: parameters
always bound, every statement named once, call sites never assemble text.
"""

from __future__ import annotations

#: Write a key's value (upsert) and its expiry, ``:ttl`` seconds from now.
_META_SET = """
INSERT INTO celery_lease_task_meta AS m (key, value, expires_at)
VALUES (:key, :value, {now} + CAST(:ttl AS double precision))
ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
"""
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
#: Set an unexpired key's expiry to ``:ttl`` seconds from now (NULL: never).
_META_EXPIRE = """
UPDATE celery_lease_task_meta SET expires_at = {now} + CAST(:ttl AS double precision)
WHERE key = :key AND (expires_at IS NULL OR expires_at > {now})
"""
#: ``backend.cleanup()`` (Celery beat's ``celery.backend_cleanup``): the expired rows.
_META_CLEANUP = "DELETE FROM celery_lease_task_meta WHERE expires_at <= {now}"
