"""The chaos checker's chord invariants (a run with ``--chords``, the ``lease`` backend).

A chord's header members are ``chaos.exclusive`` tasks (submissions like any
other, judged by every other invariant); its callback, ``chaos.collect``,
records each run and the values it got (``collected`` lines of the history).
Once the system settled, with every member in a final state:

``chord_lost``
    The callback reached a final state: a chord whose last member's worker
    died between its count and the callback's publish is finished by another
    worker, never left waiting.
``chord_callback``
    The callback's outcome is what its header gives. Every member ``SUCCESS``:
    the callback ``SUCCESS`` with the members' stored values in header order,
    and every run of it (it may run more than once: at least once delivery)
    got exactly those values. A member ``FAILURE``: the callback ``FAILURE``
    (``ChordError``) and no run of it.

A chord with a member not final is judged by ``lost_task`` alone (a member the
Redis transport provably lost is counted apart there, and its chord here).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.chaos.history import FINAL, Backend, Chord, Violation

__all__ = ["check_chords", "count_recovered", "read_collected"]


def read_collected(path: Path) -> dict[str, list[Any]]:
    """Each callback run's values, per callback task id, from the history file."""
    runs: dict[str, list[Any]] = defaultdict(list)
    if not path.exists():
        return runs
    for line in path.read_bytes().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn line of a killed process
        if rec.get("ev") == "collected":
            runs[rec["task_id"]].append(rec["values"])
    return runs


def count_recovered(logdir: Path) -> int:
    """How many callbacks the workers' look for chords due published (their logs)."""
    return sum(
        path.read_text(errors="replace").count("publishing it now")
        for path in logdir.glob("worker-*.log")
    )


def check_chords(
    chords: list[Chord],
    backend: Mapping[str, Backend],
    callbacks: Mapping[str, Backend],
    collected: Mapping[str, list[Any]],
) -> tuple[list[Violation], dict[str, int]]:
    """The violations of ``chord_lost`` and ``chord_callback``, and the chords'
    figures, from the members' states (``backend``) and the callbacks'."""
    out: list[Violation] = []
    figures = {"chords": len(chords), "chords_succeeded": 0, "chords_failed": 0}
    figures["chords_member_lost"] = 0
    figures["chord_callback_runs"] = sum(len(collected.get(c.callback_id, ())) for c in chords)
    for c in chords:
        found = [backend.get(t) for t in c.members]
        members = [m for m in found if m is not None and m.state in FINAL]
        if len(members) < len(found):  # a lost member: lost_task's, or the transport's
            figures["chords_member_lost"] += 1
            continue
        callback = callbacks.get(c.callback_id)
        runs = collected.get(c.callback_id, [])
        where = f"chord {c.callback_id}"
        if callback is None or callback.state not in FINAL:
            state = callback.state if callback else "PENDING"
            out.append(Violation("chord_lost", None, f"{where}: callback {state}, runs {runs}"))
            continue
        if all(m.state == "SUCCESS" for m in members):
            want = [m.result for m in members]
            wrong = [r for r in runs if r != want]
            if callback.state != "SUCCESS" or not runs or wrong:
                out.append(
                    Violation(
                        "chord_callback",
                        None,
                        f"{where}: header {want}, callback {callback.state} "
                        f"{callback.result!r}, runs {runs}",
                    )
                )
            elif callback.result != want:
                out.append(
                    Violation("chord_callback", None, f"{where}: stored {callback.result!r}")
                )
            else:
                figures["chords_succeeded"] += 1
        elif callback.state != "FAILURE" or callback.exc_type != "ChordError" or runs:
            out.append(
                Violation(
                    "chord_callback",
                    None,
                    f"{where}: a member failed, callback {callback.state} "
                    f"{callback.exc_type}, runs {runs}",
                )
            )
        else:
            figures["chords_failed"] += 1
    return out, figures
