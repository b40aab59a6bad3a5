/*
 * The state every part of the model shares: the lease store's record per
 * key, the result database (fence rows, their locks, the accepted rows), the
 * Celery result backend, the broker's queue, the workers' view of their
 * grant, the fault budgets, and the ghost variables the properties read
 * (prefixed g_: no code reads them, they record what happened).
 */

#define KEY(t) ((t) % NK)

/* lease_mode of every task: fixed, or chosen once at the start (MODE 2) */
#if MODE == 2
bit once;
#define ONCE once
#else
#define ONCE MODE
#endif

/* The store's record of a key (rec_st). */
#define GONE 0          /* no lease: never claimed, expired, or deleted */
#define LIVE 1          /* granted and unexpired in store time */
#define TOMB 2          /* released, still answering its owner's repeated release */
#define LAG  3          /* etcd: the etcd lease ran out, the leader has not revoked it */

/* How the key's newest grant ended (g_end). */
#define VALID 0
#define RELEASED 1      /* released, committed, or superseded by its own owner */
#define EXPIRED 2       /* ran out in store time */

/* A task id's state in the result backend (be_st). */
#define PENDING 0
#define SUCCESS 1
#define FAILURE 2       /* a FAILURE celery-lease wrote: a LeaseError */

/* Outcomes of a step, kept apart from tokens (1..MAX_TOKEN). */
#define BUSY 0
#define ALREADY 246     /* the end mark: recorded before, by another copy */
#define HOLDER_GONE 247 /* the end mark: the holder's lease is gone, or its task id ended */
#define COPY_HOLDS 248  /* the end mark: another copy of the task id holds the key */
#define MARKED 249      /* the end mark: the task id's end is recorded */
#define ENDED 250       /* the commit: the task id has an end mark */
#define STALE 251
#define DUP 252
#define ACCEPTED 253
#define OK 254
#define UNAVAIL 255

/* Why a worker records its task id's end (the worker's nxt, on the way to
 * the end mark). */
#define E_NEWER 1       /* not_done.newer */
#define E_TAKEN_OVER 2  /* not_done.taken_over */
#define E_COMMIT 3      /* commit.ended */

/* Answers that may be unreadable (mine, hc). */
#define NO 0
#define YES 1
#define UNKNOWN 2
/* The holder (ht) unreadable: store.inspect failed (decide.Failed). */
#define H_FAILED 255

/* Lease store, per key. rec_tok survives GONE: it is the key's fence
 * counter (Redis), fence key revision (etcd) or lease row token (SQL). */
byte rec_st[NK];
byte rec_tok[NK];
byte rec_task[NK];      /* the grant's task id + 1 (the lease's meta) */
byte rec_owner[NK];     /* w + 1 while worker w's current claim loop owns it */
byte next_tok[NK];      /* the last token issued (etcd: next_tok[0], the revision) */
#if MAX_DATALOSS > 0
byte lost_st[NK];       /* the record before its last claim: what a failover restores */
byte lost_tok[NK];
byte lost_task[NK];
#endif

/* Result database. */
byte fence[NK];         /* celery_lease_fences.fencing_token (0: no row) */
byte flock[NK];         /* w + 1 while worker w's transaction holds the fence row */
byte acc_n[NK];         /* accepted rows of the key */
byte acc_new[NK];       /* the newest accepted token of the key (results.accepted) */
byte acc_new_task[NK];  /* its task id + 1 */
byte task_acc[NT];      /* the token of the task id's accepted row (0: none) */
bit ended[NT];          /* the task id's end mark (celery_lease_ended): no row of it is accepted any more */

/* Result backend: state, and the token whose value a SUCCESS carries. */
byte be_st[NT];
byte be_val[NT];
#ifdef LEASE_BACKEND
byte be_tok[NT];        /* the lease+ backend's record token (0: written without one) */
#endif

/* Broker: copies of each task id waiting, first deliveries and late copies
 * (a redelivery, a re-publish), and every message not acked yet. */
byte qfirst[NT];
byte qlate[NT];
byte msgs = NT;          /* set before init runs, so "settled" waits for the end */

/* Workers. */
bit started;            /* the first message was taken */
byte wtask[NW];         /* task id + 1 while executing a copy */
byte w_tok[NW];         /* the token of the grant the execution holds (0: none) */
bit w_lapsed[NW];       /* its local view ran out (never after the store's expiry) */
bit w_lost[NW];         /* a renewal was refused */
bit w_detached[NW];     /* past the body, or released: a refused renewal changes nothing */
bit w_cur_at_lock[NW];  /* ghost: the grant was current when the commit locked */

/* Fault budgets spent. */
byte crashes;
byte losses;
byte pauses;
byte redeliveries;
byte datalosses;

/* Ghosts. */
byte g_newest[NK];      /* the newest token granted for the key */
byte g_end[NK];         /* how that grant ended */
byte g_started[NK];     /* the newest token whose body started */
byte g_newest_task[NK]; /* the task id + 1 that newest grant went to */

/* A grant is current while it is the key's newest and has not run out. */
#define CURRENT(k, t) (g_newest[k] == (t) && g_end[k] != EXPIRED)

/* Worker w runs an execution holding the grant recorded for key k. */
#define HOLDS(w, k) (wtask[w] != 0 && KEY(wtask[w] - 1) == (k) && w_tok[w] == rec_tok[k] && w_tok[w] != 0)
#if NW == 1
#define HELD_BY_RUNNER(k) (HOLDS(0, k))
#elif NW == 2
#define HELD_BY_RUNNER(k) (HOLDS(0, k) || HOLDS(1, k))
#else
#define HELD_BY_RUNNER(k) (HOLDS(0, k) || HOLDS(1, k) || HOLDS(2, k))
#endif
