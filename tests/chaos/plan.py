"""The chaos run's seeded plans: the tasks it submits, and its chords (``--chords``).

Each is a pure function of the options (seed included), so a run's plan is
reproduced by its options, whatever the machine's timing.
"""

from __future__ import annotations

import random
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.chaos.runner import Options

__all__ = ["CHORD_SIZE", "COVER_BATCH", "cover_items", "plan", "plan_chords"]


def _keys(opts: Options) -> tuple[list[str], list[str]]:
    """The run's keys: ``exclusive`` ones (``x..``), and ``once`` ones (``o..``)."""
    n_once = max(1, round(opts.keys * 0.35))
    n_excl = max(1, opts.keys - n_once)
    return [f"x{i:02d}" for i in range(n_excl)], [f"o{i:02d}" for i in range(n_once)]


def plan(opts: Options) -> list[dict[str, Any]]:
    """The seeded submission plan: when, which task id, key, policy, duration."""
    rng = random.Random(opts.seed)
    excl, once = _keys(opts)
    window = opts.duration * 0.7
    out = []
    for n in range(opts.tasks):
        r = rng.random()
        if r < 0.7:
            policy, key = "exclusive", rng.choice(excl)
        else:
            policy = "once" if rng.random() < 0.5 else "once_return"
            key = rng.choice(once)
        d = rng.random()
        if d < 0.55:
            duration = rng.uniform(0.05, 1.0)
        elif d < 0.85:
            duration = rng.uniform(1.0, opts.ttl)
        else:
            duration = rng.uniform(opts.ttl, 3 * opts.ttl)
        out.append(
            {
                "n": n,
                "at": window * n / max(1, opts.tasks),
                "task_id": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                "key": key,
                "policy": policy,
                "duration": round(duration, 3),
            }
        )
    # Every key gets work even in tiny runs.
    for i, key in enumerate(excl + once):
        if i < len(out) and key not in {p["key"] for p in out}:
            out[i]["key"] = key
            out[i]["policy"] = "exclusive" if key.startswith("x") else "once"
    return out


#: tasks published with each fault of the cover phase
COVER_BATCH = 4


def cover_items(opts: Options, rng: random.Random, first_n: int) -> list[dict[str, Any]]:
    """Work for the cover phase: it injects the kinds a short run never applied,
    after the plan's last submission, and a fault that meets an idle cluster
    proves nothing. Exclusive tasks on the run's own keys (contended with what
    is still in flight), bodies of up to the TTL; numbered from ``first_n``."""
    excl, _ = _keys(opts)
    return [
        {
            "n": first_n + i,
            "task_id": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            "key": rng.choice(excl),
            "policy": "exclusive",
            "duration": round(rng.uniform(0.05, opts.ttl), 3),
            "cover": True,
        }
        for i in range(COVER_BATCH)
    ]


#: header members per chord
CHORD_SIZE = 3


def plan_chords(opts: Options) -> list[dict[str, Any]]:
    """The seeded chords: when, the callback's task id, and the members (task
    id, key, duration), on the exclusive keys, with bodies of up to the TTL."""
    rng = random.Random(opts.seed * 104729 + 3)
    excl, _ = _keys(opts)
    window = opts.duration * 0.7

    def new_id() -> str:
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    out = []
    for c in range(opts.chords):
        members = [
            {
                "n": 100_000 + c * CHORD_SIZE + m,
                "task_id": new_id(),
                "key": rng.choice(excl),
                "policy": "exclusive",
                "duration": round(rng.uniform(0.05, opts.ttl), 3),
            }
            for m in range(CHORD_SIZE)
        ]
        out.append({"at": window * (c + 0.5) / opts.chords, "callback_id": new_id(),
                    "members": members})  # fmt: skip
    return out
