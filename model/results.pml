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

/* The insert refuses a row of a task id that has an end mark, and that
 * refusal is the one reported (TaskEnded before DuplicateResult: the
 * FAILURE its end stands for stands, in once mode too). Mutation g, the
 * code before the end mark: no such guard. */
#if defined(PG_STATEMENT_CLOCK) && !defined(COLOCATED)
#error "PG_STATEMENT_CLOCK is the colocated commit's one statement"
#endif
#ifndef MUT_G
/* @code celery_lease/sql/queries.py:_ENDED_GUARD "NOT EXISTS (SELECT 1 FROM celery_lease_ended WHERE task_id = :task_id)" */
/* @code celery_lease/result_commit.py:_raise_if_ended "conn.execute(q.ENDED_FOR_TASK, {\"task_id\": task_id})" */
/* @code celery_lease/result_commit.py:_refused "_raise_if_ended(conn, row)" */
#ifndef PG_STATEMENT_CLOCK
#define ENDED_GUARD :: ended[T] -> r = ENDED
#define NOT_ENDED !ended[T] &&
#else
/* the colocated statement's guard reads its snapshot (dup, taken at its start) */
#define ENDED_GUARD :: dup -> r = ENDED
#define NOT_ENDED !dup &&
#endif
#else
#define ENDED_GUARD
#define NOT_ENDED
#endif

/* commit_remote, 3: insert the row and commit, releasing the fence row. */
inline insert_row(w, k, T, t, r, txf) {
  /* @code celery_lease/sql/queries.py:_RESULT_GUARDS "False: f\"WHERE {_ENDED_GUARD}\"," */
  /* @code celery_lease/sql/queries.py:_RESULT_ONCE_GUARD "WHERE NOT EXISTS (SELECT 1 FROM celery_lease_results WHERE lease_key = :key)" */
  if
  ENDED_GUARD
  :: NOT_ENDED ONCE && acc_n[k] > 0 -> r = DUP
  /* @code celery_lease/sql/queries.py:_RESULT_INSERT "ON CONFLICT (lease_key, fencing_token) DO NOTHING" */
  :: NOT_ENDED ROW(k, t) -> r = DUP
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
#ifndef PG_STATEMENT_CLOCK
  w_cur_at_lock[w] = CURRENT(k, t);
#endif
#ifndef MUT_B
  /* @code celery_lease/sql/queries.py:_pg_commit_colocated "AND l.fencing_token = :token AND l.expires_at > t.now" */
  if
#ifndef PG_STATEMENT_CLOCK
  :: rec_tok[k] == t && rec_st[k] == LIVE ->
     unlive(k, TOMB);
     on_end(k, t);
#else
  /* live by the statement's clock, and the row not claimed since */
  :: txf == 1 && next_tok[k] == t && rec_st[k] != TOMB ->
     if
     :: rec_st[k] == LIVE -> unlive(k, TOMB); on_end(k, t)
     :: else -> skip /* ran out in store time while the statement waited */
     fi;
#endif
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
     /* @code celery_lease/sql/queries.py:_pg_commit_colocated "AND {_ENDED_GUARD}" */
     /* @code celery_lease/result_commit.py:_commit_colocated_pg "_raise_if_ended(conn, row)" */
     if
     ENDED_GUARD
     :: NOT_ENDED ONCE && acc_n[k] > 0 -> r = DUP
     :: NOT_ENDED ROW(k, t) -> r = DUP
     :: else -> on_accept(k, t, T, w); r = ACCEPTED
     fi
  :: else ->
     /* @code celery_lease/result_commit.py:_commit_colocated_pg "if int(owned) != n:" */
     r = STALE
  fi;
#ifdef PG_STATEMENT_CLOCK
  txf = 0;
  dup = 0;
#endif
  w_cur_at_lock[w] = 0
}

