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

Every script is owner-checked and atomic; each is one round trip (EVALSHA,
or EVAL when the server lost its script cache). The store sends them itself on
connections it keeps checked out of the redis-py client's pool (see
``RedisLeaseStore._run``), not through ``Script``/``execute_command``, whose
per-command machinery costs more than the round trip; ``list`` and the plain
commands use the client as usual.
"""

from __future__ import annotations

import builtins
import inspect
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_lease.exceptions import LeaseConfigError, LeaseError, StoreUnavailable
from celery_lease.stores.base import (
    MAX_TTL,
    META_FIELDS,
    Lease,
    LeaseRecord,
    LeaseStore,
    check_option_names,
    redact_url,
    refuse_key_prefix_option,
)
from celery_lease.urls import check_redis_url

__all__ = ["RedisLeaseStore"]

#: The longest TTL the scripts accept, in ms. They check every TTL before their
#: first write: a value PEXPIRE refuses (past 2**63 ms), or one that makes the
#: expiry (µs, a Lua number) inexact or written in exponent form, must fail
#: the whole call, never leave a hash written without its expiry.
_MAX_TTL_MS = round(MAX_TTL * 1000)

# CLAIM: grant every key or none, with one token.
# KEYS: n lease hashes, then the n fence counters of the same keys (same order)
# ARGV: owner_id, ttl_ms[, task_id, task_name, root_id, tenant]
#       (the metadata is optional; only non-empty values are stored: an absent
#       field reads back as None, like an empty one)
# A released hash (tombstone) counts as free; the owner claiming again is re-granted.
# Expiry is decided by the 'expires' field against TIME, like INSPECT does: the
# hash's PEXPIRE deletes it only in the next millisecond or later.
# Numbers go to redis.call and into the reply as Lua numbers: Redis formats
# them with 17 significant digits (exact below 2^53, so a µs timestamp reads
# back digit for digit) and replies integers, with no string.format.
# The fence is swapped to TIME first (GETSET: one call where GET + SET took
# two); in the rare case a counter is already at or past TIME (many grants in
# one µs, a clock stepped back) every fence is then set to the larger token.
# Returns {1, token, now_us}                        granted (expires_us = now_us + ttl_ms * 1000)
#         {0, holder_owner, holder_expires_us, now_us}  a live lease of another owner
# An error reply, before anything is written, for a ttl_ms that is not a whole
# number in 1.._MAX_TTL_MS.
CLAIM = """
local ms = tonumber(ARGV[2])
if not ms or ms < 1 or ms > @MAX_TTL_MS@ or ms % 1 ~= 0 then
  return redis.error_reply('ERR celery-lease: ttl_ms out of range: ' .. tostring(ARGV[2]))
end
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local n = #KEYS / 2
local owner = ARGV[1]
local old = {}
for i = 1, n do
  local h = redis.call('HMGET', KEYS[i], 'owner', 'expires', 'released')
  if h[1] then
    if h[1] ~= owner and not h[3] and (tonumber(h[2]) or 0) > now then
      return {0, h[1], h[2] or '0', now}
    end
    old[i] = true
  end
end
local token = now
for i = n + 1, n + n do
  local c = tonumber(redis.call('GETSET', KEYS[i], now) or '0') + 1
  if c > token then token = c end
end
if token > now then
  for i = n + 1, n + n do redis.call('SET', KEYS[i], token) end
end
local exp = now + ARGV[2] * 1000
local fields = {'owner', owner, 'token', token, 'ttl', ARGV[2], 'expires', exp,
                'acquired', now, 'renewed', now}
