"""The lease store protocol.

A *lease* is time-limited ownership of one or more stable keys. Every grant
carries a *fencing token*: an integer that, per key, only grows. The contract
every store keeps (and that ``tests/contract/store_contract/`` proves against
real servers):

1. **Tokens only grow.** A grant's token is larger than every token issued
   before for any of its keys, across release, expiry, sweeps and restarts of
   a durable store. (The Redis store also survives losing its data: tokens are
   floored by the server clock in microseconds.)
2. **One owner at a time.** No two grants of a key are valid at the same store
   time. Expiry is decided by the store's clock (Redis ``TIME``, the
   database's ``clock_timestamp()``), never by a worker's.
3. **Only the owner renews or releases.** Renewal and release check owner id
   *and* token; a stranger, or an old owner whose lease expired and was
   granted again, changes nothing.
4. **All or nothing.** A claim on several keys grants all of them under one
   token or none, without waiting while holding, so claims cannot deadlock.

A failure timeline these rules exist for::

    00:00  A claims payment-security-42        -> token 7, expires 00:30
    00:25  A pauses (GC, SIGSTOP, a slow LLM call that blocks the renewer)
    00:30  the lease expires in store time
    00:31  B claims payment-security-42        -> token 8
    00:40  B commits with token 8              -> accepted
    00:45  A resumes: renew(token 7) is False; its commit with token 7 is
           refused by the fenced result table (StaleFencingToken)

Stores translate their driver's errors into :class:`StoreUnavailable`
(transient) at this boundary; nothing above it catches driver exceptions.
"""

from __future__ import annotations

import builtins
import math
import os
import secrets
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from celery_lease.exceptions import LeaseConfigError, LeaseError, LeaseNotAcquired
from celery_lease.keys import has_unstorable, shorten
from celery_lease.renewal import HeldLease, check_schedule, renewer
from celery_lease.stores.registry import resolve
from celery_lease.urls import redact_url

if TYPE_CHECKING:
    from celery_lease.config import Config

__all__ = [
    "MAX_TTL",
    "META_FIELDS",
    "Lease",
    "LeaseRecord",
    "LeaseStore",
    "new_owner_id",
    "redact_url",  # re-exported: its home is celery_lease.urls
]

#: The longest lease, in seconds: one year (365 days). Every store keeps it
#: exactly: Redis holds expiry in microseconds as a Lua number, exact (and
#: written as digits, not in exponent form) below 2**53 µs, that is for a TTL
#: up to about 228 years from today; PEXPIRE takes it in milliseconds; SQL holds
#: epoch seconds as double precision (microseconds exact below 2**53 µs too);
#: etcd takes whole seconds up to 9e9. A year is far inside all of them, and far
#: longer than a lease that is renewed every TTL / 3 needs to be.
MAX_TTL = 365 * 24 * 3600.0

#: Audit fields a claim may carry; stores keep them with the lease record.
META_FIELDS = ("task_id", "task_name", "root_id", "tenant")
_META_FIELDS = frozenset(META_FIELDS)


