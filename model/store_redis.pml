/*
 * The Redis lease store: one Lua script per operation, each atomic, so each
 * is one step here. Expiry by TIME: a record runs out as one step of the
 * expirer (model/env.pml). The fence counter survives release and expiry
 * (rec_tok and next_tok), and the token is floored by TIME, so even a
 * failover that loses the counter issues a larger token (next_tok is never
 * lowered; the failover fault below loses the lease record only).
 */

/* What may run out unseen before a call (grant.pml: touch) */
#define ST_FREE(k) (ORPHAN(k) || rec_st[k] == TOMB)
#define TOUCH_AGAIN(k) skip

/* claim: granted (r = token) or BUSY */
inline st_claim(w, k, T, r) {
  touch(k);
  /* @code celery_lease/stores/redis_scripts.py:CLAIM "if h[1] ~= owner and not h[3] and (tonumber(h[2]) or 0) > now then" */
  if
  :: rec_st[k] == LIVE && rec_owner[k] != w + 1 -> r = BUSY
  :: else ->
     /* @code celery_lease/stores/redis_scripts.py:CLAIM "local c = tonumber(redis.call('GETSET', KEYS[i], now) or '0') + 1" */
     grant(w, k, T, r)
  fi
}

/* release: YES while this grant is the record's (a tombstone answers yes again) */
inline st_release(k, t, r) {
  touch(k);
  /* @code celery_lease/stores/redis_scripts.py:RELEASE "if h[1] == ARGV[1] and h[2] == ARGV[2] and (h[3] or (tonumber(h[4]) or 0) > now) then" */
  if
  :: rec_tok[k] == t && rec_st[k] == LIVE -> unlive(k, TOMB); on_end(k, t); r = YES
  :: rec_tok[k] == t && rec_st[k] == TOMB -> r = YES
  :: else -> r = NO
  fi
}

/* renew: YES while the grant is the record's, unreleased and unexpired */
inline st_renew(k, t, r) {
  /* @code celery_lease/stores/redis_scripts.py:RENEW "if h[1] ~= owner or h[2] ~= token or h[3] or (tonumber(h[4]) or 0) <= now then" */
  if
  :: rec_tok[k] == t && rec_st[k] == LIVE -> r = YES
  :: else -> r = NO
  fi
}

/* inspect: the holder's record (a released record has no owner) */
inline st_inspect(k, hl, ht) {
  touch(k);
  /* @code celery_lease/stores/redis.py:RedisLeaseStore._record "owner_id=None if fields.get(\"released\") else fields.get(\"owner\") or None" */
  hl = (rec_st[k] == LIVE);
  ht = rec_task[k] /* 0 unless LIVE */
}

/* PEXPIRE deletes the hash: an unreleased lease runs out, a tombstone goes. */
#define ST_EXPIRABLE(k) (EXPIRES(k) || rec_st[k] == TOMB)
inline st_expire(k) {
  /* @code celery_lease/stores/redis_scripts.py:CLAIM "redis.call('PEXPIRE', KEYS[i], ARGV[2])" */
  if
  :: rec_st[k] == LIVE -> pause_if_held(k); on_expire(k, rec_tok[k]); lapse(k, rec_tok[k]);
     printf("@ store time passes token %d's expiry\n", rec_tok[k])
  :: else -> skip
  fi;
  unlive(k, GONE)
}