if ARGV[3] then
  local names = {'task_id', 'task_name', 'root_id', 'tenant'}
  for j = 1, 4 do
    local v = ARGV[j + 2]
    if v and v ~= '' then
      fields[#fields + 1] = names[j]
      fields[#fields + 1] = v
    end
  end
end
for i = 1, n do
  if old[i] then redis.call('DEL', KEYS[i]) end
  redis.call('HSET', KEYS[i], unpack(fields))
  redis.call('PEXPIRE', KEYS[i], ARGV[2])
end
return {1, token, now}
""".replace("@MAX_TTL_MS@", str(_MAX_TTL_MS))

# RENEW: renew any number of leases in one call.
# KEYS: the lease hashes of every lease, concatenated in ARGV order
# ARGV: count, then per lease: nkeys, owner_id, token, ttl_ms
# Returns one entry per lease: its new expires_us, or '0' if it is lost (some
# key no longer names this owner and token, or it expired by TIME). An error
# reply, before anything is written, if any ttl_ms is out of range (as CLAIM).
RENEW = """
for l = 1, tonumber(ARGV[1]) do
  local ms = tonumber(ARGV[l * 4 + 1])
  if not ms or ms < 1 or ms > @MAX_TTL_MS@ or ms % 1 ~= 0 then
    return redis.error_reply('ERR celery-lease: ttl_ms out of range: ' .. tostring(ARGV[l * 4 + 1]))
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local out = {}
local k = 1
local a = 2
for l = 1, tonumber(ARGV[1]) do
  local nkeys, owner, token = tonumber(ARGV[a]), ARGV[a + 1], ARGV[a + 2]
  local ttl = tonumber(ARGV[a + 3])
  a = a + 4
  local ok = true
  for i = k, k + nkeys - 1 do
    local h = redis.call('HMGET', KEYS[i], 'owner', 'token', 'released', 'expires')
    if h[1] ~= owner or h[2] ~= token or h[3] or (tonumber(h[4]) or 0) <= now then
      ok = false
    end
  end
  if ok then
    local sexp = string.format('%.0f', now + ttl * 1000)
    for i = k, k + nkeys - 1 do
      redis.call('HSET', KEYS[i], 'expires', sexp, 'renewed', string.format('%.0f', now),
                 'ttl', ARGV[a - 1])
      redis.call('PEXPIRE', KEYS[i], ttl)
    end
    out[l] = sexp
  else
    out[l] = '0'
  end
  k = k + nkeys
end
return out
""".replace("@MAX_TTL_MS@", str(_MAX_TTL_MS))

# RELEASE: mark released the keys that still name this owner and token. The
# hash stays (until its own expiry) as a tombstone, so releasing again answers
# yes: a retry after a lost reply is not mistaken for a lost lease.
# KEYS: lease hashes
# ARGV: owner_id, token
# Returns the number of keys this owner holds or had released (== #KEYS when
# it was still the owner); a lease expired by TIME is not released.
RELEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n = 0
for i = 1, #KEYS do
  local h = redis.call('HMGET', KEYS[i], 'owner', 'token', 'released', 'expires')
  if h[1] == ARGV[1] and h[2] == ARGV[2] and (h[3] or (tonumber(h[4]) or 0) > now) then
    if not h[3] then redis.call('HSET', KEYS[i], 'released', '1') end
    n = n + 1
  end
end
return n
"""

# INSPECT: the lease hash, the fence counter and the store time, read together.
# KEYS: lease hash, fence counter
# Returns {now_us, fence or '', pttl, field, value, field, value, ...}
INSPECT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local out = {string.format('%.0f', now), redis.call('GET', KEYS[2]) or '',
             redis.call('PTTL', KEYS[1])}
local h = redis.call('HGETALL', KEYS[1])
for i = 1, #h do out[#out + 1] = h[i] end
return out
"""

# EVICT: force release whoever holds the key, and raise the fence past the
# evicted token so the next grant (and every guarded write) outranks it.
# KEYS: lease hash, fence counter
# ARGV: [token]: evict only the lease granted with this token, if it is not
#       released (nothing changes otherwise)
# Returns the new fence value, or false (nil) when the token did not match.
EVICT = """
if ARGV[1] then
  local h = redis.call('HMGET', KEYS[1], 'token', 'released')
  if h[1] ~= ARGV[1] or h[2] then return false end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('DEL', KEYS[1])
local c = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
if now > c then c = now end
local s = string.format('%.0f', c)
redis.call('SET', KEYS[2], s)
return s
"""


#: Connections a store keeps checked out between calls; more, from a burst of
#: concurrent calls, go back to the client's pool.
_KEEP_IDLE = 4


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
        for option in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path"):
            path = options.get(option)
            if path is not None and not (isinstance(path, str) and os.path.exists(path)):
                raise LeaseConfigError(f"lease_store_options[{option!r}]: no such file {path!r}")
        cls(url, **cls.options_from_settings(options, key_prefix)).close()

    def __init__(self, url: str, key_prefix: str = "celery-lease", **options: Any) -> None:
        self.url = url
        self.prefix = key_prefix
        options.setdefault("socket_timeout", 5.0)
        options.setdefault("socket_connect_timeout", 5.0)
        try:
            self.client: redis.Redis = redis.Redis.from_url(url, **options)
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
        # The scripts run on connections checked out of the client's pool once and
        # kept in _idle between calls (see _run), not through execute_command:
        # redis-py's per-command machinery (pool checkout and its socket poll,
        # retry closure, observability hooks, Script.__call__) costs more per
        # call than the round trip itself. A client-side cache wraps connections
        # in proxies, so with one the scripts go through redis-py's own path.
        self._direct = getattr(pool, "cache", None) is None
        self._idle: builtins.list[Any] = []  # redis-py Connections
        self._pid = os.getpid()
        # redis-py < 5.3 requires a command name; later versions deprecate it.
        param = inspect.signature(pool.get_connection).parameters.get("command_name")
        self._checkout_args: tuple[str, ...] = (
            ("EVALSHA",) if param is not None and param.default is param.empty else ()
        )

    # -- key names ---------------------------------------------------------

    def lease_name(self, key: str) -> str:
        return f"{self.prefix}:lease:{{{_tag(key)}}}"

    def fence_name(self, key: str) -> str:
        return f"{self.prefix}:fence:{{{_tag(key)}}}"

    def mark(self, name: str, owner_id: str, *, ttl: float) -> bool:
        marker = f"{self.prefix}:mark:{name}"
        ms = _ms(ttl)
        with self.errors():
            if self.client.set(marker, owner_id, px=ms, nx=True):
                return True
            if _str(self.client.get(marker) or "") == owner_id:  # this chain's own: extend
                return bool(self.client.set(marker, owner_id, px=ms, xx=True))
        return False

    def marker(self, name: str) -> str | None:
        with self.errors():
            value = self.client.get(f"{self.prefix}:mark:{name}")
        return _str(value) if value is not None else None

    # -- running a script --------------------------------------------------

    def _run(self, script: Script, keys: builtins.list[str], args: builtins.list[Any]) -> Any:
        """EVALSHA ``script`` in one round trip (see :meth:`_execute`); redis-py errors pass."""
        if not self._direct:
            return script(keys=keys, args=args)
        return self._execute((b"EVALSHA", script.sha, len(keys), *keys, *args), script)

    def _execute(self, command: tuple[Any, ...], script: Script | None = None) -> Any:
        """Send ``command`` on a kept connection and return its raw reply.

        Like redis-py: a connection that fails mid-command is disconnected (the
        next use reconnects); the client's Retry policy applies; NOSCRIPT (a
        restarted or flushed server) is answered by sending the script (EVAL,
        which also caches it). Like redis-py's pool, which polls a connection
        before lending it: one whose server closed it while idle (a restart, an
        idle timeout) is replaced. Here that shows as a ConnectionError on use, so
        the command is sent once more on a new connection. Every command sent
        here is safe to repeat: a repeated claim re-grants the same owner, a
        repeated release or renewal finds its own work done, an evict advances
        the fence again, the rest only read.
        """
        if self._pid != os.getpid():  # forked: the parent's sockets are not ours
            self._idle = []
            self._pid = os.getpid()
        try:
            conn = self._idle.pop()
        except IndexError:
            conn = self.client.connection_pool.get_connection(*self._checkout_args)

        def attempt() -> Any:
            try:
                return _roundtrip(conn, command, script)
            except RedisConnectionError:  # closed while idle: once more, reconnected
                return _roundtrip(conn, command, script)

        try:
            return conn.retry.call_with_retry(attempt, lambda _error: conn.disconnect())
        finally:
            if len(self._idle) < _KEEP_IDLE:
                self._idle.append(conn)
            else:  # a burst of concurrent calls is over: give the pool its connection back
                self.client.connection_pool.release(conn)

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
        try:
            reply = self._run(self._claim, names, args)
        except RedisError as e:
            raise self._translate(e) from e
        if reply[0] != 1:
            return None
        now = int(reply[2])
        return Lease(
            primary, keys, owner_id, int(reply[1]), (now + ms * 1000) / 1e6, now / 1e6, ttl, meta
        )

    def do_renew_many(
        self, leases: builtins.list[Lease], ttls: builtins.list[float]
    ) -> builtins.list[float | None]:
        names: builtins.list[str] = []
        args: builtins.list[str | int] = [len(leases)]
        for lease, ttl in zip(leases, ttls):
            names.extend(self.lease_name(k) for k in lease.keys)
            args.extend([len(lease.keys), lease.owner_id, str(lease.token), _ms(ttl)])
        try:
            reply = self._run(self._renew, names, args)
        except RedisError as e:
            raise self._translate(e) from e
        return [None if int(r) == 0 else _s(r) for r in reply]

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
        # Redis deletes expired leases itself: there are no expired records to list.
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
            if self._direct:
                value = self._execute((b"GET", self.fence_name(key)))
            else:
                value = self.client.get(self.fence_name(key))
        return int(value) if value is not None else 0

    def do_time(self) -> float:
        with self.errors():
            seconds, micros = self._execute((b"TIME",)) if self._direct else self.client.time()
        return int(seconds) + int(micros) / 1e6

    def close(self) -> None:
        idle, self._idle = self._idle, []
        if self._pid == os.getpid():
            for conn in idle:
                self.client.connection_pool.release(conn)
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

#: The reply code of the redis-py classes that strip it from the message
#: (redis-py < 8 does not keep it in ``status_code``); subclasses first.
_CODE_OF_CLASS: tuple[tuple[type[RedisError], str], ...] = (
    (MasterDownError, "MASTERDOWN"),
    (ClusterDownError, "CLUSTERDOWN"),
    (TryAgainError, "TRYAGAIN"),
    (OutOfMemoryError, "OOM"),
    (ReadOnlyError, "READONLY"),
    (BusyLoadingError, "LOADING"),
    (NoScriptError, "NOSCRIPT"),
)


def server_reply(e: RedisError) -> tuple[str | None, str]:
    """The code of the server's error reply behind ``e`` (``OOM``, ``BUSY``...;
    None for a client-side error) and the reply as the server sent it.

    redis-py turns the replies it knows into classes and strips their code from
    the message (keeping it in ``status_code`` from redis-py 8 on); any other
    reply is a plain ResponseError whose message still starts with its code.
    """
    text = str(e.args[0]) if e.args else str(e)
    code = getattr(e, "status_code", None)
    if isinstance(code, str) and code:
        return code, f"{code} {text}"
    for cls, name in _CODE_OF_CLASS:
        if isinstance(e, cls):
            return name, f"{name} {text}"
    if isinstance(e, ResponseError):
        word = text.split(" ", 1)[0]
        if word.isalpha() and word.isupper():
            return word, text
    return None, str(e)


def _roundtrip(conn: Any, command: tuple[Any, ...], script: Script | None) -> Any:
    """Send ``command`` on ``conn`` and read its reply (EVAL if the server lacks ``script``).

    Anything but a server's error reply leaves the connection disconnected, so a
    reply can never be left unread for the next command on it (redis-py's own
    send and read already do this for their errors; this covers the rest, such
    as a soft time limit raised between them).
    """
    replied = False  # a whole reply (or error reply) read: the connection stays usable
    try:
        conn.send_packed_command(conn.pack_command(*command))
        try:
            reply = conn.read_response()
        except NoScriptError:
            if script is None:
                replied = True
                raise
            conn.send_packed_command(conn.pack_command(b"EVAL", script.script, *command[2:]))
            reply = conn.read_response()
        replied = True
        return reply
    except ResponseError:
        replied = True
        raise
    finally:
        if not replied:
            conn.disconnect()


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
