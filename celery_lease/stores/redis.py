"""The Redis lease store: one Lua script per operation, store time from ``TIME``.

Layout, per key (hash-tagged so a key's lease and counter share a Cluster slot)::

    {prefix}:lease:{<key>}   hash: owner, token, ttl (ms), expires, acquired,
                             renewed (µs, Redis clock), task_id, task_name,
                             root_id, tenant; PEXPIRE = ttl
    {prefix}:fence:{<key>}   string: the newest token issued; never expires
    {prefix}:mark:<name>     string: an internal marker's owner; PEXPIRE = ttl
                             (no fence: markers are not leases)

A key starting with ``}`` would give an empty hash tag (Redis Cluster then
hashes the whole name, and a key's lease and fence land in different slots):
its names are ``...:{\0}<key>}`` instead, tagged ``\0``. No store key
contains NUL (:func:`celery_lease.keys.shorten`), so no other key's names
look like that.

Tokens only grow, even if Redis loses its data. A grant's token is
``max(counter + 1, TIME in µs)``: the counter covers many grants within one
microsecond or a server clock stepped back, the clock floor covers a restart
without persistence (or the last second of an ``appendfsync everysec`` AOF),
where the counter comes back older or not at all. So tokens from this store
look like microsecond timestamps. The floor assumes the Redis server's clock
does not step back across a data loss; run Redis with ``appendfsync always``
where that is not acceptable.

Every script (:mod:`celery_lease.stores.redis_scripts`) is owner-checked and
atomic; each is one round trip (EVALSHA, or EVAL when the server lost its
script cache), sent by :mod:`celery_lease.stores.redis_transport` on
connections it keeps checked out of the redis-py client's pool, not through
``Script``/``execute_command``, whose per-command machinery costs more than
the round trip; ``list`` and the plain commands use the client as usual.

The same store serves Redis Sentinel (:mod:`celery_lease.stores.redis_sentinel`:
another client from :meth:`RedisLeaseStore.make_client`) and Redis Cluster
(:mod:`celery_lease.stores.redis_cluster`: another transport). Any of them
takes the opt-in replication wait (:mod:`celery_lease.stores.redis_wait`):
``WAIT`` in the same round trip as each claim and renewal.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_lease.exceptions import LeaseConfigError, LeaseError, StoreUnavailable
from celery_lease.stores.base import (
    META_FIELDS,
    Lease,
    LeaseRecord,
    LeaseStore,
    check_option_names,
    redact_url,
    refuse_key_prefix_option,
)
from celery_lease.stores.redis_scripts import CLAIM, EVICT, INSPECT, RELEASE, RENEW
from celery_lease.stores.redis_transport import ScriptTransport, server_reply
from celery_lease.stores.redis_wait import WaitPolicy, wait_policy
from celery_lease.urls import check_redis_url

__all__ = [
    "CLAIM",
    "EVICT",
    "INSPECT",
    "RELEASE",
    "RENEW",
    "RedisLeaseStore",
    "check_cert_files",
    "client_defaults",
    "server_reply",
]

#: Bytes redis-py asks the socket for per read (its ``socket_read_size``): a
#: bytes object of this size plus its 33-byte header stays within the 512 bytes
#: Python's small-object allocator serves (see :func:`client_defaults`).
SOCKET_READ_SIZE = 448


def client_defaults(options: dict[str, Any], *, read_size: bool = True) -> None:
    """The client options every Redis store sets unless the user did: single
    server, Sentinel master and each Cluster node alike (``read_size=False``
    where the client has no ``socket_read_size``)."""
    # A store call that hangs holds a task's pool slot: fail it as unavailable.
    options.setdefault("socket_timeout", 5.0)
    options.setdefault("socket_connect_timeout", 5.0)
    # redis-py receives into a fresh bytes object of this size and shrinks it
    # to the reply: at its default (tens of kB) that is a large glibc
    # allocation per reply, cut down and kept, which fragments the heap of a
    # long-running worker so that its RSS grows with every task. The hot
    # path's replies are tens of bytes; a read this small comes from Python's
    # own small-object allocator (up to 512 bytes) and a large reply just
    # takes more reads.
    if read_size:
        options.setdefault("socket_read_size", SOCKET_READ_SIZE)


class RedisLeaseStore(LeaseStore):
    takes_key_prefix = True

    @classmethod
    def check_url(cls, name: str, url: str) -> None:
        check_redis_url(name, url)

    @classmethod
    def check_options(cls, url: str, options: Mapping[str, Any], key_prefix: str) -> None:
        """The client's keyword arguments: certificate files must exist, and the
        client is built (no I/O) so an unknown option fails at worker start."""
        if not options:
            return
        check_option_names(options)
        refuse_key_prefix_option(options)
        check_cert_files(options)
        cls(url, **cls.options_from_settings(options, key_prefix)).close()

    def __init__(self, url: str, key_prefix: str = "celery-lease", **options: Any) -> None:
        self.url = url
        self.prefix = key_prefix
        self.wait: WaitPolicy | None = wait_policy(options)
        client_defaults(options)
        try:
            self.client: redis.Redis = self.make_client(url, options)
            # redis-py connects lazily: build one connection object (no I/O) so an
            # unknown option or a bad ssl_cert_reqs fails here, not at the first claim.
            pool = self.client.connection_pool
            pool.connection_class(**pool.connection_kwargs)
        except (ValueError, TypeError, RedisError) as e:
            raise LeaseConfigError(
                f"bad Redis URL or client options for {redact_url(url)} "
                f"(lease_store_url / lease_store_options): {e}"
            ) from e
        self._claim = self.client.register_script(CLAIM)
        self._renew = self.client.register_script(RENEW)
        self._release = self.client.register_script(RELEASE)
        self._inspect = self.client.register_script(INSPECT)
        self._evict = self.client.register_script(EVICT)
        self.transport = ScriptTransport(self.client)
        # EVALSHA in one round trip (ScriptTransport.run); bound once, not
        # wrapped in a method, to keep a call level off every operation.
        self._run: Callable[[Script, builtins.list[str], builtins.list[Any]], Any] = (
            self.transport.run
        )

    def make_client(self, url: str, options: dict[str, Any]) -> redis.Redis:
        """The redis-py client for ``url`` (no I/O: redis-py connects on first use)."""
        return redis.Redis.from_url(url, **options)

    # -- key names ---------------------------------------------------------

    def lease_name(self, key: str) -> str:
        return f"{self.prefix}:lease:{{{_tag(key)}}}"

    def fence_name(self, key: str) -> str:
        return f"{self.prefix}:fence:{{{_tag(key)}}}"

    def mark(self, name: str, owner_id: str, *, ttl: float, replace: Sequence[str] = ()) -> bool:
        marker = f"{self.prefix}:mark:{name}"
        ms = _ms(ttl)
        with self.errors():
            if self.client.set(marker, owner_id, px=ms, nx=True):
                return True
            # Compare-and-set by WATCH: the SET is discarded if the marker
            # changed after the GET (another caller replaced it first).
            with self.client.pipeline() as pipe:
                try:
                    pipe.watch(marker)  # type: ignore[no-untyped-call]
                    current = pipe.get(marker)
                    if current is not None and _str(current) not in (owner_id, *replace):
                        return False
                    pipe.multi()
                    pipe.set(marker, owner_id, px=ms)
                    pipe.execute()
                except redis.WatchError:
                    return False
        return True

    def marker(self, name: str) -> str | None:
        with self.errors():
            value = self.client.get(f"{self.prefix}:mark:{name}")
        return _str(value) if value is not None else None

    # -- operations --------------------------------------------------------

    def do_claim(
        self,
        primary: str,
        keys: tuple[str, ...],
        owner_id: str,
        ttl: float,
        meta: dict[str, str],
    ) -> Lease | None:
        prefix = self.prefix
        if len(keys) == 1:
            tag = _tag(primary)
            names = [f"{prefix}:lease:{{{tag}}}", f"{prefix}:fence:{{{tag}}}"]
        else:
            tags = [_tag(k) for k in keys]
            names = [f"{prefix}:lease:{{{t}}}" for t in tags]
            names += [f"{prefix}:fence:{{{t}}}" for t in tags]
        ms = _ms(ttl)
        args: builtins.list[Any] = [owner_id, ms]
        if meta:
            args += [meta.get(f, "") for f in META_FIELDS]
        wait = self.wait
        try:
            if wait is None:
                reply = self._run(self._claim, names, args)
            else:
                reply, acked = self.transport.run_waited(
                    self._claim, names, args, wait.replicas, wait.timeout_ms
                )
        except RedisError as e:
            raise self._translate(e) from e
        if reply[0] != 1:
            return None
        now = int(reply[2])
        lease = Lease(
            primary, keys, owner_id, int(reply[1]), (now + ms * 1000) / 1e6, now / 1e6, ttl, meta
        )
        if wait is not None and acked < wait.replicas:
            self._unreplicated_grant(wait, lease, acked)
        return lease

    def _unreplicated_grant(self, wait: WaitPolicy, lease: Lease, acked: int) -> None:
        """A grant fewer replicas acknowledged than asked: warn, or give it back and
        raise (a failover now could hand the key to another owner)."""
        what = f"the grant of {lease.key!r} (token {lease.token})"
        if not wait.release:
            wait.warn(what, acked)
            return
        try:
            self.do_release(lease)
        except StoreUnavailable:
            pass  # then it lapses at its TTL; the claim is refused either way
        raise StoreUnavailable(
            f"Redis {redact_url(self.url)}: {wait.describe(what, acked)}; released"
        )

    def do_renew_many(
        self, leases: builtins.list[Lease], ttls: builtins.list[float]
    ) -> builtins.list[float | None]:
        names, args = self.renew_call(leases, ttls)
        wait = self.wait
        try:
            if wait is None:
                reply = self._run(self._renew, names, args)
            else:
                reply, acked = self.transport.run_waited(
                    self._renew, names, args, wait.replicas, wait.timeout_ms
                )
        except RedisError as e:
            raise self._translate(e) from e
        if wait is not None and acked < wait.replicas:
            self.unreplicated_renewal(wait, len(leases), acked)
        return [None if int(r) == 0 else _s(r) for r in reply]

    def renew_call(
        self, leases: builtins.list[Lease], ttls: builtins.list[float]
    ) -> tuple[builtins.list[str], builtins.list[Any]]:
        """RENEW's keys and arguments for ``leases`` (see redis_scripts.RENEW)."""
        names: builtins.list[str] = []
        args: builtins.list[Any] = [len(leases)]
        for lease, ttl in zip(leases, ttls):
            names.extend(self.lease_name(k) for k in lease.keys)
            args.extend([len(lease.keys), lease.owner_id, str(lease.token), _ms(ttl)])
        return names, args

    def unreplicated_renewal(self, wait: WaitPolicy, count: int, acked: int) -> None:
        what = f"the renewal of {count} lease(s)"
        if wait.release:
            # The holder keeps its last replicated expiry; the renewer retries.
            raise StoreUnavailable(f"Redis {redact_url(self.url)}: {wait.describe(what, acked)}")
        wait.warn(what, acked)

    def do_release(self, lease: Lease) -> bool:
        keys = lease.keys
        prefix = self.prefix
        if len(keys) == 1:
            names = [f"{prefix}:lease:{{{_tag(keys[0])}}}"]
        else:
            names = [f"{prefix}:lease:{{{_tag(k)}}}" for k in keys]
        try:
            n = self._run(self._release, names, [lease.owner_id, str(lease.token)])
        except RedisError as e:
            raise self._translate(e) from e
        return int(n) == len(keys)

    def release_later(self, lease: Lease, failed: Callable[[LeaseError], None]) -> None:
        if self.transport.direct:
            names = [self.lease_name(k) for k in lease.keys]

            def answer(_reply: Any, error: RedisError | None) -> None:
                if error is not None:
                    failed(self._translate(error))

            args = [lease.owner_id, str(lease.token)]
            self.transport.send_later(self._release, names, args, answer)
        else:
            super().release_later(lease, failed)

    def do_inspect(self, key: str) -> LeaseRecord | None:
        try:
            reply = self._run(self._inspect, [self.lease_name(key), self.fence_name(key)], [])
        except RedisError as e:
            raise self._translate(e) from e
        return self._record(key, reply)

    def _record(self, key: str, reply: builtins.list[Any]) -> LeaseRecord | None:
        now = _s(reply[0])
        fence = int(reply[1]) if reply[1] not in (b"", "", None) else None
        fields = {_str(reply[i]): _str(reply[i + 1]) for i in range(3, len(reply), 2)}
        if not fields:
            if fence is None:
                return None
            return LeaseRecord(key, None, fence, 0.0, None, None, None, now)
        return LeaseRecord(
            key=key,
            owner_id=None if fields.get("released") else fields.get("owner") or None,
            token=max(int(fields["token"]), fence or 0),
            expires_at=_s(fields["expires"]),
            acquired_at=_s(fields["acquired"]),
            renewed_at=_s(fields["renewed"]),
            ttl=int(fields["ttl"]) / 1000.0,
            now=now,
            task_id=fields.get("task_id") or None,
            task_name=fields.get("task_name") or None,
            root_id=fields.get("root_id") or None,
            tenant=fields.get("tenant") or None,
        )

    def do_list(self, prefix: str, expired: bool) -> builtins.list[LeaseRecord]:
        # Redis deletes expired leases itself (LeaseStore.list drops the ones it has
        # not deleted yet): expired=True finds only those.
        head = f"{self.prefix}:lease:{{"
        match = _glob_escape(head + _tag(prefix)) + "*"
        records: builtins.list[LeaseRecord] = []
        with self.errors():
            names = [_str(n) for n in self.client.scan_iter(match=match, count=1000)]
            pipe = self.client.pipeline(transaction=False)
            keys = sorted(_untag(n[len(head) : -1]) for n in names)
            for key in keys:
                self._inspect(keys=[self.lease_name(key), self.fence_name(key)], client=pipe)
            replies = pipe.execute() if keys else []
        for key, reply in zip(keys, replies):
            record = self._record(key, reply)
            if record is not None and record.owner_id is not None:
                records.append(record)
        return records

    def do_evict(self, key: str, token: int | None = None) -> LeaseRecord | None:
        before = self.do_inspect(key)
        args = [] if token is None else [str(token)]
        try:
            fence = self._run(self._evict, [self.lease_name(key), self.fence_name(key)], args)
        except RedisError as e:
            raise self._translate(e) from e
        if fence is None:  # not the expected token: nothing was changed
            return None
        return before if before is not None and before.live else None

    def do_fence_token(self, key: str) -> int:
        with self.errors():
            if self.transport.direct:
                value = self.transport.execute((b"GET", self.fence_name(key)))
            else:
                value = self.client.get(self.fence_name(key))
        return int(value) if value is not None else 0

    def do_time(self) -> float:
        with self.errors():
            transport = self.transport
            seconds, micros = (
                transport.execute((b"TIME",)) if transport.direct else self.client.time()
            )
        return int(seconds) + int(micros) / 1e6

    def close(self) -> None:
        self.transport.close()
        self.client.close()

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Translate redis-py errors into celery-lease's (see :meth:`_translate`)."""
        try:
            yield
        except RedisError as e:
            raise self._translate(e) from e

    def _translate(self, e: RedisError) -> LeaseError:
        """celery-lease's error for a redis-py one (the one place that decides, by
        :data:`RETRYABLE_REPLIES` and the error's class)."""
        url = redact_url(self.url)
        code, reply = server_reply(e)
        reason = RETRYABLE_REPLIES.get(code) if code is not None else None
        if reason is not None:
            return StoreUnavailable(f"Redis {url} unavailable: {reason}: {reply}")
        if isinstance(e, (RedisConnectionError, RedisTimeoutError)):
            return StoreUnavailable(f"Redis {url} unavailable: {reply}")
        return LeaseError(f"Redis {url}: {reply}")


