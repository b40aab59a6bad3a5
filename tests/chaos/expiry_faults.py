"""The fault where the lease store's Redis deletes run-out lease hashes late.

``store_expiry_lag``  for 3..8 s (longer, bounded, until a hash was read past
                      its expiry) every lease hash loses its expiry (PERSIST)
                      as soon as it is seen, so released and run-out leases
                      stay readable past their ``expires``; each gets back the
                      expiry it had (PEXPIREAT: one in the past deletes it at
                      once), unless a claim or a renewal gave it another (a
                      release keeps the hash's expiry: a tombstone)

The scripts decide expiry by the hash's ``expires`` field against Redis's
clock, never by whether the hash exists, and Redis deletes a hash only in the
millisecond after its PEXPIRE or later (later still on a busy server, or on a
replica until its master's DEL arrives). Every reader of the store's records
must therefore treat a run-out hash that is still there as free: this fault
stretches that window from a millisecond to seconds, across every operation
the workers run. It is proven by hashes read back after their expiry passed.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import redis

__all__ = ["EXPIRY_KINDS", "ExpiryFaults"]

EXPIRY_KINDS = ("store_expiry_lag",)

#: the lease hashes (``{prefix}:lease:{<key>}``), whatever the prefix
LEASE_HASHES = "*:lease:{*"
#: how much longer than its hold a spell lasts, at most, waiting for its proof
LAG_PROOF_MAX = 20.0

# Take a hash's expiry away, atomically with reading what it was, and the
# token it was for. Returns {pexpiretime_ms, token} or false (no expiry).
# PEXPIRETIME is Redis 7.0's; on an older server the fault fails to apply,
# and the CI-sized runs fail naming it as never injected.
_KEEP = """
local at = redis.call('PEXPIRETIME', KEYS[1])
if at <= 0 then return false end
redis.call('PERSIST', KEYS[1])
return {at, redis.call('HGET', KEYS[1], 'token') or ''}
"""

# Give a kept hash its expiry back if nothing gave it another since: still
# without one, and the same grant. Returns 1 if it was restored.
_RESTORE = """
if redis.call('PTTL', KEYS[1]) ~= -1 then return 0 end
if (redis.call('HGET', KEYS[1], 'token') or '') ~= ARGV[2] then return 0 end
redis.call('PEXPIREAT', KEYS[1], ARGV[1])
return 1
"""

# Whether a hash is past its own ``expires`` (µs) by Redis's clock, and how:
# 'released', 'run_out' (an owner that never released), or false.
_LINGERS = """
local h = redis.call('HMGET', KEYS[1], 'expires', 'released', 'owner')
if not h[1] then return false end
local t = redis.call('TIME')
if tonumber(h[1]) > t[1] * 1000000 + t[2] then return false end
if h[2] then return 'released' end
return 'run_out'
"""


class ExpiryFaults:
    """Mixed into :class:`tests.chaos.faults.Injector` (``self.rng``, ``_store_client``)."""

    rng: Any
    _store_client: Any

    def _f_store_expiry_lag(self, _: str) -> dict[str, Any]:
        r: redis.Redis = self._store_client()
        keep, restore, lingers = (r.register_script(s) for s in (_KEEP, _RESTORE, _LINGERS))
        kept: dict[bytes, tuple[int, bytes]] = {}  # hash -> (its expiry in ms, its token)
        past: dict[bytes, str] = {}  # hash -> how it was read past its expiry
        start = time.monotonic()
        hold = self.rng.uniform(3.0, 8.0)
        try:
            # The spell lasts its hold, and longer (bounded) until some hash was
            # read past its expiry: that reading is the proof.
            while time.monotonic() < start + hold or (
                not past and time.monotonic() < start + hold + LAG_PROOF_MAX
            ):
                for name in r.scan_iter(match=LEASE_HASHES, count=1000):
                    reply = keep(keys=[name])
                    if reply:  # new, or a claim or renewal gave it an expiry again
                        kept[name] = (int(reply[0]), reply[1])
                for name in kept.keys() - past.keys():
                    how = lingers(keys=[name])
                    if how:
                        past[name] = how.decode()
                time.sleep(0.05)
        finally:
            restored = sum(int(restore(keys=[n], args=[at, tok])) for n, (at, tok) in kept.items())
            r.close()
        if not past:
            raise RuntimeError(f"no lease hash was read past its expiry ({len(kept)} kept)")
        return {
            "seconds": round(time.monotonic() - start, 2),
            "kept": len(kept),
            "restored": restored,
            "read_past_expiry": dict(Counter(past.values())),
        }
