"""The Redis lease store: one Lua script per operation, store time from ``TIME``.

Layout, per key (hash-tagged so a key's lease and counter share a Cluster slot)::

    {prefix}:lease:{<key>}   hash: owner, token, ttl (ms), expires, acquired,
                             renewed (µs, Redis clock), task_id, task_name,
                             root_id, tenant; PEXPIRE = ttl
    {prefix}:fence:{<key>}   string: the newest token issued; never expires

Tokens only grow, even if Redis loses its data. A grant's token is
``max(counter + 1, TIME in µs)``: the counter covers many grants within one
microsecond or a server clock stepped back, the clock floor covers a restart
without persistence (or the last second of an ``appendfsync everysec`` AOF),
where the counter comes back older or not at all. So tokens from this store
look like microsecond timestamps. The floor assumes the Redis server's clock
does not step back across a data loss; run Redis with ``appendfsync always``
where that is not acceptable.

Every script is owner-checked and atomic; each is one round trip (EVALSHA,
with redis-py's fallback to EVAL when the server lost its script cache).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_lease.exceptions import LeaseConfigError, LeaseError, StoreUnavailable
from celery_lease.stores.base import META_FIELDS, Lease, LeaseRecord, LeaseStore, redact_url

__all__ = ["RedisLeaseStore"]

# CLAIM: grant every key or none, with one token.
# KEYS: n lease hashes, then the n fence counters of the same keys (same order)
# ARGV: owner_id, ttl_ms, task_id, task_name, root_id, tenant
# A released hash (tombstone) counts as free; the owner claiming again is re-granted.
# Expiry is decided by the 'expires' field against TIME, like INSPECT does: the
# hash's PEXPIRE deletes it only in the next millisecond or later.
# Returns {1, token, expires_us, now_us}            granted
#         {0, holder_owner, holder_expires_us, now_us}  a live lease of another owner
CLAIM = """
local n = #KEYS / 2
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
for i = 1, n do
  local h = redis.call('HMGET', KEYS[i], 'owner', 'expires', 'released')
  if h[1] and h[1] ~= ARGV[1] and not h[3] and (tonumber(h[2]) or 0) > now then
    return {0, h[1], h[2] or '0', string.format('%.0f', now)}
  end
end
local token = now
for i = 1, n do
  local c = tonumber(redis.call('GET', KEYS[n + i]) or '0')
  if c + 1 > token then token = c + 1 end
end
local ttl = tonumber(ARGV[2])
local stoken = string.format('%.0f', token)
local sexp = string.format('%.0f', now + ttl * 1000)
local snow = string.format('%.0f', now)
for i = 1, n do
  redis.call('SET', KEYS[n + i], stoken)
  redis.call('DEL', KEYS[i])
  redis.call('HSET', KEYS[i], 'owner', ARGV[1], 'token', stoken, 'ttl', ARGV[2],
             'expires', sexp, 'acquired', snow, 'renewed', snow,
             'task_id', ARGV[3], 'task_name', ARGV[4], 'root_id', ARGV[5], 'tenant', ARGV[6])
  redis.call('PEXPIRE', KEYS[i], ttl)
end
return {1, stoken, sexp, snow}
"""

# RENEW: renew any number of leases in one call.
# KEYS: the lease hashes of every lease, concatenated in ARGV order
# ARGV: count, then per lease: nkeys, owner_id, token, ttl_ms
# Returns one entry per lease: its new expires_us, or '0' if it is lost (some
# key no longer names this owner and token, or it expired by TIME).
RENEW = """
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
"""

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
# Returns the new fence value.
EVICT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('DEL', KEYS[1])
local c = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
if now > c then c = now end
local s = string.format('%.0f', c)
redis.call('SET', KEYS[2], s)
return s
"""


