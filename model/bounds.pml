/*
 * The bounds of a check: every one a macro, overridden with -D on the spin
 * command line (tests/model/test_model.py passes the deep run's values).
 *
 * The defaults are the smallest system in which every fault can meet every
 * other one: two workers, two task ids on one key (so a duplicate and a
 * take-over by another task id exist), and one of each fault. The check is
 * exhaustive for these bounds: every interleaving of every step, with every
 * fault placed after every step, is explored.
 */

#ifndef NW
#define NW 2            /* workers (1..3): processes running task copies */
#endif
#ifndef NT
#define NT 2            /* task ids (1..3), task t on key t % NK */
#endif
#ifndef NK
#define NK 1            /* lease keys (1..2) */
#endif
#ifndef MODE
#define MODE 2          /* lease_mode: 0 "exclusive", 1 "once", 2 both (chosen at the start) */
#endif

/* Fault budgets: each is how many times that fault may happen in one run.
 * A finite budget is what "when faults stop" means for the liveness check. */
#ifndef MAX_CRASH
#define MAX_CRASH 1     /* a worker dies after any step (SIGKILL) */
#endif
#ifndef MAX_LOSS
#define MAX_LOSS 1      /* a store or database call fails or its reply is lost */
#endif
#ifndef MAX_PAUSE
#define MAX_PAUSE 1     /* store time passes a running holder's expiry (SIGSTOP, GC) */
#endif
#ifndef MAX_REDELIVER
#define MAX_REDELIVER 1 /* the broker delivers a running task id again */
#endif
#ifndef MAX_DATALOSS
#define MAX_DATALOSS 0  /* Redis only: a failover loses a key's last claim */
#endif

/* Guards on the model itself: a run that reaches them is too big for the
 * byte-sized state, and fails loudly instead of wrapping around. */
#define MAX_TOKEN 200
#define MAX_QUEUED 6
