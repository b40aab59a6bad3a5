"""The ``lease+`` backend's chords due their callback (celery_lease/backend_chords.py).

``celery_lease_chord_due`` holds one row per chord whose last header member
was counted and whose callback Celery may not have published yet; rendered
per dialect (``{now}``: the database's clock) as ``Database.sql.chord_due_*``
by :mod:`celery_lease.sql.dialects`. Parameters always bound.
"""

from __future__ import annotations

#: The count that reached the header's size, in its transaction: the chord
#: ``:key`` (its counter's key) is due its callback from now. A row already
#: there (a counter that expired and counted up again) is replaced.
_CHORD_DUE_MARK = """
INSERT INTO celery_lease_chord_due AS d (key, group_id, callback, due_at, expires_at)
VALUES (:key, :group_id, :callback, {now}, {now} + CAST(:ttl AS double precision))
ON CONFLICT (key) DO UPDATE SET
    group_id = excluded.group_id, callback = excluded.callback, due_at = excluded.due_at,
    expires_at = excluded.expires_at, claimed_until = NULL
"""
#: Celery is done with the chord (it deleted the counter): nothing is due.
CHORD_DUE_CLEAR = "DELETE FROM celery_lease_chord_due WHERE key = :key"
#: The oldest chord due for ``:grace`` seconds, unexpired and unclaimed, claimed
#: for ``:hold`` seconds: returned to one caller only. On PostgreSQL a
#: concurrent caller that picked the same row waits for the first one's
#: update, then re-checks ``claimed_until`` and updates nothing.
_CHORD_DUE_CLAIM = """
UPDATE celery_lease_chord_due SET claimed_until = {now} + CAST(:hold AS double precision)
WHERE key = (
    SELECT key FROM celery_lease_chord_due
    WHERE due_at <= {now} - CAST(:grace AS double precision)
      AND (claimed_until IS NULL OR claimed_until <= {now})
      AND (expires_at IS NULL OR expires_at > {now})
    ORDER BY due_at
    LIMIT 1
) AND (claimed_until IS NULL OR claimed_until <= {now})
RETURNING key, group_id, callback, {now} - due_at AS waited
"""
#: ``backend.cleanup()``: rows past the chord's expiry (its counter is gone too).
_CHORD_DUE_CLEANUP = "DELETE FROM celery_lease_chord_due WHERE expires_at <= {now}"
