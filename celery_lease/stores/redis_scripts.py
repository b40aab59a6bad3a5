"""The Redis store's Lua scripts: one per operation, each atomic and owner-checked.

Key layout, token rule and reply shapes: :mod:`celery_lease.stores.redis`.
They are sent by :mod:`celery_lease.stores.redis_transport`.
"""

from __future__ import annotations

from celery_lease.stores.base import MAX_TTL

__all__ = ["CLAIM", "EVICT", "INSPECT", "MARK", "MAX_TTL_MS", "RELEASE", "RENEW"]

#: The longest TTL the scripts accept, in ms. They check every TTL before their
#: first write: a value PEXPIRE refuses (past 2**63 ms), or one that makes the
#: expiry (µs, a Lua number) inexact or written in exponent form, must fail
#: the whole call, never leave a hash written without its expiry.
MAX_TTL_MS = round(MAX_TTL * 1000)

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
# number in 1..MAX_TTL_MS.
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
""".replace("@MAX_TTL_MS@", str(MAX_TTL_MS))

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
""".replace("@MAX_TTL_MS@", str(MAX_TTL_MS))

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

# MARK: set an internal marker unless another owner's live marker is there
# (the Redis Cluster store's; the others compare-and-set with WATCH, which a
# Cluster client does not offer).
# KEYS: the marker
# ARGV: owner_id, ttl_ms, then the owners whose live marker may be replaced
# Returns 1 if set, 0 if another owner's marker stays.
MARK = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then
  local ok = false
  for i = 3, #ARGV do
    if cur == ARGV[i] then ok = true end
  end
  if not ok then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
