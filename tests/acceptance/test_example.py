"""The README's demo command runs the payment-API timeline to the end, no servers."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_command_plays_the_timeline(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {**os.environ, "EXAMPLE_DATA": str(data)}
    for name in list(env):  # the demo must not lean on any server the suite started
        if name.startswith(("CL_", "EXAMPLE_LEASE", "EXAMPLE_BROKER", "EXAMPLE_RESULT")):
            env.pop(name)
    proc = subprocess.run(
        ["scripts/demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr

    # The timeline, in order, as it happened.
    steps = [
        r"A claims payment-security-42 \(token (\d+)",
        r"B's copy \(\w+\) is deferred: A holds the lease \(LEASE_DEFERRED\)",
        r"A stalls \(SIGSTOP\)",
        r"A's lease lapses in store time",
        r"B takes over with token (\d+) > (\d+)",
        r"B commits its suite \(token (\d+)\): accepted",
        r"A's late commit is refused: FENCED",
        r"RESULT: A FENCED, B accepted",
    ]
    position = 0
    found: list[re.Match[str]] = []
    for step in steps:
        match = re.compile(step).search(out, position)
        assert match is not None, f"missing or out of order: {step!r}\n{out}"
        found.append(match)
        position = match.end()
    token_a = int(found[0].group(1))
    token_b = int(found[4].group(1))
    assert token_b > token_a

    # The embedded SQLite result table agrees: one accepted row, B's.
    with sqlite3.connect(data / "leases.db") as db:
        rows = db.execute(
            "SELECT fencing_token, result FROM celery_lease_results WHERE lease_key = ?",
            ("payment-security-42",),
        ).fetchall()
    assert [r[0] for r in rows] == [token_b]
    assert '"agent":"agent-b@demo"' in rows[0][1].replace(" ", "")
