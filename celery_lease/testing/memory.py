"""An in-memory lease store with a clock a test controls: ``memory://name``.

**For users' unit tests of their own logic, never evidence for an
invariant.** It keeps the store contract (``tests/contract/store_contract/``
runs it with the real stores) inside one process, under one lock; it proves
nothing about a server, a network, a restart or several processes. Leases in
it are invisible to other processes: use it with an in-process worker
(``celery.contrib.testing.worker.start_worker``, pytest-celery's
``celery_session_worker``), ``task.apply()`` or a direct call, never with a
``celery worker`` subprocess.

The URL names a *space*: every handle on ``memory://name`` in this process
shares its leases and its clock (the worker's and the test's, say);
``memory://`` is one default space. :meth:`MemoryLeaseStore.drop` forgets
a space.

The clock. By default store time follows this machine's clock
(``time.time()``) plus an offset: :meth:`MemoryLeaseStore.advance` adds to
the offset, so leases expire when real time passes (renewals, and the
contract suite's waits, work as on a real store) and at once when a test
advances past them. With ``memory://name?clock=manual`` (or
``clock="manual"``) store time starts at the creation's ``time.time()`` and
moves only when advanced: a lease never lapses unless the test says so (a
renewing worker still renews it, in that frozen time). Store time never goes
backwards either way.

Tokens are floored by the wall clock in microseconds, as on Redis, so a
fresh space never issues a token below one that a persistent result
database already holds from an earlier run.
"""

from __future__ import annotations

import builtins
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

from celery_lease.exceptions import LeaseConfigError, LeaseNotAcquired
from celery_lease.stores.base import Lease, LeaseRecord, LeaseStore, make_lease, normalize_keys

__all__ = ["CLOCKS", "MemoryLeaseStore"]

#: ``real``: store time is ``time.time()`` + the advanced offset; ``manual``:
#: store time moves only by :meth:`MemoryLeaseStore.advance`.
CLOCKS = ("real", "manual")

#: The owner id :meth:`MemoryLeaseStore.take_over` claims with by default.
TAKE_OVER_OWNER = "celery_lease.testing:take-over"


@dataclass
class _Row:
    owner_id: str
    token: int
    expires_at: float
    acquired_at: float
    renewed_at: float | None
    ttl: float
    meta: dict[str, str]
    #: Released (the row and its token stay; the key is free).
    released: bool = False
    #: Evicted: no owner any more (the fence moved past ``token``).
    evicted: bool = False

    def live(self, now: float) -> bool:
        return not self.released and not self.evicted and self.expires_at > now

    def granted(self, lease: Lease, now: float) -> bool:
        return self.owner_id == lease.owner_id and self.token == lease.token and self.live(now)


@dataclass
class _Space:
    """One ``memory://name``: its leases, its clock, its lock."""

    clock: str
    lock: threading.RLock = field(default_factory=threading.RLock)
    rows: dict[str, _Row] = field(default_factory=dict)
    fences: dict[str, int] = field(default_factory=dict)
    last_token: int = 0
    offset: float = 0.0
    frozen_at: float = field(default_factory=time.time)
    last_now: float = 0.0

    def now(self) -> float:
        base = self.frozen_at if self.clock == "manual" else time.time()
        # Never backwards, whatever the system clock does (an NTP step).
        self.last_now = max(self.last_now, base + self.offset)
        return self.last_now

    def fence(self, key: str) -> int:
        row = self.rows.get(key)
        return max(self.fences.get(key, 0), row.token if row else 0)

    def next_token(self, keys: tuple[str, ...]) -> int:
        floor = max(self.fence(k) for k in keys)
        self.last_token = max(self.last_token + 1, floor + 1, int(time.time() * 1e6))
        return self.last_token


_spaces: dict[str, _Space] = {}
_spaces_lock = threading.Lock()


