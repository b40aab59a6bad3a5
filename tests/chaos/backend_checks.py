"""The chaos checker's checks of what the result backend says of each task id
(the kinds ``backend``, ``lost_work``, ``unexpected_failure``,
``accepted_outcome``, ``ended_accept``, ``ended_outcome``, ``backend_flip``
and ``stale_backend_write``, defined in :mod:`tests.chaos.checker`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from tests.chaos.history import (
    EPS,
    FINAL,
    LEASE_ERRORS,
    UNKNOWN,
    Accepted,
    Attempt,
    Backend,
    History,
    Submission,
    Violation,
)

__all__ = [
    "check_accepted_outcome",
    "check_backend",
    "check_backend_history",
    "check_backend_tokens",
    "check_ended",
]


def check_backend(
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


def check_accepted_outcome(
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


def check_ended(h: History, subs: Mapping[str, Submission]) -> list[Violation]:
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


def check_backend_history(h: History, subs: Mapping[str, Submission]) -> list[Violation]:
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


def check_backend_tokens(h: History, subs: Mapping[str, Submission]) -> list[Violation]:
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
