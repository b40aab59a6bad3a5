"""The chaos run's figures as the table it prints (and .ci/run's log shows)."""

from __future__ import annotations

import json
from typing import Any

from tests.chaos import liveness, stacks
from tests.chaos.history import Report


def format_table(f: dict[str, Any], report: Report) -> str:
    rows: list[tuple[str, str]] = [
        ("broker", str(f["broker"])),
        ("lease store", str(f["store"])),
        ("result backend", str(f["backend"])),
        (
            "backend writes recorded (every write; with a token)",
            f"{f['backend_writes']} ({f['backend_writes_tokened']})",
        ),
        ("seed", str(f["seed"])),
        ("fault-injection duration (s)", str(f["duration_s"])),
        ("workers", str(f["workers"])),
        ("tasks", str(f["tasks"])),
        ("keys", str(f["keys"])),
        ("executions (bodies started)", str(f["executions"])),
        ("deliveries run (task_prerun)", str(f["prerun"])),
        ("accepted results", str(f["accepted"])),
        ("task ids ended by celery-lease (end marks)", str(f["ended"])),
        ("protected writes", str(f["protected_writes"])),
        ("protected writes refused (fenced)", str(f["writes_refused"])),
    ]
    for kind, n in f["faults"].items():
        rows.append((f"faults: {kind}", str(n)))
    rows.append(("faults: total", str(f["faults_total"])))
    if f["faults_failed"]:
        rows.append(("faults that failed to apply", json.dumps(f["faults_failed"])))
    rows += [
        ("worker exits restarted by the supervisor", str(f["supervisor_restarts"])),
        (
            f"stalled workers restarted (no task started for {liveness.STALL:.0f} s, "
            "queue held; stacks taken)",
            str(f["liveness_restarts"]),
        ),
        ("publish retries (harness)", str(f["publish_retries"])),
        ("deferrals (LEASE_DEFERRED)", str(f["deferrals"])),
        ("rejections (LEASE_REJECTED)", str(f["rejections"])),
        ("fenced commits (FENCED)", str(f["fenced_commits"])),
        ("leases lost while running (LEASE_LOST)", str(f["leases_lost"])),
    ]
    if "broker_messages_lost" in f:
        rows.append(("messages lost by the Redis transport (AOF)", str(f["broker_messages_lost"])))
        rows.append(
            (
                "messages stranded by the transport (AOF: unacked, restorable ~1 h later)",
                str(f["broker_messages_stranded"]),
            )
        )
        rows.append(("broker AOF commands read", str(f["broker_aof_commands"])))
        # Without the whole history the replay proves no loss, and a task the
        # transport lost counts as lost by the plugin: say which it was.
        rows.append(("broker AOF replay complete (proves transport losses)",
                     str(f["broker_aof_complete"])))  # fmt: skip
    if f.get("chords"):
        rows += [
            ("chords (3 leased members each)", str(f["chords"])),
            ("chords: callback got its header / failed as a member did / a member lost",
             f"{f['chords_succeeded']} / {f['chords_failed']} / {f['chords_member_lost']}"),
            ("chords: callback runs", str(f["chord_callback_runs"])),
            ("chords: callbacks published by another worker (last member died)",
             str(f["chords_recovered"])),
        ]  # fmt: skip
    rows += [
        ("lost tasks: plugin", str(f["lost_plugin"])),
        ("lost tasks: broker transport", str(f["lost_broker"])),
        ("settled (every task final, broker empty)", str(f["settled"])),
        (
            f"settle stalls (no task ended for {stacks.STALL:.0f} s, messages held; stacks taken)",
            str(f["settle_stalls"]),
        ),
        ("violations", str(f["violations"])),
    ]
    for kind, n in sorted(f["violations_by_kind"].items()):
        rows.append((f"violations: {kind}", str(n)))
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    sep = f"+-{'-' * width}-+-{'-' * vwidth}-+"
    lines = [sep] + [f"| {a.ljust(width)} | {b.rjust(vwidth)} |" for a, b in rows] + [sep]
    if report.violations:
        lines.append("violations:")
        lines += [f"  {v}" for v in report.violations[:50]]
        if len(report.violations) > 50:
            lines.append(f"  ... and {len(report.violations) - 50} more (report.json)")
    return "\n".join(lines)