class MemoryLeaseStore(LeaseStore):
    """Leases in this process's memory, for unit tests (see the module's doc).

    ``MemoryLeaseStore("memory://name")`` or ``LeaseStore.from_url(...)``;
    handles on one name share one space. Beyond the store protocol:
    :meth:`advance` (move store time), :meth:`expire` (end a lease now, in
    store time), :meth:`take_over` (expire and claim as another owner),
    :meth:`drop` (forget a space). Thread-safe: one lock per space.
    """

    schemes: ClassVar[tuple[str, ...]] = ("memory",)
    #: Store time is this process's clock (plus the offset), not a server's.
    server_clock = False

    def __init__(self, url: str = "memory://", *, clock: str | None = None, **options: Any) -> None:
        unknown = set(options) - {"key_prefix"}
        if unknown:
            raise LeaseConfigError(
                f"unknown options for a memory:// lease store: {sorted(unknown)} "
                "(it takes clock='real' or 'manual')"
            )
        parts = urlsplit(url)
        if parts.scheme != "memory":
            raise LeaseConfigError(f"a memory lease store URL is memory://[name], got {url!r}")
        query = parse_qs(parts.query)
        if clock is None:
            clock = query.get("clock", ["real"])[-1]
        if clock not in CLOCKS:
            raise LeaseConfigError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
        self.name = parts.netloc + parts.path
        self.url = url
        with _spaces_lock:
            space = _spaces.get(self.name)
            if space is None:
                space = _spaces[self.name] = _Space(clock)
            elif space.clock != clock:
                raise LeaseConfigError(
                    f"memory://{self.name} already exists with clock={space.clock!r}, not {clock!r}"
                )
        self._space = space

    # -- what tests add ----------------------------------------------------

    @property
    def clock(self) -> str:
        """``"real"`` or ``"manual"`` (see the module's doc)."""
        return self._space.clock

    def advance(self, seconds: float) -> float:
        """Move store time forward by ``seconds``; returns the new store time.

        Every lease of the space whose expiry is passed is expired from then
        on: its owner's renewals and releases fail, the next claim is granted
        with a larger token.
        """
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
            raise LeaseConfigError(f"advance() takes seconds >= 0, got {seconds!r}")
        space = self._space
        with space.lock:
            space.offset += float(seconds)
            return space.now()

    def expire(self, lease_or_key: Any) -> int:
        """End the live lease on each key of ``lease_or_key`` now, in store time,
        as if its TTL had run out (nothing else moves). Returns how many keys
        had a live lease.

        ``lease_or_key``: a key, a list of keys, or anything with ``keys`` or
        ``key`` (a :class:`Lease`, a ``HeldLease``, a :class:`LeaseRecord`).
        """
        keys = _keys_of(lease_or_key)
        space = self._space
        ended = 0
        with space.lock:
            now = space.now()
            for key in keys:
                row = space.rows.get(key)
                if row is not None and row.live(now):
                    row.expires_at = now
                    ended += 1
        return ended

    def take_over(
        self, lease_or_key: Any, *, owner_id: str = TAKE_OVER_OWNER, ttl: float = 3600.0
    ) -> Lease:
        """:meth:`expire` the lease on ``lease_or_key``'s keys, then claim them
        as ``owner_id``: the old owner's renewals, releases and commits are
        refused from then on (its commit ends ``FENCED``). Returns the new lease."""
        keys = list(_keys_of(lease_or_key))
        with self._space.lock:
            self.expire(keys)
            lease = self.claim(keys, ttl=ttl, owner_id=owner_id)
        if lease is None:  # never: the keys were just expired under the lock
            raise LeaseNotAcquired(keys[0], None, None)
        return lease

    def drop(self) -> None:
        """Forget this space (its leases, tokens and clock); handles made later start afresh."""
        with _spaces_lock:
            if _spaces.get(self.name) is self._space:
                del _spaces[self.name]

    # -- the store protocol --------------------------------------------------

    def do_claim(
        self,
        primary: str,
        keys: tuple[str, ...],
        owner_id: str,
        ttl: float,
        meta: dict[str, str],
    ) -> Lease | None:
        space = self._space
        with space.lock:
            now = space.now()
            rows = space.rows
            for key in keys:
                row = rows.get(key)
                if row is not None and row.live(now):
                    return None
            token = space.next_token(keys)
            expires = now + ttl
            for key in keys:
                rows[key] = _Row(owner_id, token, expires, now, None, ttl, dict(meta))
        return make_lease(primary, keys, owner_id, token, expires, now, ttl, dict(meta))

    def do_renew_many(
        self, leases: builtins.list[Lease], ttls: builtins.list[float]
    ) -> builtins.list[float | None]:
        space = self._space
        answers: builtins.list[float | None] = []
        with space.lock:
            now = space.now()
            for lease, ttl in zip(leases, ttls):
                rows = [space.rows.get(k) for k in lease.keys]
                if not all(r is not None and r.granted(lease, now) for r in rows):
                    answers.append(None)  # one key lost: the lease renews as a unit
                    continue
                for r in rows:
                    assert r is not None
                    r.expires_at, r.renewed_at, r.ttl = now + ttl, now, ttl
                answers.append(now + ttl)
        return answers

    def do_release(self, lease: Lease) -> bool:
        space = self._space
        with space.lock:
            now = space.now()
            rows = [space.rows.get(k) for k in lease.keys]
            for r in rows:
                if r is None or r.owner_id != lease.owner_id or r.token != lease.token:
                    return False
                if r.evicted or not (r.released or r.expires_at > now):
                    return False
            # Releasing again answers yes, as the other stores do: a retry after
            # a lost reply must not read as a lost lease.
            for r in rows:
                assert r is not None
                if not r.released:
                    r.released, r.expires_at, r.renewed_at = True, now, now
        return True

    def do_inspect(self, key: str) -> LeaseRecord | None:
        space = self._space
        with space.lock:
            now = space.now()
            row = space.rows.get(key)
            if row is None:
                fence = space.fences.get(key)
                if fence is None:
                    return None
                return LeaseRecord(key, None, fence, 0.0, None, None, None, now)
            return _record(key, row, space.fence(key), now)

    def do_list(self, prefix: str, expired: bool) -> builtins.list[LeaseRecord]:
        space = self._space
        with space.lock:
            now = space.now()
            return [
                _record(key, row, space.fence(key), now)
                for key, row in sorted(space.rows.items())
                if key.startswith(prefix)
                and not row.released
                and not row.evicted
                and (expired or row.live(now))
            ]

    def do_evict(self, key: str, token: int | None = None) -> LeaseRecord | None:
        space = self._space
        with space.lock:
            now = space.now()
            row = space.rows.get(key)
            before = None if row is None else _record(key, row, space.fence(key), now)
            if token is not None and (
                row is None or row.token != token or row.released or row.evicted
            ):
                return None  # not that token's lease (any more): nothing changes
            if row is not None and not row.released:
                row.evicted, row.expires_at, row.renewed_at = True, now, now
            space.fences[key] = space.fence(key) + 1
        return before if before is not None and before.live else None

    def do_fence_token(self, key: str) -> int:
        with self._space.lock:
            return self._space.fence(key)

    def do_time(self) -> float:
        with self._space.lock:
            return self._space.now()


def _record(key: str, row: _Row, fence: int, now: float) -> LeaseRecord:
    free = row.released or row.evicted
    meta = row.meta
    return LeaseRecord(
        key=key,
        owner_id=None if free else row.owner_id,
        token=fence,
        expires_at=row.expires_at,
        acquired_at=row.acquired_at,
        renewed_at=row.renewed_at,
        ttl=row.ttl,
        now=now,
        task_id=meta.get("task_id"),
        task_name=meta.get("task_name"),
        root_id=meta.get("root_id"),
        tenant=meta.get("tenant"),
    )


def _keys_of(lease_or_key: Any) -> tuple[str, ...]:
    """The store keys named by a key, a list of keys, or a lease / record."""
    keys = getattr(lease_or_key, "keys", None)
    if isinstance(keys, tuple):
        return keys
    key = getattr(lease_or_key, "key", None)
    if isinstance(key, str):
        return (key,)
    return normalize_keys(lease_or_key)[1]
