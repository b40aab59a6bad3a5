"""The fenced result table: the accepted record of each key's work.

A commit is accepted only if, atomically with the write, its token is the
newest ever issued for the key **and** its lease is still held in store time.
Comparing with the highest *committed* token is not enough: an old owner
that resumes while the new owner is still working would be accepted.

Two ways to make that atomic, chosen by where the leases live:

**Leases in the same SQL database** (both URLs name it, in any spelling): one
transaction updates the lease row ``WHERE owner AND token AND unexpired``
(locking it, and releasing it when asked) and inserts the result only if that
update matched. A claim by a new owner needs the same row, so it waits for
the commit or sees it.

**Leases elsewhere** (Redis, or another database): the key's row in this
database's ``celery_lease_fences`` is the lock and the register::

    A: claim in Redis (token 7) -> register: fence row := 7 (before the body)
    A: ... works ... pauses past its TTL
    B: claim in Redis (token 8) -> register: fence row := 8
    A: commit: lock fence row, sees 8 != 7 -> StaleFencingToken
    B: commit: lock fence row (8 == 8), Redis release/renew says still owner,
       insert, commit -> accepted

    If A's commit holds the fence row when B registers, B's registration
    waits for A's commit, so B's body starts only after A's commit is final.

The commit locks the fence row, requires the registered token to be its
own, then asks the lease store, *while holding the lock*, whether it still
owns the lease (releasing it in the same round trip), then inserts. The
window that remains: the store's yes is a fact at that instant; if the lease
runs out between that answer and the database commit (milliseconds), a new
owner can claim in the store, but cannot register (the fence row is locked)
and so cannot start its body until this commit is decided. No two bodies'
*commits* can be accepted out of order, and a stale token is never accepted.

Modes: ``exclusive`` keeps one row per accepted run; ``once`` makes the key a
unit of work: at most one accepted row per key, every later commit raises
:class:`DuplicateResult` (a stale token is reported first, as
:class:`StaleFencingToken`).

Results are JSON only and size-limited; a value that cannot be stored fails first.

A commit may carry a :class:`MetaRecord`, a result backend's record of the
task (the ``lease+`` backend's SUCCESS, when its table is in this database),
written in the commit's transaction with the lease's token exactly when the row is.

This module is the table's API and its reads; the commits are in
:mod:`~.result_commit`, end marks in :mod:`~.result_end`, retention in :mod:`~.result_sweep`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery_lease.exceptions import (
    DuplicateResult,
    LeaseConfigError,
    LeaseError,
    ResultNotSerializable,
    ResultTooLarge,
    StaleFencingToken,
)
from celery_lease.keys import shorten
from celery_lease.result_commit import MetaRecord, commit_colocated, commit_remote
from celery_lease.result_end import EndMark, end_task
from celery_lease.result_sweep import sweep as sweep_table
from celery_lease.sql import database
from celery_lease.sql import queries as q
from celery_lease.sql.migrate import on_first_use
from celery_lease.stores.base import (
    Lease,
    LeaseStore,
    check_meta,
    check_ttl,
    make_lease,
    normalize_keys,
)
from celery_lease.stores.sql import SQLLeaseStore, claim_params

__all__ = [
    "DEFAULT_MAX_BYTES",
    "MODES",
    "AcceptedResult",
    "EndMark",
    "MetaRecord",
    "Prepared",
    "ResultTable",
    "accepted",
    "encode_result",
    "for_task",
]

logger = logging.getLogger(__name__)

MODES = ("exclusive", "once")
#: A JSON ``\u0000`` escape (not an escaped backslash followed by "u0000").
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
DEFAULT_MAX_BYTES = 1024 * 1024


@dataclass(frozen=True)
class AcceptedResult:
    """One accepted commit. ``accepted_at`` is epoch seconds in the database's clock."""

    key: str
    token: int
    task_id: str | None
    owner_id: str | None
    value: Any
    accepted_at: float
    task_name: str | None = None
    tenant: str | None = None
    root_id: str | None = None

    @property
    def accepted_datetime(self) -> datetime:
        return datetime.fromtimestamp(self.accepted_at, tz=timezone.utc)


