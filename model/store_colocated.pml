/*
 * Leases in the result database (PostgreSQL): the lease row is the lock.
 * The claim and its look-ups are one server-side call, the commit one
 * statement (model/results.pml), so each is one step. A released row keeps
 * owner and token with expires_at = renewed_at (TOMB here), so releasing
 * again answers yes, and a claim takes it over. An expired row stays too
 * (GONE here: claimable, and no owner's release or commit succeeds).
 */

/* What may run out unseen before a call (grant.pml: touch) */
#define ST_FREE(k) (ORPHAN(k))
#define TOUCH_AGAIN(k) skip

/* claim: the row free, expired or this claim loop's own */
inline st_claim(w, k, T, r) {
  touch(k);
  /* @code celery_lease/sql/queries.py:CLAIM_CTE "WHERE l.owner_id IS NULL OR l.expires_at <= EXCLUDED.acquired_at" */
  if
  :: rec_st[k] == LIVE && rec_owner[k] != w + 1 -> r = BUSY
  :: else -> grant(w, k, T, r)
  fi
}

inline st_release(k, t, r) {
  touch(k);
  /* @code celery_lease/sql/queries.py:_RELEASE_IN "AND (expires_at > t.now OR renewed_at = expires_at)" */
  if
  :: rec_tok[k] == t && rec_st[k] == LIVE -> unlive(k, TOMB); on_end(k, t); r = YES
  :: rec_tok[k] == t && rec_st[k] == TOMB -> r = YES
  :: else -> r = NO
  fi
}

inline st_renew(k, t, r) {
  /* @code celery_lease/sql/queries.py:PG_RENEW_MANY "AND l.expires_at > t.now AND l.expires_at > l.renewed_at" */
  if
  :: rec_tok[k] == t && rec_st[k] == LIVE -> r = YES
  :: else -> r = NO
  fi
}

inline st_inspect(k, hl, ht) {
  touch(k);
  /* @code celery_lease/stores/sql.py:_record "owner_id=None if released else row.owner_id," */
  hl = (rec_st[k] == LIVE);
  ht = rec_task[k]
}

#define ST_EXPIRABLE(k) (EXPIRES(k))
inline st_expire(k) {
  printf("@ store time passes token %d's expiry\n", rec_tok[k]);
  pause_if_held(k);
  on_expire(k, rec_tok[k]);
  lapse(k, rec_tok[k]);
  unlive(k, GONE)
}
