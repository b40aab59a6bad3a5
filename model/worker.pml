/*
 * A worker process: takes a copy of a task id from the broker and runs one
 * execution of it (celery_lease/execution.py, decided by celery_lease/decide/), then
 * the next. Each step is one store or database call, or one write, made
 * atomic as the server makes it; between two steps any other process may
 * run any number of steps, and the store's clock may pass any expiry (the
 * expirer). Before every step with an effect the worker may crash (CRASH):
 * its transaction rolls back, its lease is left to expire, its unacked
 * message is redelivered. Every call may fail or lose its reply (LOSSY,
 * written as the two options "applied, reply lost" and "not applied").
 * Reads alone are not crash points: a crash after a read is the crash
 * before the next step with an effect.
 */

#define CRASH :: atomic { crashes < MAX_CRASH -> crashes++; crash_cleanup() }; goto end_idle
#define LOSSY (losses < MAX_LOSS) -> losses++

/* Where a release leads (nxt). */
#define N_ACK 1
#define N_DEFER 2
#define N_FAIL 3

/* Workers are interchangeable, and so are task ids when all share one key
 * or each has its own: every first move is a mirror image of w0 taking T0's
 * first delivery, so only that one is explored. */
#if NK == 1 || NK == NT
#define FIRST_TAKE(t) (started || ((t) == 0 && w == 0))
#else
#define FIRST_TAKE(t) (started || w == 0)
#endif
#define TAKE(t) :: qfirst[t] > 0 && FIRST_TAKE(t) -> qfirst[t]--; T = t; late = 0 \
                :: qlate[t] > 0 -> qlate[t]--; T = t; late = 1

/* Locals back to zero once nothing can read them (SPENT: what the reads on
 * the way told, once they led to an outcome: the release, a defer, a
 * FAILURE, the ack, the end mark; RESET_LOCALS: between executions), so
 * that states differ only by what matters. */
#define SPENT r = 0; at = 0; own = 0; mine = 0; hc = 0; nw = 0; nwt = 0; ht = 0; hl = 0; late = 0; dup = 0;
/* The execution ends: what only it could still tell apart goes (its claim
 * loop's owner id, a new one for every claim loop:
 * @code celery_lease/claiming.py:claim "owner_id = _new_owner_id()"
 * the tombstone or release marker only its own repeated
 * release could read). */
#ifdef ETCD
#define FORGET_OWN if :: tok != 0 && rel_tok[k] == tok -> rel_tok[k] = 0 :: else -> skip fi;
#else
#define FORGET_OWN if :: tok != 0 && rec_st[k] == TOMB && rec_tok[k] == tok -> unlive(k, GONE) \
  :: else -> skip fi;
#endif
#define RESET_LOCALS FORGET_OWN \
  if :: rec_owner[k] == w + 1 -> rec_owner[k] = 0 :: else -> skip fi; T = 0; k = 0; tok = 0; r = 0; txf = 0; at = 0; own = 0; mine = 0; \
  hc = 0; nw = 0; nwt = 0; ht = 0; nxt = 0; late = 0; dup = 0; hl = 0; \
  wtask[w] = 0; w_tok[w] = 0; w_lapsed[w] = 0; w_lost[w] = 0; w_cur_at_lock[w] = 0; \
  w_detached[w] = 0

/* The worker dies: its transaction rolls back, its message is redelivered. */
inline crash_cleanup() {
  printf("@ w%d crashes (T%d redelivered)\n", w, T);
  rollback(w, k, txf);
  qlate[T]++;
  assert(qlate[T] <= MAX_QUEUED);
  RESET_LOCALS
}