def encode_result(value: Any, *, task_name: str | None = None, max_bytes: int | None = None) -> str:
    """``value`` as compact JSON, or a clear error naming the task and the type."""
    who = f"task {task_name!r}" if task_name else "the commit"
    try:
        encoded = json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except TypeError as e:
        raise ResultNotSerializable(
            f"{who} returned a value that cannot be stored as JSON ({e}); results are JSON "
            "only: return dicts, lists, strings, numbers, booleans or None"
        ) from e
    except ValueError as e:
        raise ResultNotSerializable(
            f"{who} returned a value that cannot be stored as JSON ({e})"
        ) from e
    limit = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    try:
        size = len(encoded.encode())
    except UnicodeEncodeError as e:  # a lone surrogate: valid in str, not in UTF-8
        raise ResultNotSerializable(
            f"{who} returned a string that cannot be stored as UTF-8 JSON ({e})"
        ) from e
    if "\\u0000" in encoded and _NUL_ESCAPE.search(encoded):
        # PostgreSQL's jsonb refuses U+0000; refuse it on SQLite too, before
        # the commit releases anything, so a result storable in one is in both.
        raise ResultNotSerializable(
            f"{who} returned a str containing U+0000 (NUL), which cannot be stored as JSON "
            "in PostgreSQL"
        )
    if limit and size > limit:
        raise ResultTooLarge(
            f"{who} returned {size} bytes of JSON, over lease_result_max_bytes={limit}; "
            "store large artifacts elsewhere and return a reference"
        )
    return encoded


@dataclass(frozen=True)
class Prepared:
    """What :meth:`ResultTable.prepare` found before the body runs."""

    #: token of an accepted result of this task id (a late redelivery), or None
    task_token: int | None
    #: once mode: token of the key's accepted result (a duplicate), or None
    duplicate_token: int | None


