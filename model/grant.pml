/*
 * A grant, as every store makes it: the next token, the record, the ghosts.
 * Called inside the store's atomic step.
 */

inline grant(w, k, T, r) {
#ifdef ETCD
  /* etcd: the token is the transaction's revision, one counter for the cluster */
  /* @code celery_lease/stores/etcd.py:EtcdLeaseStore.do_claim "token = int(reply[\"header\"][\"revision\"])" */
  next_tok[0]++;
  r = next_tok[0];
#else
  next_tok[k]++;
  r = next_tok[k];
#endif
  assert(r < MAX_TOKEN);
  if
  :: rec_st[k] == LIVE || rec_st[k] == LAG -> on_end(k, rec_tok[k]) /* its own owner claims again */
  :: else -> skip
  fi;
  on_grant(k, r, T);
#if MAX_DATALOSS > 0
  lost_st[k] = rec_st[k];
  lost_tok[k] = rec_tok[k];
  lost_task[k] = rec_task[k];
#endif
  rec_st[k] = LIVE;
  rec_tok[k] = r;
  rec_task[k] = T + 1;
  rec_owner[k] = w + 1
}

/* A record leaves LIVE: its owner and task id mean nothing any more (a
 * claim reads the owner of a LIVE record only, inspect the task id of a
 * LIVE one, on etcd of a LAG one too); a GONE record's token neither
 * (every store's release and renewal need the record). Cleared, so that
 * states differ only by what the protocol can still read. */
inline unlive(k, st) {
  rec_st[k] = st;
  rec_task[k] = 0;
  if
  :: st == GONE -> rec_tok[k] = 0; rec_owner[k] = 0
  :: st == TOMB -> rec_owner[k] = 0
  :: else -> skip
  fi
}

/* Worker w's running holder's local view runs out when its grant does (it
 * can never outlive the store's: renewal.py takes the drift margin off). */
inline lapse(k, t) {
  if :: wtask[0] != 0 && KEY(wtask[0] - 1) == k && w_tok[0] == t -> w_lapsed[0] = 1 :: else -> skip fi;
#if NW > 1
  if :: wtask[1] != 0 && KEY(wtask[1] - 1) == k && w_tok[1] == t -> w_lapsed[1] = 1 :: else -> skip fi;
#endif
#if NW > 2
  if :: wtask[2] != 0 && KEY(wtask[2] - 1) == k && w_tok[2] == t -> w_lapsed[2] = 1 :: else -> skip fi;
#endif
  skip
}

/* Expiry of a LIVE record: a pause if its holder is running (a running
 * holder's timer renews it), free if nobody holds it any more. */
inline pause_if_held(k) {
  if
  :: HELD_BY_RUNNER(k) -> pauses++; printf("@ (its holder is paused past its TTL)\n")
  :: else -> skip
  fi
}
#define EXPIRES(k) (rec_st[k] == LIVE && (!HELD_BY_RUNNER(k) || pauses < MAX_PAUSE))
#define PAUSE_EXPIRES(k) (rec_st[k] == LIVE && HELD_BY_RUNNER(k) && pauses < MAX_PAUSE)
#define ORPHAN(k) (rec_st[k] == LIVE && !HELD_BY_RUNNER(k))

/* Before a store call on key k: a record that nobody runs under any more
 * (ST_FREE) may have run out meanwhile. Nothing but a call on the key can
 * tell when it did, so (in safety runs) that is decided at the call; the
 * liveness run expires them eagerly (EAGER_EXPIRY), as fairness needs. */
#ifdef EAGER_EXPIRY
#define touch(k) skip
#else
#define touch(k) if :: ST_FREE(k) -> st_expire(k) :: true -> skip fi; TOUCH_AGAIN(k)
#endif