def new_owner_id() -> str:
    """``hostname:pid:random``: readable in logs, unguessable by anyone else."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(8)}"


@dataclass(frozen=True)
class Lease:
    """One grant, as the store made it. Immutable: renewals return new facts.

    ``key`` is the first key the caller named, ``keys`` all of them, sorted.
    ``expires_at`` and ``acquired_at`` are epoch seconds in *store* time.
    """

    key: str
    keys: tuple[str, ...]
    owner_id: str
    token: int
    expires_at: float
    acquired_at: float
    ttl: float
    meta: Mapping[str, str] = field(default_factory=dict, compare=False)


_new_object = object.__new__


def make_lease(
    key: str,
    keys: tuple[str, ...],
    owner_id: str,
    token: int,
    expires_at: float,
    acquired_at: float,
    ttl: float,
    meta: Mapping[str, str],
) -> Lease:
    """``Lease(key, keys, ...)`` for the stores' hot paths: the same object (same
    fields, same ``__dict__``), without the frozen dataclass's ``__init__``, which
    sets each field through ``object.__setattr__`` (a few µs per claim)."""
    lease: Lease = _new_object(Lease)
    fields = lease.__dict__
    fields["key"] = key
    fields["keys"] = keys
    fields["owner_id"] = owner_id
    fields["token"] = token
    fields["expires_at"] = expires_at
    fields["acquired_at"] = acquired_at
    fields["ttl"] = ttl
    fields["meta"] = meta
    return lease


@dataclass(frozen=True)
class LeaseRecord:
    """What a store holds for a key, for inspection, the CLI and monitoring.

    ``owner_id`` is None when the key is free (released or never claimed but
    fenced); ``live`` says whether the lease was unexpired at ``now`` (store
    time, read in the same operation).
    """

    key: str
    owner_id: str | None
    token: int
    expires_at: float
    acquired_at: float | None
    renewed_at: float | None
    ttl: float | None
    now: float
    task_id: str | None = None
    task_name: str | None = None
    root_id: str | None = None
    tenant: str | None = None

    @property
    def live(self) -> bool:
        return self.owner_id is not None and self.expires_at > self.now

    @property
    def remaining(self) -> float:
        """Seconds of lease left in store time (0 when free or expired)."""
        return max(0.0, self.expires_at - self.now) if self.owner_id else 0.0


def normalize_keys(key: str | Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """Return ``(primary key, sorted unique keys)``; validates they are non-empty strings.

    Keys are mapped through :func:`celery_lease.keys.shorten`, so any ``str``
    works on every store: over 200 characters, NUL or a lone surrogate, a key
    is held as ``<prefix>~<sha256>`` (and ``Lease.key`` is that form).
    """
    try:
        keys = [key] if isinstance(key, str) else list(key)
    except TypeError:  # None, a number: not a key, not a list of keys
        raise LeaseConfigError(f"a lease key is a non-empty string, got {key!r}") from None
    if not keys:
        raise LeaseConfigError("a claim needs at least one key")
    for k in keys:
        if not isinstance(k, str) or not k:
            raise LeaseConfigError(f"lease keys must be non-empty strings, got {k!r}")
    keys = [shorten(k) for k in keys]
    return keys[0], tuple(sorted(set(keys)))


def check_ttl(ttl: float) -> float:
    # Finite too: an infinite TTL would be a lease that never expires (SQL) or a
    # driver OverflowError (Redis); every lease has a bounded TTL.
    kind = type(ttl)
    if (kind is float or kind is int) and 0 < ttl <= MAX_TTL:  # NaN compares False
        return float(ttl)
    if (
        not isinstance(ttl, (int, float))
        or isinstance(ttl, bool)
        or not ttl > 0
        or not math.isfinite(ttl)
    ):
        raise LeaseConfigError(f"ttl must be a positive number of seconds, got {ttl!r}")
    if not ttl <= MAX_TTL:
        raise LeaseConfigError(f"ttl must be at most {MAX_TTL:.0f} seconds (one year), got {ttl!r}")
    return float(ttl)


def check_meta(meta: Mapping[str, str | None] | None) -> dict[str, str]:
    if not meta:
        return {}
    unknown = set(meta) - _META_FIELDS
    if unknown:
        raise LeaseConfigError(f"unknown lease metadata {sorted(unknown)}; known: {META_FIELDS}")
    return {k: str(v) for k, v in meta.items() if v is not None}


class LeaseStore(ABC):
    """A place where leases live. Pick one with :meth:`from_url`.

    Subclasses implement the ``do_*`` methods; the public methods here validate
    arguments first, so every store rejects bad input the same way.
    """

    #: Whether the store's URL is a SQL database's, which can also hold the
    #: fenced result table (``lease_result_url`` defaults to it).
    is_sql: ClassVar[bool] = False
    #: Whether the constructor takes ``key_prefix`` (``lease_key_prefix``).
    takes_key_prefix: ClassVar[bool] = False
    #: True if :meth:`time` is a server's clock, not this machine's (etcd
    #: answers no time; an embedded SQLite file has the process's own).
    server_clock: bool = True

    url: str

    @classmethod
    def from_url(cls, url: str, **options: Any) -> LeaseStore:
        """The store for ``url``, chosen by scheme: Redis, SQL, etcd, then the
        ``celery_lease.stores`` entry points (:mod:`celery_lease.stores.registry`)."""
        store: LeaseStore = resolve(url, "from_url")(url, **options)  # type: ignore[call-arg]
        return store

    @classmethod
    def from_settings(cls, cfg: Config) -> LeaseStore:
        """The store of an app's ``lease_store_url``, ``lease_store_options`` and
        ``lease_key_prefix`` (already validated by :class:`~celery_lease.config.Config`)."""
        store_cls = resolve(cfg.store_url, "lease_store_url")
        options = store_cls.options_from_settings(cfg.store_options, cfg.key_prefix)
        store: LeaseStore = store_cls(cfg.store_url, **options)  # type: ignore[call-arg]
        return store

    # -- what the settings check and pass (class methods, no I/O) ---------

    @classmethod  # noqa: B027 - a store without a URL check accepts any
    def check_url(cls, name: str, url: str) -> None:
        """Refuse ``url`` if this store's client could not use it; errors name
        the setting ``name``. Called at worker start, before any connection."""

    @classmethod  # noqa: B027 - a store without an options check takes any
    def check_options(cls, url: str, options: Mapping[str, Any], key_prefix: str) -> None:
        """Refuse ``lease_store_options`` this store cannot take (at worker start)."""

    @classmethod
    def options_from_settings(cls, options: Mapping[str, Any], key_prefix: str) -> dict[str, Any]:
        """The constructor's keyword arguments from ``lease_store_options`` and
        ``lease_key_prefix`` (passed only to stores that take it)."""
        kwargs = dict(options)
        if cls.takes_key_prefix:
            kwargs.setdefault("key_prefix", key_prefix)
        return kwargs

    # -- public API -------------------------------------------------------

    def claim(
        self,
        key: str | Sequence[str],
        *,
        ttl: float,
        owner_id: str | None = None,
        meta: Mapping[str, str | None] | None = None,
    ) -> Lease | None:
        """Grant ``key`` (or every key of a list, all or none) to ``owner_id``.

        Returns the :class:`Lease`, or None while another live owner holds a key.
        """
        if type(key) is list and len(key) == 1 and type(key[0]) is str:
            key = key[0]  # a task's one scoped key: claimed as that key
        if type(key) is str and key:  # the common case, one key: what normalize_keys does
            primary = shorten(key)
            keys: tuple[str, ...] = (primary,)
        else:
            primary, keys = normalize_keys(key)
        return self.do_claim(
            primary, keys, owner_id or new_owner_id(), check_ttl(ttl), check_meta(meta)
        )

    def renew(self, lease: Lease, ttl: float | None = None) -> bool:
        """Extend ``lease`` to ``ttl`` (default: its own) from now in store time.

        True while still the owner; False once lost. Never extends someone else's lease.
        """
        return self.renew_many([lease], ttl=ttl)[0] is not None

    def renew_many(self, leases: Sequence[Lease], ttl: float | None = None) -> list[float | None]:
        """Renew several leases in as few round trips as the store allows.

        Returns, per lease, its new ``expires_at`` (store time) or None if it was lost.
        """
        if not leases:
            return []
        ttls = [check_ttl(ttl) if ttl is not None else lease.ttl for lease in leases]
        return self.do_renew_many(list(leases), ttls)

    def release(self, lease: Lease) -> bool:
        """Give ``lease`` up. True if it was still the owner; a stranger's release is a no-op."""
        return self.do_release(lease)

    def release_later(self, lease: Lease, failed: Callable[[LeaseError], None]) -> None:
        """:meth:`release`, not waiting for the answer where the store can (the key is
        freed as promptly); ``failed`` is called, now or later, if it failed."""
        try:
            self.release(lease)
        except LeaseError as e:
            failed(e)

    def inspect(self, key: str) -> LeaseRecord | None:
        """The record for ``key`` (live, expired-but-kept, or fenced-but-free), or None."""
        key = normalize_keys(key)[0]
        return self.do_inspect(key)

    def list(self, prefix: str = "", *, expired: bool = False) -> list[LeaseRecord]:
        """Live leases whose key starts with ``prefix`` (also expired ones if ``expired``).

        The prefix matches literally (no glob or LIKE wildcards, case-sensitive).
        """
        if not isinstance(prefix, str):
            raise LeaseConfigError(f"a key prefix is a string, got {prefix!r}")
        if has_unstorable(prefix):
            return []  # NUL or a lone surrogate: no stored key contains one
        records = self.do_list(prefix, expired)
        # Live by the store's clock, not by presence: Redis deletes a hash ~1 ms after it expires.
        return records if expired else [r for r in records if r.live]

    def evict(self, key: str, token: int | None = None) -> LeaseRecord | None:
        """Force-release ``key`` whoever holds it and advance its fence.

        The evicted owner's renewals, releases and commits fail from then on;
        the next claim gets a larger token. Returns the evicted record, if any.

        With ``token`` (a token read from :meth:`inspect`), only the lease
        granted with that token is evicted, atomically with the check: if the
        key was released, or granted again since, nothing changes and the
        answer is None. An evict decided on an earlier read can then never hit
        an owner that claimed after that read.
        """
        key = normalize_keys(key)[0]
        if token is None:
            return self.do_evict(key)
        if isinstance(token, bool) or not isinstance(token, int) or token <= 0:
            raise LeaseConfigError(f"a fencing token is a positive integer, got {token!r}")
        return self.do_evict(key, token)

    def fence_token(self, key: str) -> int:
        """The newest token ever issued for ``key`` (0 if none)."""
        return self.do_fence_token(normalize_keys(key)[0])

    @contextmanager
    def hold(
        self,
        key: str | Sequence[str],
        *,
        ttl: float,
        owner_id: str | None = None,
        renew_interval: float | None = None,
        clock_drift: float | None = None,
        meta: Mapping[str, str | None] | None = None,
    ) -> Iterator[HeldLease]:
        """Claim, renew from a timer thread, release on exit.

        Raises :class:`LeaseNotAcquired` if another live owner holds the key.
        Inside the block, ``lease.held`` turns False and ``lease.ensure()``
        raises :class:`LeaseLost` once ownership is gone. A release that fails
        after the block raised is logged; after a block that ended, it raises.
        """
        # Before the claim: a lease whose renewals cannot keep it is never made.
        check_schedule(check_ttl(ttl), renew_interval, clock_drift)
        sent = time.monotonic()
        lease = self.claim(key, ttl=ttl, owner_id=owner_id, meta=meta)
        if lease is None:
            primary = key if isinstance(key, str) else next(iter(key))
            record = self.inspect(primary)
            raise LeaseNotAcquired(
                primary,
                record.owner_id if record else None,
                record.remaining if record else None,
            )
        try:
            held = HeldLease(
                self, lease, renew_interval=renew_interval, clock_drift=clock_drift, sent_at=sent
            )
        except LeaseConfigError:
            # A bad renew_interval / clock_drift: give the key back, never leave it blocked.
            self.release(lease)
            raise
        renewer().add(held)
        try:
            yield held
        except BaseException:
            held.release_after_error()
            raise
        held.release()

    # -- internal markers ---------------------------------------------------

    def mark(self, name: str, owner_id: str, *, ttl: float, replace: Sequence[str] = ()) -> bool:
        """Set the internal marker ``name`` to ``owner_id`` for ``ttl`` seconds unless
        another owner's live marker is there (then False); a live marker of an owner
        in ``replace`` is replaced atomically with the check (of two such callers, one wins).

        Markers (deferral markers, ``celery-lease/...``, a namespace no user key reaches)
        are not leases: no token, and no fence where a store keeps them apart; this
        default keeps them as leases, whose records ``lease sweep`` removes (SQL)."""
        if self.claim(name, ttl=ttl, owner_id=owner_id) is not None:
            return True
        record = self.inspect(name) if replace else None
        if record is None or not record.live or record.owner_id not in replace:
            return False
        # Evict exactly the grant read (its token): a second caller replacing
        # the same owner finds it evicted already, or granted again, and loses.
        if self.evict(name, token=record.token) is None:
            return False
        return self.claim(name, ttl=ttl, owner_id=owner_id) is not None

    def marker(self, name: str) -> str | None:
        """The owner of the live marker ``name``, or None."""
        record = self.inspect(name)
        return record.owner_id if record is not None and record.live else None

    def time(self) -> float:
        """The store's clock, epoch seconds."""
        return self.do_time()

    def close(self) -> None:  # noqa: B027 - optional for stores without connections
        """Drop connections. The store can be used again afterwards."""

    # -- what a store implements ----------------------------------------

    @abstractmethod
    def do_claim(
        self,
        primary: str,
        keys: tuple[str, ...],
        owner_id: str,
        ttl: float,
        meta: dict[str, str],
    ) -> Lease | None: ...

    @abstractmethod
    def do_renew_many(
        self, leases: builtins.list[Lease], ttls: builtins.list[float]
    ) -> builtins.list[float | None]: ...

    @abstractmethod
    def do_release(self, lease: Lease) -> bool: ...

    @abstractmethod
    def do_inspect(self, key: str) -> LeaseRecord | None: ...

    @abstractmethod
    def do_list(self, prefix: str, expired: bool) -> builtins.list[LeaseRecord]: ...

    @abstractmethod
    def do_evict(self, key: str, token: int | None = None) -> LeaseRecord | None:
        """Evict ``key``; with ``token``, only the unreleased lease of that token."""

    @abstractmethod
    def do_fence_token(self, key: str) -> int: ...

    @abstractmethod
    def do_time(self) -> float: ...

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {redact_url(self.url)}>"


def refuse_key_prefix_option(options: Mapping[str, Any]) -> None:
    """The key prefix is a setting of its own, for every store that takes one."""
    if "key_prefix" in options:
        raise LeaseConfigError("set lease_key_prefix, not lease_store_options['key_prefix']")


def check_option_names(options: Mapping[str, Any]) -> None:
    bad = [k for k in options if not isinstance(k, str)]
    if bad:
        raise LeaseConfigError(f"lease_store_options keys must be strings, got {bad!r}")
