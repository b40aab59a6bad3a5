"""The chaos suite's checker: the invariants of DESIGN.md, decided from independent records.

Inputs: the records of :mod:`tests.chaos.history`, which says what each
holds and where it comes from. Every time compared is the same machine's
real-time clock; ``EPS`` is the tolerance (the history module says why).

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
``chord_lost``, ``chord_callback``
    A chord's callback ends, with what its header gives
    (:mod:`tests.chaos.chord_checks`).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from tests.chaos.backend_checks import (
    check_accepted_outcome,
    check_backend,
    check_backend_history,
    check_backend_tokens,
    check_ended,
)
from tests.chaos.chord_checks import check_chords
from tests.chaos.history import (
    EPS,
    FINAL,
    UNKNOWN,
    Accepted,
    Attempt,
    Backend,
    Chord,
    History,
    Protected,
    Report,
    Submission,
    Violation,
)

# The record types are re-exported: the runner and the tests build histories
# from this module's names.
__all__ = [
    "EPS",
    "FINAL",
    "UNKNOWN",
    "Accepted",
    "Attempt",
    "Backend",
    "Chord",
    "History",
    "Protected",
    "Report",
    "Submission",
    "Violation",
    "check",
]


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
    out += check_accepted_outcome(h, accepted_by_key)
    out += check_ended(h, subs)
    out += check_backend(h, subs, accepted_by_key, attempts_by_key)
    if h.backend_history is not None:
        out += check_backend_history(h, subs)
        out += check_backend_tokens(h, subs)
    chord_violations, chord_figures = check_chords(h.chords, h.backend, h.callbacks, h.collected)
    out += chord_violations

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
    if h.chords:
        figures.update(chord_figures)
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