class ResultTable:
    """The fenced result table in one SQL database.

    ``store`` is the lease store whose leases are committed here; when it is
    an SQL store on the same database, commits use the one-transaction path.
    """

    def __init__(
        self,
        url: str,
        store: LeaseStore | None = None,
        *,
        max_bytes: int | None = None,
    ) -> None:
        self.db = database(url)
        on_first_use(self.db)
        self.url = self.db.url
        self.store = store
        self.max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
        self.colocated = isinstance(store, SQLLeaseStore) and store.db is self.db

    # -- before the body ---------------------------------------------------

    @property
    def needs_registration(self) -> bool:
        """True when leases live elsewhere: call :meth:`register` right after each claim."""
        return not self.colocated

    def register(self, lease: Lease) -> None:
        """Record ``lease.token`` as the key's newest token (and its task id's,
        ``lease.meta["task_id"]``), before the body runs: :meth:`prepare`'s
        registration, its look-ups ignored.

        Raises :class:`StaleFencingToken` if a newer token is registered already
        (another owner claimed after this one).
        """
        if not self.colocated:
            self.prepare(lease, lease.meta.get("task_id"), once=False)

    def claim_prepared(
        self,
        key: str | list[str],
        *,
        ttl: float,
        owner_id: str,
        meta: dict[str, str | None],
        task_id: str | None,
        once: bool,
    ) -> tuple[Lease | None, Prepared | None]:
        """Leases in this database (:attr:`colocated`) only: claim ``key`` and
        :meth:`prepare` together, one round trip on PostgreSQL (one key: one
        server-side call; there is nothing to register). Returns
        ``(None, None)`` when not granted. With leases elsewhere, claim from
        the store and call :meth:`prepare` (it may refuse a granted lease,
        which the caller must then release).
        """
        if not (self.colocated and isinstance(self.store, SQLLeaseStore)):
            raise LeaseConfigError("claim_prepared needs the leases in the result database")
        if not self.db.is_sqlite:
            primary, keys = normalize_keys(key)
            if len(keys) == 1:
                # One key: the claim and the look-ups in one server-side call
                # (queries.CLAIM_LOOKUP_FN, sql/functions.py), the look-ups
                # reading a snapshot taken after the claim's lock waits.
                ttl, checked = check_ttl(ttl), check_meta(meta)
                params = claim_params(primary, owner_id, ttl, checked)
                params["once"] = once
                out = self.db.pg_first(q.PG_CLAIM_LOOKUP_PY, params)
                if out is None:
                    return None, None
                token, expires_at, acquired_at, task_token, duplicate_token = out
                granted = make_lease(
                    primary, keys, owner_id, int(token), float(expires_at), float(acquired_at),
                    ttl, checked,
                )  # fmt: skip
                return granted, self._prepared(task_token, duplicate_token)
        lookup = {"token": None, "task_id": task_id, "once": once}
        lease, rows = self.store.claim_then(
            key, (q.PREPARE_LOOKUP, lookup), ttl=ttl, owner_id=owner_id, meta=meta
        )
        if lease is None or rows is None:
            return None, None
        row = rows.one()
        return lease, self._prepared(row.task_token, row.duplicate_token)

    @staticmethod
    def _prepared(task_token: Any, duplicate_token: Any) -> Prepared:
        return Prepared(
            None if task_token is None else int(task_token),
            None if duplicate_token is None else int(duplicate_token),
        )

    def prepare(self, lease: Lease, task_id: str | None, *, once: bool) -> Prepared:
        """Before the body: :meth:`register` the token and look up earlier results.

        Raises :class:`StaleFencingToken` if a newer owner registered first.

        The registration and the look-ups are two statements, the look-ups
        started *after* the registration returned: an owner's commit releases
        its lease in the store while its transaction still holds the fence
        row, so a copy of the same task id can claim in that window; its
        registration waits for that commit, and only a statement started after
        the wait sees the accepted row (one statement would read the results
        with a snapshot taken before the wait, and run an accepted task again).
        On PostgreSQL, with leases elsewhere, both run in one server-side call
        (``queries.REGISTER_LOOKUP_FN``, sql/functions.py: two statements, two
        snapshots), one round trip.
        """
        params = {"key": lease.key, "token": lease.token, "task_id": task_id, "once": once}
        if not self.colocated and not self.db.is_sqlite:
            out = self.db.pg_first(q.PG_REGISTER_LOOKUP_PY, params)
            if out is None:  # never: the function returns one row
                raise LeaseError("expected exactly one row, the database returned 0")
            registered, task_token, duplicate_token = out
            if registered is None:
                raise StaleFencingToken(
                    lease.key, lease.token, self.fence(lease.key), "a newer owner registered first"
                )
            return self._prepared(task_token, duplicate_token)
        statements = [(q.PREPARE_LOOKUP, params)]
        if not self.colocated:  # the registrations first, in the same transaction
            statements[:0] = [
                (self.db.sql.register_fence, params),
                (self.db.sql.register_task, params),
            ]
        with self.db.single() as conn:
            out = conn.pipeline(*statements)
        row = out[-1].one()
        registered = len(out) == 1 or bool(out[0].all())
        if not registered:
            raise StaleFencingToken(
                lease.key, lease.token, self.fence(lease.key), "a newer owner registered first"
            )
        return self._prepared(row.task_token, row.duplicate_token)

    # -- the commit --------------------------------------------------------

    def commit(
        self,
        lease: Lease,
        value: Any,
        *,
        mode: str = "exclusive",
        release: bool = True,
        task_id: str | None = None,
        task_name: str | None = None,
        tenant: str | None = None,
        root_id: str | None = None,
        encoded: str | None = None,
        meta: MetaRecord | None = None,
    ) -> AcceptedResult:
        """Accept ``value`` for ``lease`` if its token is still the newest and held.

        Releases the lease in the same step when ``release`` (the default).
        Raises :class:`StaleFencingToken` (nothing written) or, in ``once``
        mode, :class:`DuplicateResult`; encoding errors are raised before
        anything is written. Idempotent: retrying a commit whose outcome was
        lost with the connection returns the row it wrote. ``meta`` is
        written in the same transaction, with ``lease.token``, if the row is
        (on PostgreSQL in the same statement: no round trip added).
        """
        if mode not in MODES:
            raise LeaseConfigError(f"lease_mode must be one of {MODES}, got {mode!r}")
        if encoded is None:
            encoded = encode_result(value, task_name=task_name, max_bytes=self.max_bytes)
        row = _result_row(lease, encoded, task_id, task_name, tenant, root_id, meta)
        try:
            if self.colocated:
                accepted_at = commit_colocated(self, lease, row, mode, release, meta is not None)
            else:
                accepted_at = commit_remote(self, lease, row, mode, release, meta is not None)
        except (StaleFencingToken, DuplicateResult):
            # A retry of a commit whose reply was lost: refused as stale once the
            # lease is gone, or (lease still held) found as this token's own row.
            existing = self.get(lease.key, lease.token)
            if existing is not None and existing.owner_id == lease.owner_id:
                return existing  # an earlier attempt of this very commit was accepted
            raise
        return _accepted(lease, row, encoded, accepted_at)

    def end(self, lease: Lease, task_id: str, *, take_over: bool = False) -> EndMark:
        """Record ``task_id``'s end before its FAILURE is stored (:mod:`~.result_end`)."""
        return end_task(self, lease, task_id, take_over=take_over)

    def raise_fence(self, key: str, token: int) -> None:
        """Raise this database's fence for ``key`` to at least ``token`` (never lowers it).

        Used after a force release, so the evicted owner's guarded writes are refused.
        """
        with self.db.transaction() as conn:
            conn.execute(q.RAISE_FENCE, {"key": key, "token": token, "now": conn.now()})

    # -- reading -----------------------------------------------------------

    def fence(self, key: str) -> int | None:
        """The token registered in this database's fence row for ``key``."""
        with self.db.single() as conn:
            v = conn.execute(q.FENCE_CURRENT, {"key": key}).scalar()
        return None if v is None else int(v)

    def get(self, key: str, token: int) -> AcceptedResult | None:
        """The accepted row for exactly ``key`` and ``token``."""
        return self._one(q.RESULT_BY_KEY_TOKEN, {"key": shorten(key), "token": token})

    def accepted(self, key: str, tenant: str | None = None) -> AcceptedResult | None:
        """The newest accepted result for ``key`` (in ``tenant``'s scope), or None.

        ``key`` as the store holds it: the scoped key for a tenant (``scoped(key,
        tenant)``); a key no store keeps verbatim is looked up as ``shorten(key)``.
        """
        return self._one(q.RESULT_ACCEPTED, {"key": shorten(key), "tenant": tenant})

    def for_task(self, task_id: str) -> AcceptedResult | None:
        """The newest accepted result committed by ``task_id``, or None."""
        return self._one(q.RESULT_FOR_TASK, {"task_id": task_id})

    def history(self, key: str, tenant: str | None = None, limit: int = 20) -> list[AcceptedResult]:
        """Accepted results for ``key``, newest first."""
        with self.db.single() as conn:
            rows = conn.execute(
                q.RESULT_HISTORY, {"key": shorten(key), "tenant": tenant, "limit": limit}
            ).all()
        return [self._result(r) for r in rows]

    def _one(self, sql: str, params: Mapping[str, Any]) -> AcceptedResult | None:
        with self.db.single() as conn:
            row = conn.execute(sql, dict(params)).first()
        return None if row is None else self._result(row)

    def _result(self, row: Any) -> AcceptedResult:
        value = row.result
        if isinstance(value, str | bytes) and self.db.is_sqlite:  # bytes: a number's text
            value = json.loads(value)
        return AcceptedResult(
            key=row.lease_key,
            token=int(row.fencing_token),
            task_id=row.task_id,
            owner_id=row.owner_id,
            value=value,
            accepted_at=float(row.accepted_at),
            task_name=row.task_name,
            tenant=row.tenant,
            root_id=row.root_id,
        )

    # -- retention -----------------------------------------------------------

    def sweep(self, result_expires: float | None, lease_grace: float = 3600.0) -> dict[str, int]:
        """Delete results older than ``result_expires`` seconds (None keeps them)
        and lease rows expired for over ``lease_grace`` seconds.

        Never lowers a fence: a swept lease row's token is kept in its fence
        row first, so a later claim still gets a larger token. Internal
        markers (``celery-lease/...``: deferral markers, not leases) keep no
        fence: theirs is deleted with their row. Note that in
        ``once`` mode a swept result no longer blocks a duplicate: retention
        bounds the deduplication window.

        Both are finite numbers of seconds >= 0 (``result_expires`` may be
        None): a negative one puts the cutoff in the future, and a negative
        ``lease_grace`` would delete the rows of live leases.
        """
        return sweep_table(self.db, result_expires, lease_grace)


