"""The chaos suite's checker: the invariants of DESIGN.md, decided from independent records.

Inputs (all plain data, so the checker is tested on hand-made histories in
``tests/chaos/test_chaos_checker.py``):

* **submissions** -- what the harness published: task id, key, policy
  (``exclusive``, ``once``, ``once_return``);
* **attempts** -- one per task body that started, from the history file the
  task bodies append to (fsync'd, outside the plugin): task id, key, token,
  the grant's store time (``acquired_at``), the body's start and end in real
  time (the harness machine's clock, derived from ``CLOCK_MONOTONIC``, which
  libfaketime does not skew), the newest lease expiry (store time) the body
  saw confirmed by the grant or a renewal, and the outcome of its guarded
  write;
* **accepted** -- the rows of ``celery_lease_results`` (key, token, task id,
  ``accepted_at`` in the database's clock, the accepted value);
* **protected** -- the rows of the task bodies' own ``chaos_protected`` table,
  each written through ``celery_lease.fencing.guard(conn, key, token)``
  (``written_at`` in the database's clock, taken while the guard holds the
  key's fence row);
* **backend** -- each task id's state in the Celery result backend (and, for
  ``FAILURE``, the exception's type and arguments; for ``SUCCESS``, the value);
* **transport_lost** -- task ids of which the broker transport itself lost a
  message, proven from the Redis broker's append-only file
  (:mod:`tests.chaos.aof`): popped from a queue and never recorded as unacked.

Every clock involved (Redis ``TIME``, PostgreSQL ``clock_timestamp()``, the
harness's ``time.time()``) is the same machine's ``CLOCK_REALTIME``; worker
wall clocks (possibly skewed by libfaketime) are never used. ``EPS`` absorbs
the conversion between ``CLOCK_MONOTONIC`` and ``CLOCK_REALTIME``.

Definitions (the violation kinds it reports):

``reused_token``
    A token is granted once: two different attempts, or two different task
    ids in the result/protected tables, with one (key, token).
``token_order``
    Tokens per key strictly increase in grant order: sorted by the store time
    of the grant (``acquired_at``), tokens strictly increase.
``overlap``
    No two grants of one key are valid at the same store time. Grant *a* is
    provably valid from ``a.acquired_at`` until ``valid_lb(a)`` = the newest
    expiry a confirmed grant or renewal reported to its body, or the body's
    end if earlier (a lease is released only after its body ends, and a
    renewal extends only a lease that is still valid). For tokens
    ``a.token < b.token``: violation if ``b.acquired_at < valid_lb(a) - EPS``.
    And no two bodies of one key run at the same real time unless the older
    one's lease had lapsed: if the execution intervals ``[start, end]`` of
    *a* and *b* intersect, *a*'s commit must have been refused (no accepted
    row with ``a.token``).
``stale_write``
    No accepted result and no protected write carries a stale token. Per
    key, the accepted results and the protected writes, ordered by their
    database time (both taken under the key's fence-row lock, so that order
    is the commit order), must never show token *t* after token *t' > t*.
    And no write with token *t* may land after a body with a newer token
    started (``written_at > b.start + EPS``): that body's grant was
    registered in the fence row before it started.
``once_double``
    A ``once`` key has at most one accepted result.
``task_double_accept``
    A task id has at most one accepted result (a late copy of an accepted
    task id is never run again).
``phantom``
    Every accepted row and protected write comes from a body that ran with
    that key, token and task id.
``lost_task``
    Every submitted task id ends in a final backend state (``SUCCESS`` or
    ``FAILURE``). One whose message the Redis transport provably lost is
    counted apart (``broker_lost``), not as a violation; on RabbitMQ nothing
    may be lost, so there it is a violation too.
``lost_key``
    Every submitted key has an accepted result (no lost work); a key all of
    whose tasks the Redis transport lost is counted apart.
``lost_work``
    A task that ended ``FAILURE`` with a lease error (``StaleFencingToken``,
    ``LeaseLost``) was superseded: its key has an accepted result with a
    newer token (exclusive) or any accepted result (once). Otherwise the work
    was dropped with nobody newer doing it.
``accepted_outcome``
    Every task id whose result is accepted ends ``SUCCESS`` in the backend
    with the accepted value once the system settled: no ``PENDING``,
    ``STARTED``, ``RETRY`` or ``FAILURE`` left over an accepted success (a
    worker that died between the fenced commit and the backend write must
    not leave one). A ``once_return`` duplicate's ``SUCCESS`` carries its
    key's accepted value too. Values are compared where both are known.
``backend``
    The backend agrees with the result table: ``SUCCESS`` means an accepted
    row of that task id, or a ``once_return`` duplicate of a key that has one;
    ``FAILURE StaleFencingToken(key, t)`` means no accepted row (key, t).
``backend_flip``
    A final backend state is final: once a task id's state is ``SUCCESS`` or
    ``FAILURE``, no later write changes it (a client's ``get()`` would have
    returned or raised something else). Seen through the backend's pub/sub
    channel, which carries every write.
``stale_backend_write``
    No backend state of a leased task id is written by a copy whose token was
    stale when it wrote (DESIGN.md invariant 8), from the ``lease`` backend's
    own history (every row it wrote, with the writer's token and the
    database's time): per task id, a write by token *t* never follows one by
    a token *t' > t*, and never lands after a copy of the same task id was
    granted a newer token (``written_at > acquired_at + EPS``).
``ended_accept``
    No task id has both an end mark (``celery_lease_ended``: celery-lease
    decided its FAILURE after its result was refused) and an accepted row:
    the mark is refused once a copy was accepted, and every commit refuses a
    marked task id.
``ended_outcome``
    A task id with an end mark ends ``FAILURE`` once the system settled: its
    FAILURE stands, never turned ``SUCCESS`` by another copy.
``unexpected_failure``
    Any other ``FAILURE`` (``DuplicateResult`` is expected in ``once`` mode).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EPS",
    "FINAL",
    "UNKNOWN",
    "Accepted",
    "Attempt",
    "Backend",
    "History",
    "Protected",
    "Report",
    "Submission",
    "Violation",
    "check",
]

#: Seconds of tolerance between clocks of one machine (monotonic vs real time).
EPS = 0.05
FINAL = ("SUCCESS", "FAILURE")
LEASE_ERRORS = ("StaleFencingToken", "LeaseLost")


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


#: a value the records do not hold (not compared)
UNKNOWN: Any = _Unknown()


@dataclass(frozen=True)
class Submission:
    task_id: str
    key: str
    policy: str  # exclusive | once | once_return

    @property
    def mode(self) -> str:
        return "exclusive" if self.policy == "exclusive" else "once"


@dataclass
class Attempt:
    attempt: str
    task_id: str
    key: str
    token: int
    acquired_at: float
    start: float
    end: float | None = None
    expires: float = 0.0
    write: str | None = None  # ok | refused | error | None (never reached)
    hostname: str = ""
    pid: int = 0
    skew: str = ""

    @property
    def valid_lb(self) -> float:
        """Until when (store time) this grant was provably valid."""
        return min(self.expires, self.end) if self.end is not None else self.expires


@dataclass(frozen=True)
class Accepted:
    key: str
    token: int
    task_id: str | None
    accepted_at: float
    id: int = 0
    value: Any = field(default=UNKNOWN, compare=False)


@dataclass(frozen=True)
class Protected:
    key: str
    token: int
    task_id: str | None
    written_at: float
    id: int = 0


@dataclass(frozen=True)
class Backend:
    state: str
    exc_type: str | None = None
    exc_args: tuple[Any, ...] = ()
    #: the stored value of a ``SUCCESS``
    result: Any = field(default=UNKNOWN, compare=False)
    #: the writer's lease token and the write's database time, where the
    #: backend records them (the ``lease`` backend's history); None: unknown
    token: int | None = field(default=None, compare=False)
    written_at: float | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Violation:
    kind: str
    key: str | None
    detail: str

    def __str__(self) -> str:
        where = f" [{self.key}]" if self.key else ""
        return f"{self.kind}{where}: {self.detail}"


@dataclass
class History:
    submissions: list[Submission]
    attempts: list[Attempt]
    accepted: list[Accepted]
    protected: list[Protected]
    backend: dict[str, Backend]
    transport_lost: dict[str, str] = field(default_factory=dict)
    broker: str = "redis"
    #: every state the backend stored per task id, in order (None: not observed)
    backend_history: dict[str, list[Backend]] | None = None
    #: the end marks, task id -> the token that ended it
    ended: dict[str, int] = field(default_factory=dict)


@dataclass
class Report:
    violations: list[Violation]
    lost_plugin: list[str]
    lost_broker: list[str]
    lost_keys_broker: list[str]
    figures: dict[str, Any]

    @property
    def ok(self) -> bool:
        return not self.violations and not self.lost_plugin

    def by_kind(self) -> Counter[str]:
        return Counter(v.kind for v in self.violations)


def check(h: History) -> Report:
    """Decide every invariant on ``h``; see the module docstring for the definitions."""
    out: list[Violation] = []
    subs = {s.task_id: s for s in h.submissions}
    keys_mode = {s.key: s.mode for s in h.submissions}
    attempts_by_key: dict[str, list[Attempt]] = defaultdict(list)
    for a in _dedup_attempts(h.attempts):
        attempts_by_key[a.key].append(a)
    accepted_by_key: dict[str, list[Accepted]] = defaultdict(list)
    for r in h.accepted:
        accepted_by_key[r.key].append(r)
    protected_by_key: dict[str, list[Protected]] = defaultdict(list)
    for p in h.protected:
        protected_by_key[p.key].append(p)

    for key, attempts in attempts_by_key.items():
        out += _check_tokens(key, attempts)
        out += _check_overlap(key, attempts, {r.token for r in accepted_by_key.get(key, [])})
    for key in set(accepted_by_key) | set(protected_by_key):
        out += _check_writes(
            key,
            accepted_by_key.get(key, []),
            protected_by_key.get(key, []),
            attempts_by_key.get(key, []),
        )
    writers: dict[tuple[str, int], set[str | None]] = defaultdict(set)
    for r in h.accepted:
        writers[(r.key, r.token)].add(r.task_id)
    for p in h.protected:
        writers[(p.key, p.token)].add(p.task_id)
    for (key, token), ids in sorted(writers.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if len(ids) > 1:
            out.append(
                Violation(
                    "reused_token",
                    key,
                    f"token {token} wrote for {len(ids)} task ids: {sorted(map(str, ids))}",
                )
            )
    out += _check_phantoms(attempts_by_key, h.accepted, h.protected)
    for key, rows in accepted_by_key.items():
        if keys_mode.get(key) == "once" and len(rows) > 1:
            out.append(
                Violation(
                    "once_double",
                    key,
                    f"{len(rows)} accepted results in once mode: "
                    + ", ".join(f"token {r.token} by {r.task_id}" for r in rows),
                )
            )
    per_task = Counter(r.task_id for r in h.accepted if r.task_id)
    for task_id, n in per_task.items():
        if n > 1:
            where = subs[task_id].key if task_id in subs else None
            out.append(Violation("task_double_accept", where, f"task {task_id}: {n} accepted rows"))

    lost_plugin, lost_broker = [], []
    for s in h.submissions:
        b = h.backend.get(s.task_id)
        if b is not None and b.state in FINAL:
            continue
        state = b.state if b is not None else "no state"
        if s.task_id in h.transport_lost and h.broker == "redis":
            lost_broker.append(s.task_id)
            continue
        lost_plugin.append(s.task_id)
        why = f" (broker: {h.transport_lost[s.task_id]})" if s.task_id in h.transport_lost else ""
        out.append(Violation("lost_task", s.key, f"task {s.task_id} ended in {state}{why}"))
    lost_keys_broker = []
    tasks_by_key: dict[str, list[Submission]] = defaultdict(list)
    for s in h.submissions:
        tasks_by_key[s.key].append(s)
    for key, tasks in sorted(tasks_by_key.items()):
        if accepted_by_key.get(key):
            continue
        if h.broker == "redis" and all(t.task_id in h.transport_lost for t in tasks):
            lost_keys_broker.append(key)
            continue
        out.append(Violation("lost_key", key, f"no accepted result for {len(tasks)} task(s)"))
    out += _check_accepted_outcome(h, accepted_by_key)
    out += _check_ended(h, subs)
    out += _check_backend(h, subs, accepted_by_key, attempts_by_key)
    if h.backend_history is not None:
        out += _check_backend_history(h, subs)
        out += _check_backend_tokens(h, subs)

    figures = {
        "tasks": len(h.submissions),
        "keys": len(tasks_by_key),
        "executions": sum(len(v) for v in attempts_by_key.values()),
        "accepted": len(h.accepted),
        "protected_writes": len(h.protected),
        "writes_refused": sum(
            1 for v in attempts_by_key.values() for a in v if a.write == "refused"
        ),
        "lost_plugin": len(lost_plugin),
        "lost_broker": len(lost_broker),
        "ended": len(h.ended),
    }
    return Report(out, lost_plugin, lost_broker, lost_keys_broker, figures)


# -- the checks ---------------------------------------------------------------


def _dedup_attempts(attempts: Iterable[Attempt]) -> list[Attempt]:
    seen: dict[str, Attempt] = {}
    for a in attempts:
        seen.setdefault(a.attempt, a)
    return list(seen.values())


def _check_tokens(key: str, attempts: list[Attempt]) -> list[Violation]:
    out = []
    by_token: dict[int, list[Attempt]] = defaultdict(list)
    for a in attempts:
        by_token[a.token].append(a)
    for token, same in sorted(by_token.items()):
        if len(same) > 1:
            out.append(
                Violation(
                    "reused_token",
                    key,
                    f"token {token} granted to {len(same)} bodies: "
                    + ", ".join(f"{a.task_id}@{a.hostname}/{a.pid}" for a in same),
                )
            )
    ordered = sorted(attempts, key=lambda a: (a.acquired_at, a.token))
    for prev, nxt in itertools.pairwise(ordered):
        if nxt.token < prev.token:
            out.append(
                Violation(
                    "token_order",
                    key,
                    f"token {nxt.token} (granted at {nxt.acquired_at:.6f}) after token "
                    f"{prev.token} (granted at {prev.acquired_at:.6f})",
                )
            )
    return out


def _check_overlap(key: str, attempts: list[Attempt], accepted: set[int]) -> list[Violation]:
    out = []
    ordered = sorted(attempts, key=lambda a: a.token)
    for i, b in enumerate(ordered):
        for a in ordered[:i]:
            if a.token == b.token:
                continue  # reported as reused_token
            if b.acquired_at < a.valid_lb - EPS and b.acquired_at >= a.acquired_at - EPS:
                out.append(
                    Violation(
                        "overlap",
                        key,
                        f"token {b.token} ({b.task_id}) granted at {b.acquired_at:.3f} while "
                        f"token {a.token} ({a.task_id}) was valid until at least "
                        f"{a.valid_lb:.3f}",
                    )
                )
            a_end = a.end if a.end is not None else math.inf
            b_end = b.end if b.end is not None else math.inf
            if a.token in accepted and a.start < b_end - EPS and b.start < a_end - EPS:
                out.append(
                    Violation(
                        "overlap",
                        key,
                        f"bodies of token {a.token} ({a.task_id}) and token {b.token} "
                        f"({b.task_id}) ran at the same time and the older one's result "
                        "was accepted",
                    )
                )
    return out


def _check_writes(
    key: str, accepted: list[Accepted], protected: list[Protected], attempts: list[Attempt]
) -> list[Violation]:
    out = []
    events = [(r.accepted_at, 1, r.id, r.token, "result", r.task_id) for r in accepted]
    events += [(p.written_at, 0, p.id, p.token, "protected write", p.task_id) for p in protected]
    events.sort()
    newest: tuple[int, str, Any] | None = None
    for at, _, _, token, what, task_id in events:
        if newest is not None and token < newest[0]:
            out.append(
                Violation(
                    "stale_write",
                    key,
                    f"{what} with token {token} ({task_id}) at {at:.3f} after a {newest[1]} "
                    f"with token {newest[0]} ({newest[2]})",
                )
            )
        if newest is None or token > newest[0]:
            newest = (token, what, task_id)
    starts = sorted((a.start, a.token, a.task_id) for a in attempts)
    for at, _, _, token, what, task_id in events:
        for start, newer, newer_task in starts:
            if start > at - EPS:
                break
            if newer > token:
                out.append(
                    Violation(
                        "stale_write",
                        key,
                        f"{what} with token {token} ({task_id}) at {at:.3f} after the body of "
                        f"token {newer} ({newer_task}) started at {start:.3f}",
                    )
                )
                break
    return out


def _check_phantoms(
    attempts_by_key: Mapping[str, list[Attempt]],
    accepted: list[Accepted],
    protected: list[Protected],
) -> list[Violation]:
    ran = {(a.key, a.token, a.task_id) for v in attempts_by_key.values() for a in v}
    out = []
    for r in accepted:
        if (r.key, r.token, r.task_id) not in ran:
            out.append(
                Violation(
                    "phantom",
                    r.key,
                    f"accepted result token {r.token} ({r.task_id}) without a body that ran it",
                )
            )
    for p in protected:
        if (p.key, p.token, p.task_id) not in ran:
            out.append(
                Violation(
                    "phantom",
                    p.key,
                    f"protected write token {p.token} ({p.task_id}) without a body that ran it",
                )
            )
    return out


def _check_backend(
    h: History,
    subs: Mapping[str, Submission],
    accepted_by_key: Mapping[str, list[Accepted]],
    attempts_by_key: Mapping[str, list[Attempt]],
) -> list[Violation]:
    out = []
    rows_by_task: dict[str, list[Accepted]] = defaultdict(list)
    accepted_tokens = {(r.key, r.token) for r in h.accepted}
    for r in h.accepted:
        if r.task_id:
            rows_by_task[r.task_id].append(r)
    for s in h.submissions:
        b = h.backend.get(s.task_id)
        rows = rows_by_task.get(s.task_id, [])
        if b is None or b.state not in FINAL:
            continue
        key_rows = accepted_by_key.get(s.key, [])
        if b.state == "SUCCESS":
            if not rows and not (s.policy == "once_return" and key_rows):
                out.append(
                    Violation(
                        "backend",
                        s.key,
                        f"task {s.task_id} is SUCCESS without an accepted result",
                    )
                )
            continue
        if b.exc_type == "StaleFencingToken":
            token = _int(b.exc_args[1]) if len(b.exc_args) > 1 else None
            if token is not None and (s.key, token) in accepted_tokens:
                out.append(
                    Violation(
                        "backend",
                        s.key,
                        f"task {s.task_id} is FAILURE StaleFencingToken (token {token}) but "
                        "that token's result was accepted",
                    )
                )
        if b.exc_type in LEASE_ERRORS:
            mine = [a.token for a in attempts_by_key.get(s.key, []) if a.task_id == s.task_id]
            token = max(mine) if mine else None
            if b.exc_type == "StaleFencingToken" and len(b.exc_args) > 1:
                token = _int(b.exc_args[1])
            if s.mode == "once":
                superseded = bool(key_rows)
            else:
                superseded = token is not None and any(r.token > token for r in key_rows)
            if not superseded:
                out.append(
                    Violation(
                        "lost_work",
                        s.key,
                        f"task {s.task_id} ended FAILURE {b.exc_type} (token {token}) and no "
                        "newer result was accepted for its key",
                    )
                )
        elif b.exc_type == "DuplicateResult" and s.mode == "once":
            pass
        else:
            out.append(
                Violation(
                    "unexpected_failure",
                    s.key,
                    f"task {s.task_id} ended FAILURE {b.exc_type}{b.exc_args!r}",
                )
            )
    return out


def _check_accepted_outcome(
    h: History, accepted_by_key: Mapping[str, list[Accepted]]
) -> list[Violation]:
    out = []
    rows_by_task: dict[str, list[Accepted]] = defaultdict(list)
    for r in h.accepted:
        if r.task_id:
            rows_by_task[r.task_id].append(r)
    for s in h.submissions:
        b = h.backend.get(s.task_id)
        rows = rows_by_task.get(s.task_id)
        if rows:
            row = max(rows, key=lambda r: r.token)
            what = "its own accepted result"
        elif s.policy == "once_return" and b is not None and b.state == "SUCCESS":
            key_rows = accepted_by_key.get(s.key)
            if not key_rows:
                continue  # SUCCESS without a result: the backend check says so
            row = max(key_rows, key=lambda r: r.token)
            what = f"its key's accepted result (a duplicate of {row.task_id})"
        else:
            continue
        if b is None or b.state != "SUCCESS":
            unfinished = b is None or b.state not in FINAL
            if unfinished and s.task_id in h.transport_lost and h.broker == "redis":
                # The copy that would have stored SUCCESS (a redelivery, or the
                # deferral of one) was lost by the Redis transport itself, as
                # the AOF proves: counted with lost_broker, as for lost_task.
                continue
            state = b.state if b else "no state (PENDING)"
            if b is not None and b.exc_type:
                state = f"{state} {b.exc_type}{b.exc_args!r}"
            out.append(
                Violation(
                    "accepted_outcome",
                    s.key,
                    f"task {s.task_id} has an accepted result (token {row.token}) but the "
                    f"backend says {state}",
                )
            )
        elif UNKNOWN not in (b.result, row.value) and b.result != row.value:
            out.append(
                Violation(
                    "accepted_outcome",
                    s.key,
                    f"task {s.task_id} is SUCCESS with {b.result!r}, not {what} "
                    f"(token {row.token}): {row.value!r}",
                )
            )
    return out


def _check_ended(h: History, subs: Mapping[str, Submission]) -> list[Violation]:
    out = []
    accepted = {r.task_id: r for r in h.accepted if r.task_id}
    for task_id, token in sorted(h.ended.items()):
        key = subs[task_id].key if task_id in subs else None
        row = accepted.get(task_id)
        if row is not None:
            out.append(Violation("ended_accept", key, (
                f"task {task_id} was ended by token {token} and has an accepted row "
                f"(token {row.token})"
            )))  # fmt: skip
        b = h.backend.get(task_id)
        if b is not None and b.state != "FAILURE":
            out.append(Violation("ended_outcome", key, (
                f"task {task_id} was ended by token {token} but is {b.state} in the backend"
            )))  # fmt: skip
    return out


def _check_backend_history(h: History, subs: Mapping[str, Submission]) -> list[Violation]:
    out = []
    assert h.backend_history is not None
    for task_id, states in h.backend_history.items():
        final = [b for b in states if b.state in FINAL]
        if not final:
            continue
        first = final[0]
        changed = [b for b in final[1:] if (b.state, b.exc_type) != (first.state, first.exc_type)]
        if changed:
            key = subs[task_id].key if task_id in subs else None
            seq = " -> ".join(f"{b.state}{f' {b.exc_type}' if b.exc_type else ''}" for b in final)
            out.append(
                Violation("backend_flip", key, f"task {task_id}: final state changed: {seq}")
            )
    return out


def _check_backend_tokens(h: History, subs: Mapping[str, Submission]) -> list[Violation]:
    assert h.backend_history is not None
    grants: dict[str, list[Attempt]] = defaultdict(list)
    for a in h.attempts:
        grants[a.task_id].append(a)
    out = []
    for task_id, writes in h.backend_history.items():
        key = subs[task_id].key if task_id in subs else None
        newest: Backend | None = None
        for w in writes:
            if w.token is None:
                continue
            if newest is not None and newest.token is not None and w.token < newest.token:
                out.append(Violation("stale_backend_write", key, (
                    f"task {task_id}: {w.state} by token {w.token} after "
                    f"{newest.state} by token {newest.token}")))  # fmt: skip
            newer = [
                a for a in grants[task_id]
                if a.token > w.token and w.written_at is not None
                and w.written_at > a.acquired_at + EPS
            ]  # fmt: skip
            if newer:
                first = min(newer, key=lambda a: a.acquired_at)
                out.append(Violation("stale_backend_write", key, (
                    f"task {task_id}: {w.state} by token {w.token} written at "
                    f"{w.written_at:.3f}, after token {first.token} of the same task id "
                    f"was granted at {first.acquired_at:.3f}")))  # fmt: skip
            if newest is None or (newest.token or 0) <= w.token:
                newest = w
    return out


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None
