/*
 * How an execution ends, included in the worker's body. Each outcome is
 * the row of celery_lease/decide/ named beside it.
 */

/* A release, then where nxt says (a failed release is logged: it expires).
 * Its answer is not read, so a lost reply to an applied release is the
 * delivered one: only "not applied" is a fault of its own. */
release:
  if
  CRASH
  :: atomic {
       /* @code celery_lease/renewal.py:HeldLease._releasing "self.detach()" */
       w_detached[w] = 1;
       /* @code celery_lease/execution.py:Execution.release "held.release_later(failed)" */
       if
       :: true -> st_release(k, tok, r)
       :: LOSSY; r = UNAVAIL
       fi;
       say_release(w, tok, r)
     }
  fi;
  if
  :: nxt == N_ACK -> nxt = 0; SPENT goto ack
  :: nxt == N_DEFER -> nxt = 0; SPENT goto defer_out
  :: nxt == N_FAIL -> nxt = 0; SPENT goto fail_ack
  fi;

/* DEFER and REQUEUE: publish a copy of this task id, then ack this one. */
defer_out:
  if
  CRASH
  :: atomic {
       /* @code celery_lease/requeue.py:_publish "sig.apply_async()" */
       qlate[T]++;
       msgs++;
       assert(qlate[T] <= MAX_QUEUED);
       printf("@ w%d re-publishes T%d (defer or re-queue)\n", w, T)
     }
  fi;
  goto ack;

/* The end mark (Execution.end, decide.decide_end): before celery-lease
 * stores FAILURE for a task id whose result was not accepted, it records
 * the task id's end in the result database (one transaction, mark_end in
 * model/results.pml); every commit refuses the rows of a task id that has
 * one. Mutation g, the code before the fix: the FAILURE at once, no mark. */
#ifdef MUT_G
#define TO_END(why) SPENT goto fail_ack
#else
/* @code celery_lease/execution.py:Execution.not_done "self.end(exc, state, take_over=outcome.row == \"not_done.taken_over\")" */
#define TO_END(why) SPENT nxt = why; goto end_mark
#endif
end_mark:
  if
  CRASH
  :: atomic {
#ifndef COLOCATED
       /* @code celery_lease/result_end.py:end_remote "if conn.execute(db.sql.lock_fence, {\"key\": lease.key}).scalar() is None:" */
       flock[k] == 0 ->
#endif
       /* @code celery_lease/reads.py:Reads.read "mark = results.end(self.ex.held.lease, self.ex.task_id, take_over=facts.take_over)" */
       if
       :: true -> mark_end(k, T, tok, nxt, r, hl, ht)
       :: LOSSY; mark_end(k, T, tok, nxt, r, hl, ht); r = UNAVAIL
       :: LOSSY; r = UNAVAIL
       fi;
       say_end(w, T, r);
       nxt = 0;
       /* @code celery_lease/decide/finish.py:decide_end "return Outcome(\"end.marked\", Act.STORE_FAILURE)" */
       /* @code celery_lease/decide/finish.py:decide_end "return Outcome(\"end.copy_holds\", Act.DEFER, why, countdown=s.answer.remaining)" */
       /* @code celery_lease/decide/finish.py:decide_end "return _requeue(\"end.holder_gone\")" */
       if
       :: r == MARKED -> SPENT goto fail_ack /* end.marked: STORE_FAILURE */
       :: r == ALREADY -> SPENT goto end_before
       :: else -> SPENT goto defer_out       /* end.accepted, end.copy_holds, end.unavailable: DEFER; end.holder_gone: REQUEUE */
       fi
     }
  fi;

/* Recorded before by another copy: its FAILURE stands, unless that copy
 * died before storing it (decide._ended_before reads the backend first). */
end_before:
  atomic {
    /* @code celery_lease/decide/finish.py:_ended_before "if s.own_state.status in (SUCCESS, FAILURE):" */
    if
    :: own = be_st[T]
    :: LOSSY; own = UNAVAIL
    fi
  };
  if
  :: own == UNAVAIL -> SPENT goto defer_out /* end.backend_down: DEFER */
  :: own == PENDING -> SPENT goto fail_ack  /* end.unstored: STORE_FAILURE */
  :: else -> SPENT goto ack                 /* end.stored: REJECT_ENDED */
  fi;

/* A FAILURE celery-lease stores (FENCED, a duplicate), then Ignore. */
fail_ack:
  if
  CRASH
  :: atomic {
       /* @code celery_lease/execution.py:Execution._store_failure "self.task.backend.mark_as_failure(self.task_id, exc, request=self.req)" */
       printf("@ w%d writes T%d FAILURE (token %d)\n", w, T, tok);
       be_write_fenced(T, FAILURE, 0, tok)
     }
  fi;
  goto ack;

/* The message is acked: this copy is done (Ignore, or the task returned). */
ack:
  atomic {
    /* @code celery_lease/execution.py:Execution.carry_out "raise Ignore()" */
    printf("@ w%d acks T%d\n", w, T);
    msgs--;
    RESET_LOCALS
  };
  goto end_idle;

/* A late copy of a task id whose result is accepted: never run it again,
 * make the backend say what the table says (decide._accepted_redelivery). */