/* The end mark, inside its transaction (result_end._mark): the task id's
 * end is recorded unless the table or the key says the task id is not
 * over. The transaction holds the key's fence row (leases elsewhere: the
 * store's record is read while it does) or its lease row (leases in this
 * database), the lock every commit of the key takes, so each commit is
 * before it or after it. why: E_NEWER, E_TAKEN_OVER or E_COMMIT. */
inline mark_end(k, T, t, why, r, hl, ht) {
#ifndef COLOCATED
  /* @code celery_lease/result_end.py:end_remote "conn.execute(q.RAISE_FENCE, {\"key\": lease.key, \"token\": lease.token, \"now\": conn.now()})" */
  if
  :: fence[k] == 0 -> fence[k] = t /* no fence row yet (never here: the marker registered) */
  :: else -> skip
  fi;
  /* @code celery_lease/result_end.py:end_remote "holder = store.inspect(lease.key)" */
#else
  /* @code celery_lease/result_end.py:end_colocated "row = conn.execute(table.db.sql.lease_row, {\"key\": lease.key}).first()" */
#endif
  st_inspect(k, hl, ht);
  /* @code celery_lease/result_end.py:_mark "if _has_ended(conn, task_id):" */
  if
  :: ended[T] -> r = ALREADY
  :: else ->
     /* @code celery_lease/result_end.py:_mark "if conn.execute(q.RESULT_FOR_TASK, {\"task_id\": task_id}).first() is not None:" */
     if
     :: task_acc[T] != 0 -> r = ACCEPTED
     :: else ->
        /* @code celery_lease/result_end.py:_mark "if holder.task_id == task_id and holder.token != lease.token:" */
        if
        :: hl && ht == T + 1 && rec_tok[k] != t -> r = COPY_HOLDS
#if defined(COLOCATED) && !defined(MUT_I)
        /* A lease row keeps its owner, token and task id when its lease runs
         * out (GONE here forgets them: next_tok and g_newest_task are what the
         * row holds); only a release (TOMB) or a new claim changes them.
         * Mutation i, the code before: live rows only. */
        /* @code celery_lease/result_end.py:_mark "if holder is not None and (holder.live or (colocated and holder.owner_id is not None)):" */
        :: rec_st[k] == GONE && g_newest_task[k] == T + 1 && next_tok[k] != t -> r = COPY_HOLDS
#endif
#ifndef MUT_H
        /* @code celery_lease/result_end.py:_mark "if take_over and holder.task_id is not None and _has_ended(conn, holder.task_id):" */
        /* @code celery_lease/result_end.py:_mark "elif take_over:" */
        :: why == E_TAKEN_OVER && (!hl || (ht != 0 && ended[ht - 1])) -> r = HOLDER_GONE
#endif
        :: else ->
           /* @code celery_lease/result_end.py:_mark "conn.execute(q.ENDED_INSERT, params)" */
           ended[T] = 1; r = MARKED
        fi
     fi
  fi
}

inline say_end(w, T, r) {
  if
  :: r == MARKED -> printf("@ w%d marks T%d ended\n", w, T)
  :: r == ALREADY -> printf("@ w%d marks T%d ended: marked before\n", w, T)
  :: r == ACCEPTED -> printf("@ w%d marks T%d ended: refused, a row of T%d is accepted\n", w, T, T)
  :: r == COPY_HOLDS -> printf("@ w%d marks T%d ended: refused, another copy of T%d holds the key\n", w, T, T)
  :: r == HOLDER_GONE -> printf("@ w%d marks T%d ended: refused, the holder is gone or ended\n", w, T)
  :: else -> printf("@ w%d marks T%d ended: no answer\n", w, T)
  fi
}

/* The trail's words (spin -t prints them; the search ignores printf). */
inline say_commit(w, t, r) {
  if
  :: r == ACCEPTED -> printf("@ w%d commit: accepted\n", w)
  :: r == STALE -> printf("@ w%d commit: the lease is not its own: stale\n", w)
  :: r == DUP -> printf("@ w%d commit: the insert finds a row: duplicate\n", w)
  :: r == ENDED -> printf("@ w%d commit: refused, the task id has an end mark\n", w)
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