proctype worker(byte w) {
  byte T, k, tok, r, txf, at, own, mine, hc, nw, nwt, ht, nxt;
  bit late, dup, hl;

end_idle:
  atomic {
    /* @code celery_lease/task.py:LeasedTask.__call__ "return Execution(self, args, kwargs).run()" */
    if
    TAKE(0)
#if NT > 1
    TAKE(1)
#endif
#if NT > 2
    TAKE(2)
#endif
    fi;
    started = 1;
    k = KEY(T);
    wtask[w] = T + 1;
    printf("@ w%d takes task T%d (late copy: %d)\n", w, T, late);
    /* The broker may deliver this running message again (the Redis
     * transport's visibility timeout, an AMQP connection lost): the late
     * copy is queued now and taken at any later point, which is every
     * moment a redelivery could make a difference. */
    if
    :: redeliveries < MAX_REDELIVER ->
       redeliveries++; qlate[T]++; msgs++;
       printf("@ the broker will redeliver T%d (running on w%d)\n", T, w)
    :: true -> skip
    fi;
    skip
  };

/* -- claim (claiming.py:claim, decide.decide_claim) ------------------------ */
claim:
  if
  CRASH
  :: atomic {
       /* @code celery_lease/claiming.py:_claim_once "return ex.rt.store.claim(ex.scoped, ttl=ex.opts.ttl, owner_id=owner_id, meta=ex.meta)" */
       if
       :: true -> st_claim(w, k, T, r)
       :: LOSSY; st_claim(w, k, T, r);
#ifdef ETCD
          st_claim_lost(k, r);
#endif
          r = UNAVAIL
       :: LOSSY; r = UNAVAIL
       fi;
#ifdef COLOCATED
       if
       :: r != BUSY && r != UNAVAIL -> claim_lookup(k, T, at, dup)
       :: else -> skip
       fi;
#endif
       if
       :: r == BUSY -> printf("@ w%d claims k%d: busy\n", w, k)
       :: r == UNAVAIL -> printf("@ w%d claims k%d: no answer (lost reply)\n", w, k)
       :: else -> printf("@ w%d claims k%d: granted token %d\n", w, k, r)
       fi;
       if
       :: r == BUSY -> SPENT goto defer_out /* claim.same_id, claim.defer: after the holder */
       :: r == UNAVAIL -> skip
       :: else -> tok = r; w_tok[w] = r; r = 0; goto granted
       fi
     };
     /* @code celery_lease/decide/start.py:decide_claim "return Outcome(\"claim.retry\", Act.RETRY)" */
     if
     :: goto claim
     :: goto store_down
     fi
  fi;

/* claim.store_done / claim.store_down: the result table can tell whether
 * this task id finished already. */
store_down:
  atomic {
    /* @code celery_lease/decide/start.py:_done "if c.commit and c.mine is UNREAD:" */
    if
    :: mine = (task_acc[T] != 0 -> YES : NO)
    :: LOSSY; mine = UNKNOWN
    fi
  };
  if
  :: mine == YES ->
     /* @code celery_lease/reads.py:Reads._backend_meta "meta: dict[str, Any] = backend.get_task_meta(task_id, cache=False)" */
     atomic { own = be_st[T] };
     if
     :: own == SUCCESS -> SPENT goto ack /* claim.store_done: REJECT_ENDED */
     :: else -> skip
     fi
  :: else -> skip
  fi;
  SPENT goto defer_out;

granted:
#ifndef COLOCATED
/* -- before the body (Execution.prepare, ResultTable.prepare) ------------- */
prepare:
  if
  CRASH
  :: atomic {
       /* @code celery_lease/results.py:ResultTable.prepare "out = self.db.pg_first(q.PG_REGISTER_LOOKUP_PY, params)" */
#ifndef MUT_A
       flock[k] == 0 ->
#endif
       if
       :: true -> register_lookup(k, T, tok, r, at, dup)
       :: LOSSY; register_lookup(k, T, tok, r, at, dup); r = UNAVAIL
       :: LOSSY; r = UNAVAIL
       fi;
       if
#ifndef MUT_A
       :: r == OK -> printf("@ w%d registers token %d, looks up: T%d's accepted token %d\n", w, tok, T, at)
#else
       :: r == OK -> printf("@ w%d looks up (registers nothing): T%d's accepted token %d\n", w, T, at)
#endif
       :: r == STALE -> printf("@ w%d registers token %d: a newer token is registered\n", w, tok)
       :: else -> printf("@ w%d registers token %d: no answer\n", w, tok)
       fi
     }
  fi;
  if
  :: r == STALE -> SPENT nxt = N_DEFER; goto release /* lookup.stale */
  :: r == UNAVAIL ->
     /* @code celery_lease/decide/start.py:decide_lookup "return Outcome(\"lookup.retry\", Act.RETRY)" */
     if
     :: !w_lapsed[w] -> goto prepare
     :: SPENT nxt = N_DEFER; goto release /* lookup.store_down */
     fi
  :: else -> skip
  fi;
#endif

/* -- decide_start ------------------------------------------------------- */
  if
  :: at != 0 -> goto copy_of_accepted
  :: else -> skip
  fi;
  /* @code celery_lease/reads.py:Reads._may_be_a_late_copy "return not _broker_marks_redeliveries(self.ex.app)" */
  if
  :: late ->
     /* @code celery_lease/decide/start.py:decide_start "if s.own_state is not None and s.own_state.lease_failure:" */
     atomic { own = be_st[T] };
     if
     :: own == FAILURE -> SPENT nxt = N_ACK; goto release /* start.ended: REJECT_ENDED */
     :: else -> skip
     fi
  :: else -> skip
  fi;
  /* @code celery_lease/decide/start.py:decide_start "return Outcome(\"start.duplicate\", Act.DUPLICATE)" */
  if
  :: dup -> SPENT nxt = N_FAIL; goto release /* start.duplicate -> duplicate.reject */
  :: else -> skip
  fi;

/* -- the body ----------------------------------------------------------- */
  at = 0; dup = 0; late = 0; own = 0; r = 0;
  if
  CRASH
  :: atomic {
       /* @code celery_lease/execution.py:Execution.run "start = decide.decide_body_start(decide.BodyStart(held=held.held))" */
       if
       :: !w_lapsed[w] && !w_lost[w] ->
          printf("@ w%d starts the body of T%d with token %d\n", w, T, tok);
          if :: tok > g_started[k] -> g_started[k] = tok :: else -> skip fi
       :: else -> SPENT nxt = N_DEFER; goto release /* body.lapsed: REQUEUE */
       fi
     }
  fi;
  /* The body runs here: any number of other steps, any expiry. */
  if
  :: w_lapsed[w] || w_lost[w] ->
     /* @code celery_lease/execution.py:Execution.run "except LeaseLost as e:" */
     printf("@ w%d: the body raises LeaseLost\n", w);
     w_detached[w] = 1;
     goto not_done /* the body called ensure(): LeaseLost */
  :: true -> skip
  fi;

#ifdef MUT_D
  /* mutation (d): the backend written before the commit */
  if
  CRASH
  :: atomic { printf("@ w%d writes T%d SUCCESS before its commit (token %d)\n", w, T, tok); be_write(T, SUCCESS, tok, tok) }
  fi;
#endif

/* -- the commit (Execution.commit, ResultTable.commit) --------------------- */
  /* From here on the commit decides: a renewal refused meanwhile (the
   * commit released the lease) only silences the handle. */
  /* @code celery_lease/execution.py:Execution._after_body "held.silence()" */
  w_detached[w] = 1;
#include "commit.pml"

/* -- outcomes ----------------------------------------------------------- */

/* The task returned the committed value: Celery stores SUCCESS, then acks. */
committed:
#ifdef LEASE_BACKEND
  /* @code celery_lease/backend.py:LeaseBackend._store_result "logger.debug(\"result backend: %s's SUCCESS was written by its commit\", task_id)" */
  skip; /* the tracer's SUCCESS write: its commit wrote it */
#endif
#if !defined(MUT_D) && !defined(LEASE_BACKEND)
  if
  CRASH
  :: atomic {
       /* @code celery_lease/execution.py:Execution.commit "return retval" */
       printf("@ w%d writes T%d SUCCESS (token %d)\n", w, T, tok);
       be_write(T, SUCCESS, tok, tok)
     }
  fi;
#endif
  goto ack;

#include "outcomes.pml"
}