def _result_row(
    lease: Lease,
    encoded: str,
    task_id: str | None,
    task_name: str | None,
    tenant: str | None,
    root_id: str | None,
    record: MetaRecord | None = None,
) -> dict[str, Any]:
    """The row a commit inserts (and ``record``'s parameters); None takes the lease's meta."""
    meta = lease.meta
    extra = record.params() if record is not None else {}
    return {
        **extra,
        "key": lease.key,
        "token": lease.token,
        "task_id": task_id if task_id is not None else meta.get("task_id"),
        "task_name": task_name if task_name is not None else meta.get("task_name"),
        "owner_id": lease.owner_id,
        "tenant": tenant if tenant is not None else meta.get("tenant"),
        "root_id": root_id if root_id is not None else meta.get("root_id"),
        "result": encoded,
    }


def accepted(key: str, tenant: str | None = None, *, url: str) -> AcceptedResult | None:
    """The newest accepted result for ``key`` in the result table at ``url``."""
    return ResultTable(url).accepted(key, tenant)


def for_task(task_id: str, *, url: str) -> AcceptedResult | None:
    """The newest accepted result committed by ``task_id`` in the table at ``url``."""
    return ResultTable(url).for_task(task_id)


def _accepted(
    lease: Lease, row: dict[str, Any], encoded: str, accepted_at: float
) -> AcceptedResult:
    """Log an accepted commit and return what it wrote."""
    key, token, task_id = lease.key, lease.token, row["task_id"]
    extra = {"action": "commit", "lease_key": key, "token": token, "task_id": task_id}
    logger.info("result accepted key=%s token=%s task=%s", key, token, task_id or "-", extra=extra)
    return AcceptedResult(
        key,
        token,
        task_id,
        lease.owner_id,
        json.loads(encoded),
        accepted_at,
        row["task_name"],
        row["tenant"],
        row["root_id"],
    )
