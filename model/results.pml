/*
 * The fenced result table (SQL) and the look-ups before a body. Each
 * statement, or server-side call, is one step; a transaction that spans
 * steps holds the key's fence row (flock) from its lock to its end, and a
 * rollback (an error, a lost connection, a crash) undoes what it wrote.
 */

/* Leases elsewhere, before the body: register the token in the fence row,
 * then look up this task id's accepted row and (once mode) the key's. One
 * server call whose registration waits for the fence row and holds it to
 * the end, so the look-ups see every commit that held the row before. */
inline register_lookup(k, T, t, r, at, dup) {
#ifndef MUT_A
  /* @code celery_lease/sql/queries.py:REGISTER "WHERE fe.fencing_token <= excluded.fencing_token" */
  if
  :: fence[k] <= t -> fence[k] = t; r = OK
  :: else -> r = STALE
  fi;
#else
  /* mutation (a): the claim registers nothing; the commit registers under its lock */
  r = OK;
#endif
  /* @code celery_lease/sql/functions.py:CREATE_REGISTER_LOOKUP "A new statement: a snapshot taken after the registration's wait for the fence row." */
  at = task_acc[T];
  dup = (ONCE && acc_n[k] > 0)
}

/* Leases in this database: the claim, then (a new statement, after the
 * claim's lock waits) the look-ups. */
inline claim_lookup(k, T, at, dup) {
  /* @code celery_lease/sql/functions.py:CREATE_CLAIM_LOOKUP "A new statement: a snapshot taken after the claim (and any wait for its locks)." */
  at = task_acc[T];
  dup = (ONCE && acc_n[k] > 0)
}

/* commit_remote, 1: lock the key's fence row and compare the registered token. */
inline fence_lock(w, k, t, r, txf) {
  /* @code celery_lease/result_commit.py:commit_remote "fence = conn.execute(lock, {\"key\": lease.key}).scalar()" */
  flock[k] = w + 1;
  w_cur_at_lock[w] = CURRENT(k, t);
  txf = 0;
#ifndef MUT_B
  if
  :: fence[k] > t ->
     /* @code celery_lease/result_commit.py:commit_remote "elif int(fence) > lease.token:" */
     flock[k] = 0; w_cur_at_lock[w] = 0; r = STALE
  :: fence[k] < t ->
     /* @code celery_lease/result_commit.py:commit_remote "# Never registered (or registration lost): register now, under the lock." */
     txf = t; r = OK
  :: else -> r = OK
  fi
#else
  /* mutation (b): compare with the newest committed token only */
  if
  :: acc_new[k] >= t && !ROW(k, t) -> flock[k] = 0; w_cur_at_lock[w] = 0; r = STALE
  :: else -> txf = t; r = OK
  fi
#endif
}

/* commit_remote, 3: insert the row and commit, releasing the fence row. */
/* A proposal, not the code (-DPROPOSE_ENDED_AT_COMMIT, with LEASE_BACKEND):
 * the commit's transaction also reads the task id's backend record and
 * refuses when it is a FAILURE celery-lease wrote: the task id has ended,
 * its FAILURE stands, the copy acks. docs/model.md, defects 2 and 4. */
#if defined(PROPOSE_ENDED_AT_COMMIT) && defined(LEASE_BACKEND)
#define ENDED_AT_COMMIT :: be_st[T] == FAILURE -> r = ENDED
#else
#define ENDED_AT_COMMIT
#endif

inline insert_row(w, k, T, t, r, txf) {
  /* @code celery_lease/sql/queries.py:_RESULT_ONCE_GUARD "WHERE NOT EXISTS (SELECT 1 FROM celery_lease_results WHERE lease_key = :key)" */
  if
  :: ONCE && acc_n[k] > 0 -> r = DUP
  ENDED_AT_COMMIT
  /* @code celery_lease/sql/queries.py:_RESULT_INSERT "ON CONFLICT (lease_key, fencing_token) DO NOTHING" */
  :: ROW(k, t) -> r = DUP
  :: else ->
     on_accept(k, t, T, w);
     if
     :: txf > fence[k] -> fence[k] = txf
     :: else -> skip
     fi;
     r = ACCEPTED
  fi;
  flock[k] = 0;
  w_cur_at_lock[w] = 0;
  txf = 0
}

/* A rollback: the connection's transaction ends, nothing it wrote stays. */
inline rollback(w, k, txf) {
  if
  :: flock[k] == w + 1 -> flock[k] = 0
  :: else -> skip
  fi;
  w_cur_at_lock[w] = 0;
  txf = 0
}

/* commit_colocated (PostgreSQL): one statement checks the lease row (and
 * releases it) and inserts only if it was still this owner's. */
inline commit_colocated(w, k, T, t, r) {
  touch(k);
  w_cur_at_lock[w] = CURRENT(k, t);
#ifndef MUT_B
  /* @code celery_lease/sql/queries.py:_pg_commit_colocated "AND l.fencing_token = :token AND l.expires_at > t.now" */
  if
  :: rec_tok[k] == t && rec_st[k] == LIVE ->
     unlive(k, TOMB);
     on_end(k, t);
#else
  /* mutation (b): accept a token newer than every committed one */
  if
  :: t > acc_new[k] || ROW(k, t) ->
     if
     :: rec_tok[k] == t && rec_st[k] == LIVE -> unlive(k, TOMB); on_end(k, t)
     :: else -> skip
     fi;
#endif
     /* @code celery_lease/sql/queries.py:_pg_commit_colocated "WHERE {owned}{\" AND NOT EXISTS (SELECT 1 FROM dup)\" if once else \"\"}" */
     if
     :: ONCE && acc_n[k] > 0 -> r = DUP
     ENDED_AT_COMMIT
     :: ROW(k, t) -> r = DUP
     :: else -> on_accept(k, t, T, w); r = ACCEPTED
     fi
  :: else ->
     /* @code celery_lease/result_commit.py:_commit_colocated_pg "if int(owned) != n:" */
     r = STALE
  fi;
  w_cur_at_lock[w] = 0
}

/* The trail's words (spin -t prints them; the search ignores printf). */
inline say_commit(w, t, r) {
  if
  :: r == ACCEPTED -> printf("@ w%d commit: accepted\n", w)
  :: r == STALE -> printf("@ w%d commit: the lease is not its own: stale\n", w)
  :: r == DUP -> printf("@ w%d commit: the insert finds a row: duplicate\n", w)
  :: r == ENDED -> printf("@ w%d commit: the task id has ended (its FAILURE stands)\n", w)
  :: r == UNAVAIL -> printf("@ w%d commit: no answer (lost reply)\n", w)
  :: else -> skip
  fi
}

inline say_release(w, t, r) {
  if
  :: r == YES -> printf("@ w%d releases token %d in the store: still the owner\n", w, t)
  :: r == NO -> printf("@ w%d releases token %d in the store: not the owner\n", w, t)
  :: else -> printf("@ w%d releases token %d in the store: no answer\n", w, t)
  fi
}