def check_cert_files(options: Mapping[str, Any], within: str = "") -> None:
    """The TLS files named in ``options`` exist (``within``: the nested option's name)."""
    for option in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path"):
        path = options.get(option)
        if path is not None and not (isinstance(path, str) and os.path.exists(path)):
            where = f"[{within!r}]" if within else ""
            raise LeaseConfigError(f"lease_store_options{where}[{option!r}]: no such file {path!r}")


#: The error replies that mean "not now" (StoreUnavailable: the caller retries
#: within the lease's validity, a task defers), by reply code, with the reason
#: the error names. Any other error reply (WRONGTYPE, NOPERM, an error raised in
#: a script, MOVED/ASK from a Cluster node a standalone client cannot follow)
#: is LeaseError: retrying would meet it again. Connection errors and timeouts
#: are StoreUnavailable by their class.
RETRYABLE_REPLIES: dict[str, str] = {
    "OOM": "the server is out of memory (maxmemory reached, nothing evictable)",
    "MISCONF": "the server refuses writes since an RDB save failed (stop-writes-on-bgsave-error)",
    "LOADING": "the server is loading its dataset",
    "READONLY": "the server is a read-only replica (a failover moved the primary?)",
    "BUSY": "the server is busy running a script or function",
    "MASTERDOWN": "the replica lost its primary and serves no stale data",
    "NOREPLICAS": "too few replicas acknowledge writes (min-replicas-to-write)",
    "TRYAGAIN": "the key's Cluster slot is being migrated",
    "CLUSTERDOWN": "the Cluster does not serve the key's slot",
}


def _ms(ttl: float) -> int:
    return max(1, round(ttl * 1000))


def _s(micros: Any) -> float:
    return int(micros) / 1e6


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _tag(key: str) -> str:
    """``key`` as it goes between the braces of its names (see the module docstring)."""
    return "\0}" + key if key.startswith("}") else key


def _untag(tagged: str) -> str:
    return tagged[2:] if tagged.startswith("\0}") else tagged


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)
