/*
 * The properties, checked where the event they are about happens. Each one
 * sets its own viol_<name> bit before asserting it clear, so pan's report
 * ("assertion violated !(viol_stale_accept)") names the property; a bit is
 * set only in the state that ends the search, so it costs no states.
 *
 *  stale_accept        no accepted result with a stale token: when a row
 *                      (k, t) is accepted, no body of key k with a token
 *                      newer than t has started (DESIGN invariant 4; the
 *                      chaos checker's stale_write)
 *  stale_lease         and t was the key's current grant (its newest, not
 *                      run out) at some moment while the commit held the
 *                      key's fence row: "atomically with the write, its token
 *                      is the newest ever issued and its lease still held"
 *  once_double         once mode: at most one accepted row per key
 *  task_double         at most one accepted row per task id
 *  ended_accept        no row of a task id with an end mark is accepted
 *  token_order         tokens strictly increase per key (invariant 1)
 *  two_grants          no two grants of a key valid at once in store time
 *                      (invariant 2)
 *  renew_after_release a renewal never extends a released or expired grant
 *                      (invariant 10)
 *  stale_copy_write    once the table has decided a task id (its accepted
 *                      row; once mode: the key's row of another task id;
 *                      its end mark), no backend write that disagrees;
 *                      before, no write by a copy while another copy holds
 *                      the key's valid, newer grant (the execution that owns
 *                      the task id then) (invariant 8)
 *  backend_flip        a final backend state is never changed
 *  accepted_outcome    settled: every task id with an accepted row is
 *                      SUCCESS with that row's value (invariant 7)
 *  lost_key            settled: every key has an accepted row (invariant 5)
 *  unfinished_task     settled: every task id has a final state
 */

bit viol_stale_accept, viol_stale_lease, viol_once_double, viol_task_double, viol_ended_accept;
bit viol_token_order, viol_two_grants, viol_renew_after_release;
bit viol_stale_copy_write, viol_backend_flip;
bit viol_accepted_outcome, viol_lost_key, viol_unfinished_task, viol_stale_literal;

#define CHECK(v, cond) if :: !(cond) -> v = 1 :: else -> skip fi; assert(!v)
/* A property can be left out of a run (-DOFF_TWO_GRANTS, -DOFF_STALE_LEASE,
 * -DOFF_STALE_COPY_WRITE),
 * or every one but the result table's (-DRESULTS_ONLY: stale_accept,
 * once_double, task_double, token_order): the search then finds what else
 * breaks under the same fault or mutation. */
#ifdef RESULTS_ONLY
#define OFF_TWO_GRANTS 1
#define OFF_STALE_LEASE 1
#define OFF_BACKEND 1
#endif

/* A grant of token t for key k to a copy of task T (inside the store's step). */
inline on_grant(k, t, T) {
  CHECK(viol_token_order, t > g_newest[k]);
#ifndef OFF_TWO_GRANTS
  CHECK(viol_two_grants, g_newest[k] == 0 || g_end[k] != VALID);
#endif
  g_newest[k] = t;
  g_end[k] = VALID;
  g_newest_task[k] = T + 1
}

/* The grant of token t ended by its owner's hand (release, commit, re-grant). */
inline on_end(k, t) {
  if
  :: g_newest[k] == t && g_end[k] == VALID -> g_end[k] = RELEASED
  :: else -> skip
  fi
}

/* The grant of token t ran out in store time. */
inline on_expire(k, t) {
  if
  :: g_newest[k] == t && g_end[k] == VALID -> g_end[k] = EXPIRED
  :: else -> skip
  fi
}

/* A renewal of token t answered yes. */
inline on_renewed(k, t) {
#ifndef OFF_BACKEND
  CHECK(viol_renew_after_release, g_newest[k] == t && g_end[k] == VALID)
#else
  skip
#endif
}

/* The database accepted row (k, t) of task T: the insert committed. */
inline on_accept(k, t, T, w) {
  printf("@ the database accepts row (k%d, token %d) of T%d\n", k, t, T);
#ifdef LITERAL_STALE
  /* "stale: a newer grant existed when it was written", literally: fails in
   * the window results.py documents (the commit releases inside its
   * transaction, so a new owner can claim before the insert; it cannot
   * register, so its body waits: that is stale_accept). */
  CHECK(viol_stale_literal, g_newest[k] == t);
#endif
  CHECK(viol_stale_accept, g_started[k] <= t);
#ifndef OFF_STALE_LEASE
  CHECK(viol_stale_lease, w_cur_at_lock[w]);
#endif
  CHECK(viol_once_double, !ONCE || acc_n[k] == 0);
  CHECK(viol_task_double, task_acc[T] == 0);
  CHECK(viol_ended_accept, !ended[T]);
  task_acc[T] = t;
  acc_n[k]++;
  if
  :: t > acc_new[k] -> acc_new[k] = t; acc_new_task[k] = T + 1
  :: else -> skip
  fi;
#ifdef LEASE_BACKEND
  /* The lease+ backend in the result database: the task's SUCCESS record is
   * written in the commit's transaction, replacing whatever it held. */
  /* @code celery_lease/sql/meta_queries.py:_META_COMMIT_UPSERT "value = excluded.value, expires_at = excluded.expires_at, token = excluded.token" */
  printf("@ the commit's transaction writes T%d SUCCESS (token %d)\n", T, t);
  be_write(T, SUCCESS, t, t)
#else
  skip
#endif
}

