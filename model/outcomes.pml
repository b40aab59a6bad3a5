/*
 * How an execution ends, included in the worker's body. Each outcome is
 * the row of celery_lease/decide.py named beside it.
 */

/* A release, then where nxt says (a failed release is logged: it expires).
 * Its answer is not read, so a lost reply to an applied release is the
 * delivered one: only "not applied" is a fault of its own. */
release:
  if
  CRASH
  :: atomic {
       /* @code celery_lease/renewal.py:HeldLease.release "self.detach()" */
       w_detached[w] = 1;
       /* @code celery_lease/execution.py:Execution.release "held.release()" */
       if
       :: true -> st_release(k, tok, r)
       :: LOSSY; r = UNAVAIL
       fi;
       say_release(w, tok, r)
     }
  fi;
  if
  :: nxt == N_ACK -> goto ack
  :: nxt == N_DEFER -> goto defer_out
  :: nxt == N_FAIL -> goto fail_ack
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
  :: r == UNKNOWN -> nxt = N_DEFER; goto release /* accepted.db_down */
  :: r == NO -> nxt = N_ACK; goto release       /* accepted.swept */
  :: else -> skip
  fi;
  /* @code celery_lease/decide.py:_accepted_redelivery "if s.own_state.status != SUCCESS:" */
  atomic { own = be_st[T] };
  if
  :: own == SUCCESS -> nxt = N_ACK; goto release /* accepted.present */
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
#ifdef SPARE_NOT_DONE_RACE
    CM_LEAVE
    cm_copies[T] == 0 -> nd_copies[T]++; nd_in = 1;
#endif
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
  /* @code celery_lease/decide.py:decide_not_done "mine = True if newer is not None and newer.task_id == s.task_id else s.mine" */
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
  /* @code celery_lease/decide.py:_leave_to_copy "if mine:" */
  if
  :: mine == YES ->
     /* @code celery_lease/decide.py:_leave_to_copy "if own_state is not None and own_state.status != SUCCESS:" */
     atomic { own = be_st[T] };
     if
     :: own != SUCCESS -> goto defer_out /* copy.unstored: DEFER */
     :: else -> goto ack                 /* copy.committed: LEAVE_TO_COPY */
     fi
  :: else -> skip
  fi;
  if
  :: hl && ht == T + 1 -> goto defer_out /* copy.holds: DEFER */
  :: else -> skip
  fi;
#ifndef MUT_E
  /* @code celery_lease/decide.py:_leave_to_copy "if mine is None or isinstance(holder, Failed):" */
  if
  :: mine == UNKNOWN || ht == H_FAILED -> goto defer_out /* copy.unreadable: DEFER */
  :: else -> skip
  fi;
#endif
  /* @code celery_lease/decide.py:decide_not_done "if newer is not None and s.token is not None and newer.token > s.token:" */
  if
  :: nw > tok -> goto fail_ack /* not_done.newer: STORE_FAILURE */
  :: else -> skip
  fi;
  if
  :: hl ->
     /* @code celery_lease/decide.py:_finished_elsewhere "if newer is not None and newer.task_id == holder.task_id:" */
     if
     :: ht != 0 && nwt == ht -> goto defer_out /* not_done.holder_ended: REQUEUE */
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
     :: hc == YES -> goto defer_out /* not_done.holder_ended */
     :: else -> skip
     fi;
     /* @code celery_lease/decide.py:_finished_elsewhere "return s.holder_state is not None and s.holder_state.lease_failure" */
     atomic { own = (ht != 0 -> be_st[ht - 1] : PENDING) };
     if
     :: own == FAILURE -> goto defer_out /* not_done.holder_ended */
     :: else -> goto fail_ack            /* not_done.taken_over: STORE_FAILURE */
     fi
  :: else -> goto defer_out              /* not_done.nobody: REQUEUE */
  fi
