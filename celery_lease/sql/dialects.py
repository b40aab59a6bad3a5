"""The statements whose text depends on the dialect (the clock, ``jsonb``,
row locks) or on a number of keys, rendered from :mod:`celery_lease.sql.queries`'
templates: at import for each dialect (``Database.sql``), once per n for the
n-key ones (cached). Call sites look them up; they never assemble text."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from celery_lease.sql import chord_queries, meta_queries, queries
from celery_lease.sql.chord_queries import _CHORD_DUE_CLAIM, _CHORD_DUE_CLEANUP, _CHORD_DUE_MARK
from celery_lease.sql.meta_queries import (
    _META_CLEANUP,
    _META_COMMIT,
    _META_EXPIRE,
    _META_FENCE,
    _META_FENCED,
    _META_GET,
    _META_INCR,
    _META_MGET,
    _META_NEWER_FOR_TASK,
    _META_NEWER_REGISTERED,
    _META_ONCE,
    _META_SET,
    _OVER_SUCCESS,
    _REGISTER_TASK,
    IN_KEYS,
    STATUS,
)
from celery_lease.sql.queries import (
    _INSPECT,
    _LEASE_ROW,
    _LIST,
    _RELEASE_IN,
    _RENEW_LEASE,
    _RESULT_GUARDS,
    _RESULT_INSERT,
    _RESULT_INSERT_META,
    _RESULT_OWN_LEASE,
    _SELECT_FENCES_IN,
    _SELECT_LEASES_IN,
    FENCE_CURRENT,
    NOW,
    REGISTER,
    RESULT_VALUE,
    _bound,
    pyformat,
)

__all__ = ["DIALECTS", "FENCED_KINDS", "Dialect", "key_params", "rendered"]

#: The kinds of a leased task's state write (``Dialect.meta_fenced``): a
#: SUCCESS, another final state (FAILURE, REVOKED), a state that is not final.
FENCED_KINDS = ("success", "final", "active")


class Dialect:
    """The statements of one dialect whose text depends on it, rendered once."""

    def __init__(self, name: str) -> None:
        now = NOW[name]
        sqlite = name == "sqlite"
        self.name = name
        #: The database's clock, as an SQL expression.
        self.now = now
        #: Read the database's clock.
        self.select_now = f"SELECT {now}"
        #: Register ``:token`` as ``:key``'s newest (results before a body,
        #: and ``fencing.guard``); no row: a newer token is registered.
        self.register_fence = REGISTER.format(now=now, **_bound("key", "token")).strip() + "\n"
        #: Then the task id's registration, in the same transaction (SQLite;
        #: PostgreSQL runs it in ``celery_lease_register_lookup_v2``).
        self.register_task = _REGISTER_TASK.format(now=now, **_bound("key", "token", "task_id"))
        #: One key's lease row, its fence and the clock (``(SELECT 1)``: a row even if none).
        self.inspect = _INSPECT.format(now=now)
        #: Lease rows under a LIKE pattern, live ones only unless ``:expired``.
        self.list_leases = _LIST.format(now=now)
        #: Commit with leases elsewhere: the key's fence row, locked (PostgreSQL).
        self.lock_fence = FENCE_CURRENT if sqlite else FENCE_CURRENT + " FOR UPDATE"
        #: Leases in this database: a key's lease row, locked (end marks).
        self.lease_row = _LEASE_ROW.format(now=now) + ("" if sqlite else "FOR UPDATE\n")
        #: The result insert (``_RESULT_INSERT``), by once mode.
        self.result_insert = {
            once: _RESULT_INSERT.format(
                result=RESULT_VALUE["sqlite" if sqlite else "postgresql"],
                now=now,
                guards=_RESULT_GUARDS[once],
            )
            for once in (True, False)
        }
        #: PostgreSQL: the result insert and the task's SUCCESS record in one
        #: statement, by once mode (SQLite runs :attr:`meta_commit` after the insert).
        self.result_insert_meta = (
            {}
            if sqlite
            else {
                once: _RESULT_INSERT_META.format(insert=sql.strip())
                for once, sql in self.result_insert.items()
            }
        )
        self._render_meta(name, now)

    def _render_meta(self, name: str, now: str) -> None:
        """The result backend's statements (``meta_queries``, celery_lease/backend.py)."""
        status = STATUS[name].format(col="m.value")
        #: Upsert a key's value and expiry (never over a leased task's SUCCESS).
        self.meta_set = _META_SET.format(now=now, status=status)
        #: A leased task's state write, fenced by its token, by the state's kind
        #: (:data:`FENCED_KINDS`): SUCCESS, another final state, any other.
        in_keys = IN_KEYS[name]
        self.meta_fenced = {
            kind: _META_FENCED.format(
                now=now,
                in_keys=in_keys,
                over_success=_OVER_SUCCESS[kind == "success"].format(status=status),
                registered=(
                    _META_NEWER_REGISTERED if kind == "active" else _META_NEWER_FOR_TASK
                ).format(in_keys=in_keys),
            )
            for kind in FENCED_KINDS
        }
        #: A row's token and state (what a refused write met).
        self.meta_fence = _META_FENCE.format(status=STATUS[name].format(col="value"))
        #: SQLite: the fenced commit's record, after the insert, in its transaction.
        self.meta_commit = _META_COMMIT.format(now=now)
        #: One key's unexpired value.
        self.meta_get = _META_GET.format(now=now)
        #: Add one to a key's counter, returning it.
        self.meta_incr = _META_INCR.format(now=now)
        #: Mark a key done once (a chord member's count), in the incr's transaction.
        self.meta_once = _META_ONCE.format(now=now)
        #: Set an unexpired key's expiry.
        self.meta_expire = _META_EXPIRE.format(now=now)
        #: Delete the expired rows.
        self.meta_cleanup = _META_CLEANUP.format(now=now)
        #: A chord due its callback (celery_lease/backend_chords.py): marked by the
        #: last count, claimed by the worker that publishes it late, swept.
        self.chord_due_mark = _CHORD_DUE_MARK.format(now=now)
        self.chord_due_claim = _CHORD_DUE_CLAIM.format(now=now)
        self.chord_due_cleanup = _CHORD_DUE_CLEANUP.format(now=now)

    # Over n keys (an ``IN`` list; parameters named by :func:`key_params`).

    def release_in(self, n: int) -> str:
        """Release a lease of n keys."""
        return _release_in(self.now, n)

    def select_fences_in(self, n: int) -> str:
        """The fence rows of n keys (SQLite claims)."""
        return _select_fences_in(n)

    def select_leases_in(self, n: int) -> str:
        """The lease rows of n keys (claims in a transaction)."""
        return _select_leases_in(n)

    def renew_lease(self, n: int) -> str:
        """SQLite, one lease of n keys, in the renewal's write transaction: all
        its rows or none (the count is read before any is changed)."""
        return _renew_lease(n)

    def result_own_lease(self, release: bool, n: int) -> str:
        """SQLite, colocated commit: own (and release, or only touch) n lease rows."""
        return _result_own_lease(release, n)

    def meta_mget(self, n: int) -> str:
        """The result backend: the unexpired values of n keys."""
        return _meta_mget(self.now, n)