/* Worker w, holding token t for task T, writes the backend: st, and for a
 * SUCCESS the token whose accepted value it carries. */
inline be_write(T, st, val, t) {
#ifndef OFF_BACKEND
#ifndef OFF_STALE_COPY_WRITE
  CHECK(viol_stale_copy_write,
        (task_acc[T] != 0 && st == SUCCESS && val == task_acc[T])
        || (ONCE && task_acc[T] == 0 && acc_n[KEY(T)] > 0 && st == FAILURE)
        || (ended[T] && task_acc[T] == 0 && st == FAILURE)
        || (task_acc[T] == 0 && !(ONCE && acc_n[KEY(T)] > 0) && !ended[T]
            && !(g_newest_task[KEY(T)] == T + 1 && g_end[KEY(T)] == VALID && g_newest[KEY(T)] > t)));
#endif
  CHECK(viol_backend_flip, be_st[T] == PENDING || (be_st[T] == st && be_val[T] == val));
#endif
  be_st[T] = st;
#ifdef LEASE_BACKEND
  if
  :: t != 0 -> be_tok[T] = t
  :: else -> skip /* a write without a token keeps the record's */
  fi;
#endif
  be_val[T] = val
}

/* A write by celery-lease (a FAILURE, the accepted value a late copy
 * stores): with the lease+ backend fenced by the writer's token, in the one
 * statement; with any other backend, last writer wins. */
inline be_write_fenced(T, st, val, t) {
#ifdef LEASE_BACKEND
  /* @code celery_lease/sql/meta_queries.py:_META_FENCED "WHEN m.token IS NOT NULL AND m.token > excluded.token THEN FALSE" */
  /* @code celery_lease/sql/meta_queries.py:_META_SET "ELSE COALESCE({{status}}, '') <> 'SUCCESS' END" */
  if
  :: ((t == 0 && be_st[T] == SUCCESS && be_tok[T] != 0)
      || (t != 0 && (be_tok[T] > t || (be_st[T] == SUCCESS && st != SUCCESS)))) ->
     printf("@ the backend refuses T%d's write (token %d): its record has token %d\n", T, t, be_tok[T])
  :: else -> be_write(T, st, val, t)
  fi
#else
  be_write(T, st, val, t)
#endif
}

/* Row (k, t) exists (results.get): a token belongs to one task id. */
#if NT == 1
#define ROW(k, t) (task_acc[0] == (t))
#elif NT == 2
#define ROW(k, t) ((KEY(0) == (k) && task_acc[0] == (t)) || (KEY(1) == (k) && task_acc[1] == (t)))
#else
#define ROW(k, t) ((KEY(0) == (k) && task_acc[0] == (t)) || (KEY(1) == (k) && task_acc[1] == (t)) \
                   || (KEY(2) == (k) && task_acc[2] == (t)))
#endif

/* Settled: every message acked, every worker idle. */
#define SETTLED (msgs == 0)

inline settled_task(T) {
#ifndef OFF_BACKEND
  CHECK(viol_accepted_outcome, task_acc[T] == 0 || (be_st[T] == SUCCESS && be_val[T] == task_acc[T]));
  CHECK(viol_unfinished_task, be_st[T] != PENDING);
  CHECK(viol_lost_key, acc_n[KEY(T)] > 0)
#else
  skip
#endif
}

/* Once the system settled, the backend and the table must agree (a safety
 * check: the liveness run, which only asks that it settles, leaves it out,
 * as fairness multiplies every state by the number of processes). */
#ifndef LIVENESS
active proctype settled() {
end_settled:
  atomic {
    SETTLED ->
    settled_task(0);
#if NT > 1
    settled_task(1);
#endif
#if NT > 2
    settled_task(2);
#endif
    skip
  }
}
#endif

#ifdef LIVENESS
#define EAGER_EXPIRY 1
/* When the faults stop (every budget is finite), the system settles: every
 * message acked, and so (the asserts above) every key accepted and every
 * accepted task id SUCCESS. Checked with pan -a -f (weak fairness). */
ltl settles { <> SETTLED }
#endif