class RedisLeaseStore(LeaseStore):
    schemes = ("redis", "rediss", "unix")

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

    # -- key names ---------------------------------------------------------

    def lease_name(self, key: str) -> str:
        return f"{self.prefix}:lease:{{{key}}}"

    def fence_name(self, key: str) -> str:
        return f"{self.prefix}:fence:{{{key}}}"

    # -- operations --------------------------------------------------------

    def do_claim(
        self,
        primary: str,
        keys: tuple[str, ...],
        owner_id: str,
        ttl: float,
        meta: dict[str, str],
    ) -> Lease | None:
        names = [self.lease_name(k) for k in keys] + [self.fence_name(k) for k in keys]
        args: list[str | int] = [owner_id, _ms(ttl), *(meta.get(f, "") for f in META_FIELDS)]
        with self.errors():
            reply = self._claim(keys=names, args=args)
        if int(reply[0]) != 1:
            return None
        return Lease(primary, keys, owner_id, int(reply[1]), _s(reply[2]), _s(reply[3]), ttl, meta)

    def do_renew_many(
        self, leases: builtins.list[Lease], ttls: builtins.list[float]
    ) -> builtins.list[float | None]:
        names: builtins.list[str] = []
        args: builtins.list[str | int] = [len(leases)]
        for lease, ttl in zip(leases, ttls):
            names.extend(self.lease_name(k) for k in lease.keys)
            args.extend([len(lease.keys), lease.owner_id, str(lease.token), _ms(ttl)])
        with self.errors():
            reply = self._renew(keys=names, args=args)
        return [None if int(r) == 0 else _s(r) for r in reply]

    def do_release(self, lease: Lease) -> bool:
        with self.errors():
            n = self._release(
                keys=[self.lease_name(k) for k in lease.keys],
                args=[lease.owner_id, str(lease.token)],
            )
        return int(n) == len(lease.keys)

    def do_inspect(self, key: str) -> LeaseRecord | None:
        with self.errors():
            reply = self._inspect(keys=[self.lease_name(key), self.fence_name(key)])
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
        match = _glob_escape(head + prefix) + "*"
        records: builtins.list[LeaseRecord] = []
        with self.errors():
            names = [_str(n) for n in self.client.scan_iter(match=match, count=1000)]
            pipe = self.client.pipeline(transaction=False)
            keys = sorted(n[len(head) : -1] for n in names)
            for key in keys:
                self._inspect(keys=[self.lease_name(key), self.fence_name(key)], client=pipe)
            replies = pipe.execute() if keys else []
        for key, reply in zip(keys, replies):
            record = self._record(key, reply)
            if record is not None and record.owner_id is not None:
                records.append(record)
        return records

    def do_evict(self, key: str) -> LeaseRecord | None:
        before = self.do_inspect(key)
        with self.errors():
            self._evict(keys=[self.lease_name(key), self.fence_name(key)])
        return before if before is not None and before.live else None

    def do_fence_token(self, key: str) -> int:
        with self.errors():
            value = self.client.get(self.fence_name(key))
        return int(value) if value is not None else 0

    def do_time(self) -> float:
        with self.errors():
            seconds, micros = self.client.time()
        return seconds + micros / 1e6

    def close(self) -> None:
        self.client.close()

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Translate redis-py errors into celery-lease's (the one place that does)."""
        try:
            yield
        except (RedisConnectionError, RedisTimeoutError, ReadOnlyError) as e:
            raise StoreUnavailable(f"Redis {redact_url(self.url)} unavailable: {e}") from e
        except ResponseError as e:
            if str(e).startswith(("LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "OOM")):
                raise StoreUnavailable(f"Redis {redact_url(self.url)}: {e}") from e
            raise LeaseError(f"Redis {redact_url(self.url)}: {e}") from e
        except RedisError as e:
            raise LeaseError(f"Redis {redact_url(self.url)}: {e}") from e


def _ms(ttl: float) -> int:
    return max(1, round(ttl * 1000))


def _s(micros: Any) -> float:
    return int(micros) / 1e6


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)