def key_params(keys: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """The bound keys of an n-key statement: ``{"k0": keys[0], ...}``."""
    return {f"k{i}": key for i, key in enumerate(keys)}


@lru_cache(maxsize=64)
def _in_list(n: int) -> str:
    return ", ".join(f":k{i}" for i in range(n))


@lru_cache(maxsize=128)
def _release_in(now: str, n: int) -> str:
    return _RELEASE_IN.format(now=now, keys=_in_list(n))


@lru_cache(maxsize=64)
def _select_fences_in(n: int) -> str:
    return _SELECT_FENCES_IN.format(keys=_in_list(n))


@lru_cache(maxsize=64)
def _select_leases_in(n: int) -> str:
    return _SELECT_LEASES_IN.format(keys=_in_list(n))


@lru_cache(maxsize=64)
def _renew_lease(n: int) -> str:
    return _RENEW_LEASE.format(keys=_in_list(n))


@lru_cache(maxsize=128)
def _result_own_lease(release: bool, n: int) -> str:
    keep = "expires_at = :now, renewed_at = :now" if release else "renewed_at = renewed_at"
    return _RESULT_OWN_LEASE.format(set=keep, keys=_in_list(n))


@lru_cache(maxsize=128)
def _meta_mget(now: str, n: int) -> str:
    return _META_MGET.format(now=now, keys=_in_list(n))


DIALECTS = {name: Dialect(name) for name in NOW}


#: The PostgreSQL hot paths' dialect-rendered statements in psycopg's form.
#: (Release of one key binds ``:key``, as the claim does.)
PG_RELEASE_ONE_PY = pyformat(_RELEASE_IN.format(now=NOW["postgresql"], keys=":key"))


def rendered(dialect: str) -> Iterator[tuple[str, str]]:
    """``(name, text)`` of every client statement ``dialect`` can run, n-key
    ones for one key, in ``:name`` form (for the benchmarks' tables and tests)."""
    pg = dialect == "postgresql"
    for module in (queries, meta_queries, chord_queries):
        for name, value in vars(module).items():
            public = name[0] != "_" and name.isupper() and name[-3:] not in ("_PY", "_FN")
            if public and isinstance(value, str) and (pg or not name.startswith("PG_")):
                if name not in ("CLAIM_CTE", "REGISTER"):  # parts, not statements
                    yield name, value
    d = DIALECTS[dialect]
    yield "select_now", d.select_now
    yield "register_fence", d.register_fence
    yield "register_task", d.register_task
    yield "inspect", d.inspect
    yield "list_leases", d.list_leases
    for once, sql in d.result_insert.items():
        yield f"result_insert[once={once}]", sql
    for once, sql in d.result_insert_meta.items():
        yield f"result_insert_meta[once={once}]", sql
    yield "meta_set", d.meta_set
    for kind, sql in d.meta_fenced.items():
        yield f"meta_fenced[{kind}]", sql
    yield "meta_fence", d.meta_fence
    yield "meta_get", d.meta_get
    yield "meta_mget", d.meta_mget(1)
    yield "meta_incr", d.meta_incr
    yield "meta_once", d.meta_once
    yield "meta_expire", d.meta_expire
    yield "meta_cleanup", d.meta_cleanup
    yield "chord_due_mark", d.chord_due_mark
    yield "chord_due_claim", d.chord_due_claim
    yield "chord_due_cleanup", d.chord_due_cleanup
    yield "release_in", d.release_in(1)
    yield "select_leases_in", d.select_leases_in(1)
    yield "lease_row", d.lease_row
    if pg:  # on SQLite, lock_fence is FENCE_CURRENT itself
        yield "lock_fence", d.lock_fence
        for (release, once, one_key), sql in queries.PG_COMMIT_COLOCATED.items():
            yield f"PG_COMMIT_COLOCATED[{release=}, {once=}, {one_key=}]", sql
        for (release, once, one_key), sql in queries.PG_COMMIT_COLOCATED_META.items():
            yield f"PG_COMMIT_COLOCATED_META[{release=}, {once=}, {one_key=}]", sql
        yield "claim_lookup", pyformat_back(queries.PG_CLAIM_LOOKUP_PY)
        yield "register_lookup", pyformat_back(queries.PG_REGISTER_LOOKUP_PY)
    else:
        yield "select_fences_in", d.select_fences_in(1)
        yield "renew_lease", d.renew_lease(1)
        for release in (True, False):
            yield f"result_own_lease[{release=}]", d.result_own_lease(release, 1)
        yield "meta_commit", d.meta_commit


def pyformat_back(sql: str) -> str:
    """``%(name)s`` placeholders as ``:name`` (the inverse of :func:`pyformat`)."""
    return re.sub(r"%\((\w+)\)s", r":\1", sql).replace("%%", "%")
