"""The SQL lease store: PostgreSQL (psycopg 3) and SQLite, one code path.

Every operation is one short transaction with the database's clock as the
store time; nothing holds a transaction open while a task body runs.

- PostgreSQL: a single-key claim is one statement (``INSERT ... ON CONFLICT
  ... DO UPDATE ... WHERE <free or expired> RETURNING``) that also registers
  the new token in the key's fence row; renewals of any number of leases are
  one ``UPDATE ... FROM unnest(...)``.
- SQLite: ``BEGIN IMMEDIATE`` makes each operation the only writer, so a
  claim reads, decides and writes without row locks.

Tokens: a grant's token is one more than the largest of the key's lease row
and fence row. Release keeps the row (and its token); the sweeper deletes
long-expired rows, and the fence row, which is never lowered or swept, keeps
the token. So tokens only grow, across release, expiry, sweeps and restarts.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any

from celery_lease.exceptions import LeaseConfigError, StoreUnavailable
from celery_lease.sql import Conn, Rows, database
from celery_lease.sql import queries as q
from celery_lease.sql.dialects import PG_RELEASE_ONE_PY, key_params
from celery_lease.sql.migrate import on_first_use
from celery_lease.stores.base import (
    META_FIELDS,
    Lease,
    LeaseRecord,
    LeaseStore,
    check_meta,
    check_option_names,
    check_ttl,
    make_lease,
    normalize_keys,
)
from celery_lease.urls import check_sql_url

__all__ = ["SQLLeaseStore"]

_RETRIES = 3  # for deadlocks between multi-key claimers and single-key claimers


def claim_params(key: str, owner_id: str, ttl: float, meta: dict[str, str]) -> dict[str, Any]:
    """The parameters of a single-key PostgreSQL claim (``PG_CLAIM_ONE`` and
    the ``celery_lease_claim_lookup`` call), ``meta`` already checked."""
    get = meta.get
    return {
        "key": key,
        "owner_id": owner_id,
        "ttl": ttl,
        "task_id": get("task_id"),
        "task_name": get("task_name"),
        "root_id": get("root_id"),
        "tenant": get("tenant"),
    }


class SQLLeaseStore(LeaseStore):
    is_sql = True

    @classmethod
    def check_url(cls, name: str, url: str) -> None:
        check_sql_url(name, url)

    @classmethod
    def check_options(cls, url: str, options: Mapping[str, Any], key_prefix: str) -> None:
        if not options:
            return
        check_option_names(options)
        raise LeaseConfigError(
            "lease_store_options applies to Redis lease stores only; for PostgreSQL put "
            "connection options in lease_store_url's query (?sslmode=verify-full&"
            f"sslrootcert=/path/ca.crt), got {sorted(options)}"
        )

    def __init__(self, url: str, **options: Any) -> None:
        self.db = database(url)
        self.url = self.db.url
        self.server_clock = not self.db.is_sqlite
        on_first_use(self.db)

    # -- claim -----------------------------------------------------------

    def claim_then(
        self,
        key: str | builtins.list[str],
        then: tuple[str, dict[str, Any]],
        *,
        ttl: float,
        owner_id: str,
        meta: dict[str, str | None] | None = None,
    ) -> tuple[Lease | None, Rows | None]:
        """:meth:`claim`, then one statement of the caller's (``:key`` bound to
        ``Lease.key``) in the claim's transaction; its rows, or None when
        nothing was granted.

        The statement runs after the claim returned, so it reads a snapshot
        taken after any wait for the claim's row locks (a commit that released
        the key is visible to it). Used for SQLite and several keys; one key on
        PostgreSQL has its one-call form (``ResultTable.claim_prepared``).
        """
        primary, keys = normalize_keys(key)
        ttl, checked = check_ttl(ttl), check_meta(meta)
        sql, params = then
        params = {**params, "key": primary}
        claim: dict[str, Any] = {f: checked.get(f) for f in META_FIELDS}
        claim.update(owner_id=owner_id, ttl=ttl)
        return self._claim_in_transaction(primary, keys, claim, checked, then=(sql, params))

    def do_claim(
        self,
        primary: str,
        keys: tuple[str, ...],
        owner_id: str,
        ttl: float,
        meta: dict[str, str],
    ) -> Lease | None:
        db = self.db
        if len(keys) == 1 and not db.is_sqlite:
            # The common case, kept thin: one statement, a plain tuple row.
            row = db.pg_first(q.PG_CLAIM_ONE_PY, claim_params(keys[0], owner_id, ttl, meta))
            if row is None:
                return None
            token, expires_at, acquired_at = row
            return make_lease(
                primary,
                keys,
                owner_id,
                int(token),
                float(expires_at),
                float(acquired_at),
                ttl,
                meta,
            )
        params: dict[str, Any] = {f: meta.get(f) for f in META_FIELDS}
        params.update(owner_id=owner_id, ttl=ttl)
        return self._claim_in_transaction(primary, keys, params, meta)[0]

    def _claim_in_transaction(
        self,
        primary: str,
        keys: tuple[str, ...],
        params: dict[str, Any],
        meta: dict[str, str],
        then: tuple[str, dict[str, Any]] | None = None,
    ) -> tuple[Lease | None, Rows | None]:
        for attempt in range(_RETRIES):
            try:
                with self.db.transaction() as conn:
                    lease = self._claim_txn(conn, primary, keys, params, meta)
                    if lease is None or then is None:
                        return lease, None
                    return lease, conn.execute(*then)
            except StoreUnavailable:
                if attempt == _RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _claim_txn(
        self,
        conn: Conn,
        primary: str,
        keys: tuple[str, ...],
        params: dict[str, Any],
        meta: dict[str, str],
    ) -> Lease | None:
        sql = self.db.sql
        binds = key_params(keys)
        if self.db.is_sqlite:
            fences = conn.execute(sql.select_fences_in(len(keys)), binds).all()
        else:
            conn.execute(q.PG_ENSURE_FENCES, {"keys": list(keys)})
            fences = conn.execute(q.PG_LOCK_FENCES, {"keys": list(keys)}).all()
        now = conn.now()
        rows = conn.execute(sql.select_leases_in(len(keys)), binds).all()
        owner_id = params["owner_id"]
        for row in rows:
            if row.owner_id is not None and row.expires_at > now and row.owner_id != owner_id:
                conn.rollback()
                return None
        token = 1 + max([0] + [int(r.fencing_token) for r in rows] + [int(f[1]) for f in fences])
        granted = 0
        for key in keys:
            granted += len(
                conn.execute(
                    q.UPSERT_LEASE, {**params, "key": key, "token": token, "now": now}
                ).all()
            )
        if granted != len(keys):
            conn.rollback()
            return None
        for key in keys:
            conn.execute(q.RAISE_FENCE, {"key": key, "token": token, "now": now})
        ttl = float(params["ttl"])
        return Lease(primary, keys, owner_id, token, now + ttl, now, ttl, meta)

    # -- renew / release ---------------------------------------------------

    def do_renew_many(
        self, leases: builtins.list[Lease], ttls: builtins.list[float]
    ) -> builtins.list[float | None]:
        renewed: dict[tuple[str, str, int], float] = {}
        if self.db.is_sqlite:
            with self.db.transaction() as conn:
                now = self._now(conn)
                for lease, ttl in zip(leases, ttls):
                    params: dict[str, Any] = key_params(lease.keys)
                    params.update(
                        owner_id=lease.owner_id,
                        token=lease.token,
                        ttl=ttl,
                        now=now,
                        n=len(lease.keys),
                    )
                    for row in conn.execute(self.db.sql.renew_lease(len(lease.keys)), params):
                        renewed[(row.lease_key, lease.owner_id, lease.token)] = float(
                            row.expires_at
                        )
        else:
            cols: dict[str, builtins.list[Any]] = {
                "leases": [],
                "keys": [],
                "owners": [],
                "tokens": [],
                "ttls": [],
            }
            for i, (lease, ttl) in enumerate(zip(leases, ttls)):
                for key in lease.keys:
                    cols["leases"].append(i)
                    cols["keys"].append(key)
                    cols["owners"].append(lease.owner_id)
                    cols["tokens"].append(lease.token)
                    cols["ttls"].append(ttl)
            with self.db.single() as conn:
                for row in conn.execute(q.PG_RENEW_MANY, cols):
                    renewed[(row.lease_key, row.owner_id, int(row.fencing_token))] = float(
                        row.expires_at
                    )
        out: builtins.list[float | None] = []
        for lease in leases:
            expiries = [renewed.get((k, lease.owner_id, lease.token)) for k in lease.keys]
            out.append(None if any(e is None for e in expiries) else min(expiries))  # type: ignore[type-var]
        return out

    def do_release(self, lease: Lease) -> bool:
        keys = lease.keys
        if len(keys) == 1 and not self.db.is_sqlite:
            # The common case, kept thin: one key, one statement, its row count.
            one = {"key": keys[0], "owner_id": lease.owner_id, "token": lease.token}
            return self.db.pg_count(PG_RELEASE_ONE_PY, one) == 1
        params: dict[str, Any] = key_params(lease.keys)
        params.update(owner_id=lease.owner_id, token=lease.token)
        stmt = self.db.sql.release_in(len(lease.keys))
        with self.db.single() as conn:
            released = len(conn.execute(stmt, params).all())
        return released == len(lease.keys)

    # -- reading -----------------------------------------------------------

    def do_inspect(self, key: str) -> LeaseRecord | None:
        with self.db.read() as conn:
            row = conn.execute(self.db.sql.inspect, {"key": key}).one()
        if row.lease_key is None:
            if row.fence is None:
                return None
            return LeaseRecord(key, None, int(row.fence), 0.0, None, None, None, float(row.now))
        return _record(row, fence=row.fence)

    def do_list(self, prefix: str, expired: bool) -> builtins.list[LeaseRecord]:
        pattern = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        with self.db.single() as conn:
            rows = conn.execute(
                self.db.sql.list_leases, {"pattern": pattern, "expired": expired}
            ).all()
        # SQLite's LIKE ignores ASCII case: keep only the literal prefix matches.
        return [_record(r) for r in rows if r.lease_key.startswith(prefix)]

    def do_evict(self, key: str, token: int | None = None) -> LeaseRecord | None:
        before = self.do_inspect(key)
        with self.db.transaction() as conn:
            if not self.db.is_sqlite:
                # The fence row lock orders this against claims of the key.
                conn.execute(q.PG_ENSURE_FENCES, {"keys": [key]})
                conn.execute(q.PG_LOCK_FENCES, {"keys": [key]})
            now = self._now(conn)
            fence = int(conn.execute(q.FENCE_TOKEN, {"key": key}).scalar_one())
            if token is None:
                conn.execute(q.EVICT, {"key": key, "now": now})
            elif not conn.execute(q.EVICT_TOKEN, {"key": key, "token": token, "now": now}).rowcount:
                conn.rollback()  # not that token's lease (any more): nothing changes
                return None
            conn.execute(q.RAISE_FENCE, {"key": key, "token": fence + 1, "now": now})
        return before if before is not None and before.live else None

    def do_fence_token(self, key: str) -> int:
        with self.db.single() as conn:
            return int(conn.execute(q.FENCE_TOKEN, {"key": key}).scalar_one())

    def do_time(self) -> float:
        return self.db.now()

    def _now(self, conn: Conn) -> float:
        return conn.now()

    def close(self) -> None:
        self.db.dispose()


def _record(row: Any, fence: Any = None) -> LeaseRecord:
    token = int(row.fencing_token)
    if fence is not None:
        token = max(token, int(fence))
    released = row.renewed_at is not None and row.renewed_at == row.expires_at
    return LeaseRecord(
        key=row.lease_key,
        owner_id=None if released else row.owner_id,
        token=token,
        expires_at=float(row.expires_at),
        acquired_at=_f(row.acquired_at),
        renewed_at=_f(row.renewed_at),
        ttl=_f(row.ttl),
        now=float(row.now),
        task_id=row.task_id,
        task_name=row.task_name,
        root_id=row.root_id,
        tenant=row.tenant,
    )


def _f(v: Any) -> float | None:
    return None if v is None else float(v)
