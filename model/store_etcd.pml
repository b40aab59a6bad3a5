/*
 * The etcd lease store: each operation is one etcd transaction (a Raft
 * proposal), one step here. The lease key is attached to an etcd lease of
 * the TTL; the leader revokes it when it runs out, so a record passes LIVE
 * (renewed by keep-alives) -> LAG (ran out: keep-alives fail, the key still
 * exists, so no one else can claim and its owner's release and commit still
 * succeed) -> GONE (revoked: the key deleted). The fence key is put by every
 * claim and never deleted: its revision (rec_tok) is the newest token.
 * Raft keeps every write, so there is no data-loss fault for etcd.
 */

/* What may run out unseen before a call (grant.pml: touch) */
#define ST_FREE(k) (ORPHAN(k) || rec_st[k] == LAG)
/* an orphan's etcd lease runs out and is revoked before the same call */
#define TOUCH_AGAIN(k) if :: rec_st[k] == LAG -> st_expire(k) :: true -> skip fi

/* /prefix/released/<key>: the token released last, while the fence key still
 * has its revision (the next claim puts the fence key: 0 then). */
byte rel_tok[NK];

/* claim: every lease key absent, or still this claim loop's own (a retry
 * after a lost reply); put the lease key and the fence key */
inline st_claim(w, k, T, r) {
  touch(k);
  /* @code celery_lease/stores/etcd.py:EtcdLeaseStore._claim_ops "else cmp_op(self.lease_name(k), \"CREATE\", 0)" */
  if
  :: rec_st[k] != GONE && rec_owner[k] != w + 1 -> r = BUSY
  :: else -> grant(w, k, T, r); rel_tok[k] = 0
  fi
}

/* A claim whose reply was lost revokes its etcd lease on the way out
 * (best effort: the same outage may swallow the revoke too). */
inline st_claim_lost(k, r) {
  /* @code celery_lease/stores/etcd.py:EtcdLeaseStore.do_claim "self._revoke(lease_id)" */
  if
  :: r != BUSY -> unlive(k, GONE); rel_tok[k] = 0; on_end(k, r)
  :: true -> skip
  fi
}

/* release: compare owner and fence revision, delete the lease key, leave a
 * marker; a repeated release finds its own marker and answers YES */
inline st_release(k, t, r) {
  touch(k);
  /* @code celery_lease/stores/etcd_renew.py:RenewAndRelease._owner_checks "cmp_op(self.fence_name(key), \"MOD\", lease.token)," */
  if
  :: rec_tok[k] == t && (rec_st[k] == LIVE || rec_st[k] == LAG) ->
     unlive(k, GONE); rel_tok[k] = t; on_end(k, t); r = YES
  :: rec_st[k] == GONE && rel_tok[k] == t ->
     /* @code celery_lease/stores/etcd_renew.py:RenewAndRelease._released_before "if released is None or released.value != marker:" */
     r = YES
  :: else -> r = NO
  fi
}

/* renew: the keep-alive (refused once the etcd lease ran out), then the
 * ownership read */
inline st_renew(k, t, r) {
  /* @code celery_lease/stores/etcd_renew.py:RenewAndRelease.do_renew_many "if lease_id is None or (lease_id == ids[i] and left[i] is None):" */
  if
  :: rec_tok[k] == t && rec_st[k] == LIVE -> r = YES
  :: else -> r = NO
  fi
}

/* inspect: a key whose etcd lease ran out is still its owner's until the
 * leader revokes it (its release and commit still succeed meanwhile) */
inline st_inspect(k, hl, ht) {
  touch(k);
#ifdef MUT_F
  /* the code before the fix: a run-out lease reported ownerless */
  hl = (rec_st[k] == LIVE);
  ht = (rec_st[k] == LIVE -> rec_task[k] : 0)
#else
  /* @code celery_lease/stores/etcd.py:EtcdLeaseStore._record "owner_id=kv.owner if granted > 0 else None," */
  hl = (rec_st[k] == LIVE || rec_st[k] == LAG);
  ht = rec_task[k]
#endif
}

/* The etcd lease runs out (the holder's local view ran out before: it is
 * a lower bound of the leader's expiry), then the leader revokes it. */
#define ST_EXPIRABLE(k) (EXPIRES(k) || rec_st[k] == LAG)
inline st_expire(k) {
  if
  :: rec_st[k] == LIVE -> pause_if_held(k); lapse(k, rec_tok[k]); rec_st[k] = LAG;
     /* rec_task stays: inspect reports the holder until the revocation */
     printf("@ token %d's etcd lease runs out\n", rec_tok[k])
  :: else ->
     /* @code celery_lease/stores/etcd.py:EtcdLeaseStore.expiry_lag "expiry_lag = 1.5" */
     on_expire(k, rec_tok[k]);
     printf("@ the etcd leader revokes token %d's lease\n", rec_tok[k]);
     unlive(k, GONE)
  fi
}
