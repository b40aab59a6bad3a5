"""The SQL tables: the single source for the Alembic migrations in ``migrations/``.

All times are epoch seconds in *store* time (the database's clock), stored as
double precision, so the same arithmetic works on PostgreSQL and SQLite.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Double,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB

__all__ = [
    "VERSION_TABLE",
    "chord_due",
    "ended",
    "fences",
    "leases",
    "metadata",
    "registrations",
    "results",
    "task_meta",
]

#: Alembic's version table for this package, apart from the application's own.
VERSION_TABLE = "celery_lease_alembic_version"

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
    }
)

#: One row per key ever claimed. The row (and its token) survives release;
#: the sweeper deletes long-expired rows, the fence row keeps the token.
leases = Table(
    "celery_lease_leases",
    metadata,
    Column("lease_key", Text, primary_key=True),
    Column("owner_id", Text, nullable=True),
    Column("fencing_token", BigInteger, nullable=False),
    Column("ttl", Double, nullable=True),
    Column("expires_at", Double, nullable=False),
    Column("acquired_at", Double, nullable=True),
    Column("renewed_at", Double, nullable=True),
    Column("task_id", Text, nullable=True),
    Column("task_name", Text, nullable=True),
    Column("root_id", Text, nullable=True),
    Column("tenant", Text, nullable=True),
    Index(None, "expires_at"),
)

#: One row per accepted commit. ``lease_key`` + ``fencing_token`` is unique.
results = Table(
    "celery_lease_results",
    metadata,
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("lease_key", Text, nullable=False),
    Column("fencing_token", BigInteger, nullable=False),
    Column("task_id", Text, nullable=True),
    Column("task_name", Text, nullable=True),
    Column("owner_id", Text, nullable=True),
    Column("tenant", Text, nullable=True),
    Column("root_id", Text, nullable=True),
    Column("result", JSON().with_variant(JSONB(), "postgresql"), nullable=True),
    Column("accepted_at", Double, nullable=False),
    UniqueConstraint("lease_key", "fencing_token"),
    Index(None, "task_id"),
    Index(None, "accepted_at"),
)

#: The newest token seen per resource: a lease key (registered at claim) or a
#: downstream resource guarded with :func:`celery_lease.fencing.guard`.
#: Never lowered, never swept.
fences = Table(
    "celery_lease_fences",
    metadata,
    Column("resource", Text, primary_key=True),
    Column("fencing_token", BigInteger, nullable=False),
    Column("updated_at", Double, nullable=False),
)

#: With leases elsewhere: the newest token each task id registered for a key
#: (beside the key's fence row, in the same round trip). The fence row keeps
#: only the newest registration of any task id; the result backend's fenced
#: write of a final state asks whether a newer copy of *its* task id holds a
#: grant of the key, which a newer grant of another task id must not hide.
#: Swept with the lease rows' grace (``registered_at``).
registrations = Table(
    "celery_lease_registrations",
    metadata,
    Column("resource", Text, primary_key=True),
    Column("task_id", Text, primary_key=True),
    Column("fencing_token", BigInteger, nullable=False),
    Column("registered_at", Double, nullable=False),
    Index(None, "registered_at"),
)

#: One row per task id whose FAILURE celery-lease decided after its result was
#: refused (fenced, its lease taken over): written, under the key's lock,
#: before that FAILURE is stored, and checked by every commit, so no copy of
#: the task id is accepted over it. Swept with the results.
ended = Table(
    "celery_lease_ended",
    metadata,
    Column("task_id", Text, primary_key=True),
    Column("lease_key", Text, nullable=False),
    Column("fencing_token", BigInteger, nullable=False),
    Column("ended_at", Double, nullable=False),
    Index(None, "ended_at"),
)

#: The Celery result backend's records (``celery_lease.backend.LeaseBackend``):
#: one row per key of Celery's key-value protocol (``celery-task-meta-<id>``,
#: ``celery-taskset-meta-<id>``, ``chord-unlock-<id>``), ``value`` the JSON Celery
#: encoded. ``expires_at`` NULL: never expires; a row past it reads as absent
#: until ``backend.cleanup()`` deletes it. ``token`` is reserved for fencing a
#: leased task's state writes and written by nothing yet.
task_meta = Table(
    "celery_lease_task_meta",
    metadata,
    Column("key", Text, primary_key=True),
    Column("value", Text, nullable=False),
    Column("expires_at", Double, nullable=True),
    Column("token", BigInteger, nullable=True),
    Index(None, "expires_at"),
)

#: The chords whose last header member was counted and whose callback is not
#: known to be published (``celery_lease.backend_chords``): a row is written in
#: the transaction of the count that reached the header's size and deleted
#: with the chord's counter once Celery is done with it (published, or the
#: chord failed). A row that outlives the publish window names a chord whose
#: last member died between its count and the publish: a worker publishes the
#: callback then. ``key`` is the counter's key (``chord-unlock-<group id>``),
#: ``callback`` the callback's signature as JSON; ``claimed_until``: a worker
#: is publishing it until then.
chord_due = Table(
    "celery_lease_chord_due",
    metadata,
    Column("key", Text, primary_key=True),
    Column("group_id", Text, nullable=False),
    Column("callback", Text, nullable=False),
    Column("due_at", Double, nullable=False),
    Column("expires_at", Double, nullable=True),
    Column("claimed_until", Double, nullable=True),
    Index(None, "due_at"),
)