copy_of_accepted:
  atomic {
    /* @code celery_lease/reads.py:Reads.read "self.accepted = results.get(self.ex.key, self.ex.prepared.task_token)" */
    if
    :: r = (ROW(k, at) -> YES : NO)
    :: LOSSY; r = UNKNOWN
    fi
  };
  if
  :: r == UNKNOWN -> SPENT nxt = N_DEFER; goto release /* accepted.db_down */
  :: r == NO -> SPENT nxt = N_ACK; goto release       /* accepted.swept */
  :: else -> skip
  fi;
  /* @code celery_lease/decide/start.py:_accepted_redelivery "if s.own_state.status != SUCCESS:" */
  atomic { own = be_st[T] };
  if
  :: own == SUCCESS -> SPENT nxt = N_ACK; goto release /* accepted.present */
  :: else -> skip
  fi;
  if
  CRASH
  :: atomic {
       /* accepted.store: while this copy still holds the lease */
       /* @code celery_lease/execution.py:Execution.prepare "self.task_id, self.reads.accepted.value, request=self.req" */
       printf("@ w%d writes T%d SUCCESS with the accepted value of token %d (token %d)\n", w, T, at, tok);
       be_write_fenced(T, SUCCESS, at, tok)
     }
  fi;
  nxt = N_ACK;
  goto release;

/* The body ran, its result was not accepted (decide.decide_not_done): the
 * reads one by one, each its own round trip, each may fail. */
not_done:
  atomic {
    /* @code celery_lease/reads.py:Reads._read_newer_and_holder "accepted = self.ex.rt.results.accepted(self.ex.key, self.ex.tenant)" */
    if
    :: nw = acc_new[k]; nwt = acc_new_task[k]
    :: LOSSY; nw = 0; nwt = 0 /* Failed: no newer row to go by */
    fi
  };
  atomic {
    /* @code celery_lease/reads.py:Reads._read_newer_and_holder "holder: Holder | Failed | None = _holder(self.ex.rt.store.inspect(self.ex.key))" */
    if
    :: st_inspect(k, hl, ht)
    :: LOSSY; hl = 0; ht = H_FAILED
    fi;
    if
    :: ht == H_FAILED -> printf("@ w%d not done: newest accepted token %d; the holder unreadable\n", w, nw)
    :: ht != 0 && ht != H_FAILED -> printf("@ w%d not done: newest accepted token %d; holder: T%d, live %d\n", w, nw, ht - 1, hl)
    :: else -> printf("@ w%d not done: newest accepted token %d; no holder\n", w, nw)
    fi
  };
#ifndef MUT_E
  /* @code celery_lease/decide/finish.py:decide_not_done "mine = True if newer is not None and newer.task_id == s.task_id else s.mine" */
  if
  :: nwt == T + 1 -> mine = YES; goto nd_decide
  :: else -> skip
  fi;
#endif
  atomic {
    /* @code celery_lease/reads.py:Reads.read "return {\"mine\": results.for_task(self.ex.task_id) is not None}" */
    if
    :: mine = (task_acc[T] != 0 -> YES : NO)
    :: LOSSY; mine = UNKNOWN
    fi;
    printf("@ w%d not done: did T%d commit elsewhere? %d (0 no, 1 yes, 2 unreadable)\n", w, T, mine)
  };
nd_decide:
  /* @code celery_lease/decide/finish.py:_leave_to_copy "if mine:" */
  if
  :: mine == YES ->
     /* @code celery_lease/decide/finish.py:_leave_to_copy "if own_state is not None and own_state.status != SUCCESS:" */
     atomic { own = be_st[T] };
     if
     :: own != SUCCESS -> SPENT goto defer_out /* copy.unstored: DEFER */
     :: else -> SPENT goto ack                 /* copy.committed: LEAVE_TO_COPY */
     fi
  :: else -> skip
  fi;
  if
  :: hl && ht == T + 1 -> SPENT goto defer_out /* copy.holds: DEFER */
  :: else -> skip
  fi;
#ifndef MUT_E
  /* @code celery_lease/decide/finish.py:_leave_to_copy "if mine is None or isinstance(holder, Failed):" */
  if
  :: mine == UNKNOWN || ht == H_FAILED -> SPENT goto defer_out /* copy.unreadable: DEFER */
  :: else -> skip
  fi;
#endif
  /* @code celery_lease/decide/finish.py:decide_not_done "if newer is not None and s.token is not None and newer.token > s.token:" */
  if
  :: nw > tok -> TO_END(E_NEWER) /* not_done.newer: STORE_FAILURE */
  :: else -> skip
  fi;
  if
  :: hl ->
     /* @code celery_lease/decide/finish.py:_finished_elsewhere "if newer is not None and newer.task_id == holder.task_id:" */
     if
     :: ht != 0 && nwt == ht -> SPENT goto defer_out /* not_done.holder_ended: REQUEUE */
     :: else -> skip
     fi;
     atomic {
       /* @code celery_lease/reads.py:Reads.read "return {\"holder_committed\": results.for_task(facts.holder.task_id) is not None}" */
       if
       :: hc = (ht != 0 && task_acc[ht - 1] != 0 -> YES : NO)
       :: LOSSY; hc = UNKNOWN
       fi
     };
     if
     :: hc == YES -> SPENT goto defer_out /* not_done.holder_ended */
     :: else -> skip
     fi;
     /* @code celery_lease/decide/finish.py:_finished_elsewhere "return s.holder_state is not None and s.holder_state.lease_failure" */
     atomic { own = (ht != 0 -> be_st[ht - 1] : PENDING) };
     if
     :: own == FAILURE -> SPENT goto defer_out /* not_done.holder_ended */
     :: else -> TO_END(E_TAKEN_OVER)    /* not_done.taken_over: STORE_FAILURE */
     fi
  :: else -> SPENT goto defer_out              /* not_done.nobody: REQUEUE */
  fi
