/*
 * Everything that is not a worker: store time passing expiries, the broker
 * redelivering, the renewal timers, a Redis failover, and the start.
 *
 * The clock is abstract: there are no timestamps, only the order of events
 * in store time. A record's expiry is one step, which may come between any
 * two steps of anyone. Its holder's timer renews it while the holder runs,
 * so expiring a running holder's lease is the pause fault (MAX_PAUSE);
 * a lease nobody runs under any more (its holder crashed, or finished
 * without releasing) expires freely, as its TTL ends.
 */

#ifdef EAGER_EXPIRY
#define EXPIRE_NOW(k) ST_EXPIRABLE(k)
#else
#define EXPIRE_NOW(k) PAUSE_EXPIRES(k)
#endif

active proctype expirer() {
end_expirer:
  do
  :: atomic { EXPIRE_NOW(0) -> st_expire(0) }
#if NK > 1
  :: atomic { EXPIRE_NOW(1) -> st_expire(1) }
#endif
#if MAX_DATALOSS > 0
  /* A grant the store lost ends at its own expiry: its holder's renewals are
   * refused, so nothing extends it. */
  :: atomic {
       g_newest[0] != 0 && g_end[0] == VALID && !(rec_st[0] == LIVE && rec_tok[0] == g_newest[0]) ->
       lapse(0, g_newest[0]);
       on_expire(0, g_newest[0])
     }
#endif
  od
}

#if MAX_DATALOSS > 0
active proctype faults() {
end_faults:
  do
  /* A failover promotes a replica that missed the key's last claim: the
   * record is what it was before (the fence counter keeps the TIME floor). */
  :: atomic {
       datalosses < MAX_DATALOSS && next_tok[0] > 0 ->
       datalosses++;
       rec_st[0] = lost_st[0];
       rec_tok[0] = lost_tok[0];
       rec_task[0] = lost_task[0];
       rec_owner[0] = 0;
       printf("@ a Redis failover loses the last claim of k0\n")
     }
  od
}
#endif

/* The renewal timer of worker w's running grant (renewal.py: one thread per
 * process). A refused renewal makes the local view lost. Once the handle is
 * detached (the commit deciding, or released) a renewal sent before may
 * still land: the store must refuse it after the release (invariant 10);
 * its answer no longer changes the handle. */
#define RENEW(w) :: atomic { w_tok[w] != 0 && !w_lapsed[w] && !w_lost[w] -> \
    st_renew(KEY(wtask[w] - 1), w_tok[w], rr); \
    if :: rr == YES -> on_renewed(KEY(wtask[w] - 1), w_tok[w]) \
       :: rr != YES && !w_detached[w] -> w_lost[w] = 1; \
          printf("@ w%d's renewal of token %d is refused\n", w, w_tok[w]) \
       :: else -> skip fi; rr = 0 }

/* Without a failover a renewal is refused only once the lease ran out,
 * which the expiry already tells its holder: a liveness run leaves it out. */
#if !defined(NO_RENEWER) && !(defined(LIVENESS) && MAX_DATALOSS == 0)
active proctype renewer() {
  byte rr;
end_renewer:
  do
  /* @code celery_lease/renew_lanes.py:Lane._call "batch.answers = self.store.renew_many([h.lease for h in group])" */
  RENEW(0)
#if NW > 1
  RENEW(1)
#endif
#if NW > 2
  RENEW(2)
#endif
  od
}
#endif

init {
  atomic {
#if MODE == 2
    if :: once = 0 :: once = 1 fi;
#endif
    qfirst[0] = 1;
#if NT > 1
    qfirst[1] = 1;
#endif
#if NT > 2
    qfirst[2] = 1;
#endif
    run worker(0);
#if NW > 1
    run worker(1);
#endif
#if NW > 2
    run worker(2);
#endif
  }
}
