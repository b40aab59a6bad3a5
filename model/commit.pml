/*
 * The fenced commit, included in the worker's body (it uses its locals).
 * Outcomes as decide.decide_commit has them: ACCEPTED -> committed, STALE
 * -> not_done (FENCED), DUP -> the duplicate's FAILURE, ENDED (the task id
 * has an end mark) -> the end mark's FAILURE, UNAVAIL -> retry while the
 * lease's local view lasts, else re-queue.
 */

commit:
#ifdef COLOCATED
#ifdef PG_STATEMENT_CLOCK
  /* PostgreSQL's READ COMMITTED, to the letter: the statement reads the
   * clock (its CTE t) and takes its snapshot when it starts, then waits for
   * the lease row's lock; after the wait it checks the row's latest version
   * against that clock, and reads the end marks in that snapshot. Its start
   * is a read of its own (txf: the lease live by that clock, dup: the task
   * id's end mark in that snapshot). docs/model.md, finding 5. */
  atomic {
    /* @code celery_lease/sql/queries.py:_pg_commit_colocated "WITH t AS (SELECT {_PG_NOW} AS now)," */
    touch(k);
    txf = (rec_tok[k] == tok && rec_st[k] == LIVE -> 1 : 0);
    dup = ended[T];
    w_cur_at_lock[w] = CURRENT(k, tok);
    printf("@ w%d commit: the statement starts: by its clock the lease is live: %d; in its snapshot T%d has an end mark: %d\n", w, txf, T, dup)
  };
#endif
  if
  CRASH
  :: atomic {
       /* @code celery_lease/result_commit.py:_commit_colocated_pg "out = table.db.pg_first(statements[release, once, True], row)" */
       if
       :: true -> commit_colocated(w, k, T, tok, r)
       :: LOSSY; commit_colocated(w, k, T, tok, r); r = UNAVAIL
       :: LOSSY; r = UNAVAIL
       fi;
       say_commit(w, tok, r)
     }
  fi;
#else
#ifdef MUT_C
  /* mutation (c): the ownership check before the fence row is locked */
  if
  CRASH
  :: atomic {
       if
       :: true -> st_release(k, tok, r)
       :: LOSSY; st_release(k, tok, r); r = UNAVAIL
       :: LOSSY; r = UNAVAIL
       fi;
       say_release(w, tok, r)
     }
  fi;
  if
  :: r == NO -> r = STALE; goto c_caught
  :: r == UNAVAIL -> goto c_unavail
  :: else -> skip
  fi;
#endif
  /* 1. lock the key's fence row; a newer registered token: stale (a lock
   * that fails is the lock, then step 2 failing at once) */
  if
  CRASH
  :: atomic {
       flock[k] == 0 ->
       fence_lock(w, k, tok, r, txf);
       if
       :: r == OK -> printf("@ w%d commit: locks the fence row (%d), token %d\n", w, fence[k], tok)
       :: r == STALE -> printf("@ w%d commit: fence row %d is newer than token %d: stale\n", w, fence[k], tok)
       :: else -> printf("@ w%d commit: the lock fails (lost connection)\n", w)
       fi
     }
  fi;
  if
  :: r == STALE -> goto c_caught
  :: r == UNAVAIL -> goto c_unavail
  :: else -> skip
  fi;
#ifndef MUT_C
  /* 2. ask the lease store, releasing, while the transaction holds the row */
  if
  CRASH
  :: atomic {
       /* @code celery_lease/result_commit.py:commit_remote "still_owner = store.release(lease) if release else store.renew(lease)" */
       if
       :: true -> st_release(k, tok, r)
       :: LOSSY; st_release(k, tok, r); r = UNAVAIL
       :: LOSSY; r = UNAVAIL
       fi;
       say_release(w, tok, r);
       if
       :: r == YES -> skip
       :: else -> rollback(w, k, txf)
       fi
     }
  fi;
  if
  :: r == NO -> r = STALE; goto c_caught
  :: r == UNAVAIL -> goto c_unavail
  :: else -> skip
  fi;
#endif
  /* 3. insert the row, commit */
  if
  CRASH
  :: atomic {
       /* @code celery_lease/result_commit.py:commit_remote "return insert(db, conn, row, mode == \"once\", commit=True, meta=meta)" */
       if
       :: true -> insert_row(w, k, T, tok, r, txf)
       :: LOSSY; insert_row(w, k, T, tok, r, txf); r = UNAVAIL
       :: LOSSY; rollback(w, k, txf); r = UNAVAIL
       fi;
       say_commit(w, tok, r)
     }
  fi;
#endif
  if
  :: r == ACCEPTED -> goto committed
  :: r == UNAVAIL -> goto c_unavail
  :: else -> skip
  fi;

/* StaleFencingToken or DuplicateResult: an earlier attempt of this very
 * commit may have been accepted (its reply lost): its row says so. */
c_caught:
  atomic {
    /* @code celery_lease/results.py:ResultTable.commit "existing = self.get(lease.key, lease.token)" */
    if
    :: ROW(k, tok) -> r = ACCEPTED; printf("@ w%d commit: finds its own row (%d): accepted\n", w, tok)
    :: else -> skip
    fi
  };
  if
  :: r == ACCEPTED -> goto committed
  :: r == STALE -> goto not_done      /* commit.fenced */
  :: r == DUP -> SPENT goto fail_ack        /* commit.duplicate -> duplicate.reject */
  /* @code celery_lease/decide/finish.py:decide_commit "return Outcome(\"commit.ended\", Act.STORE_FAILURE)" */
  :: r == ENDED -> SPENT nxt = E_COMMIT; goto end_mark /* commit.ended -> end.* */
  fi;

/* commit.retry while the local view lasts, else commit.unknown: re-queue
 * (a copy that finds the row accepted stores it), then the release. */
c_unavail:
  /* @code celery_lease/decide/finish.py:decide_commit "return Outcome(\"commit.unknown\", Act.REQUEUE, \"commit outcome unknown\", note=note)" */
  if
  :: !w_lapsed[w] -> goto commit
  :: true -> skip
  fi;
  if
  CRASH
  :: atomic { qlate[T]++; msgs++; assert(qlate[T] <= MAX_QUEUED); printf("@ w%d re-queues T%d (commit outcome unknown)\n", w, T) }
  fi;
  nxt = N_ACK;
  goto release;
