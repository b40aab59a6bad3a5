"""Leader failover under contention: the etcd store keeps one owner at a time.

Eight client processes (tests/etcd_contender.py) contend for four keys of a
private 3-member etcd cluster, each one working only inside its local view of
each grant and logging every grant -- key, token, and the CLOCK_MONOTONIC
times it entered and left its critical section -- to its own fsync'd log. In
the middle of the run the test finds the Raft leader (every live member agrees
on it, ``/v3/maintenance/status``) and SIGKILLs it. Then, from the logs alone
(an overlap detector independent of the store):

* no two grants of one key overlap in time (one owner at a time, across the
  leader change);
* no token is issued twice, and per key, tokens grow in the order the grants
  were used;
* claims resume once the remaining members elect a new leader, within a
  deadline; the figures (grants before/after, time to elect, time until the
  first grant after the kill, errors) are printed.
"""

from __future__ import annotations

import select
import subprocess
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.etcd_cluster import EtcdCluster, make_etcd_cluster  # noqa: F401 - fixture
from tests.grant_log import overlaps, read_logs
from tests.servers import wait_for
from tests.store_fixtures import PYTHON, client_env

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

CONTENDER = str(Path(__file__).resolve().parents[1] / "etcd_contender.py")
CLIENTS = 8
KEYS = 4
TTL = 2.0
#: seconds each client contends; the leader is killed once the baseline is in
DURATION = 9.0
#: claims must resume within this many seconds of the kill
RECOVERY_DEADLINE = 10.0


def test_leader_sigkill_while_eight_processes_contend(
    make_etcd_cluster: Callable[..., EtcdCluster],  # noqa: F811
    tmp_path: Path,
) -> None:
    cluster = make_etcd_cluster()
    keys = [f"failover-{i}-{uuid.uuid4().hex[:8]}" for i in range(KEYS)]
    logs = [tmp_path / f"contender-{i}.log" for i in range(CLIENTS)]
    procs = []
    for i, log in enumerate(logs):
        argv = [PYTHON, CONTENDER, cluster.url, str(log), "--keys", ",".join(keys)]
        argv += ["--ttl", str(TTL), "--duration", str(DURATION), "--index", str(i)]
        procs.append(
            subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=client_env(), text=True
            )
        )
    try:
        deadline = time.monotonic() + 30
        for p in procs:
            assert p.stdout is not None
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            assert ready and p.stdout.readline().strip() == "ready", "a contender did not start"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        started = time.monotonic()

        # Baseline: grants flow under the first leader.
        wait_for(
            lambda: sum("enter" in r for r in read_logs(logs)) >= 40,
            10,
            "40 grants before the kill",
        )
        leader = wait_for(cluster.leader, 10, "the leader")
        term = int(leader.status()["raftTerm"])  # type: ignore[index]
        leader.kill()
        killed = time.monotonic()
        new_leader = wait_for(
            lambda: (lambda m: m if m is not None and m is not leader else None)(cluster.leader()),
            RECOVERY_DEADLINE,
            "a new leader",
        )
        elected = time.monotonic()
        new_term = int(new_leader.status()["raftTerm"])  # type: ignore[index]
        assert new_term > term and not leader.running

        for p in procs:
            p.wait(DURATION + 30)
            assert p.returncode == 0, f"a contender failed ({p.returncode})"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    rows = read_logs(logs)
    grants = [r for r in rows if "enter" in r]
    late = [r for r in rows if r.get("late")]
    errors = [r for r in rows if "error" in r]
    summaries = [r for r in rows if r.get("summary")]
    assert len(summaries) == CLIENTS

    # 1. One owner at a time: no two grants of a key overlap, across the failover.
    bad = overlaps(grants)
    assert not bad, f"{len(bad)} overlapping grants, e.g. {bad[:3]}"
    for g in grants:
        assert g["leave"] <= g["valid_until"], f"worked past the local view of the lease: {g}"

    # 2. No token issued twice; per key, tokens grow in the order the grants were used.
    tokens = [g["token"] for g in grants] + [r["token"] for r in late]
    assert len(tokens) == len(set(tokens)), "a token was issued twice"
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for g in grants:
        by_key[g["key"]].append(g)
    for key, rows_of_key in by_key.items():
        ordered = [g["token"] for g in sorted(rows_of_key, key=lambda g: g["enter"])]
        assert ordered == sorted(ordered), f"tokens of {key} out of order"

    # 3. Claims resumed under the new leader.
    before = [g for g in grants if g["enter"] < killed]
    after = [g for g in grants if g["enter"] > killed]
    assert before and after, "no grants before or after the kill"
    first_after = min(g["enter"] for g in after)
    recovery = first_after - killed
    assert recovery < RECOVERY_DEADLINE
    after_election = [g for g in after if g["enter"] > elected]
    assert len(after_election) >= 20, "claims did not keep flowing under the new leader"
    handovers_by_expiry = sum(g["abandoned"] for g in grants)
    print(
        f"\netcd failover: {CLIENTS} clients x {KEYS} keys, TTL {TTL}s, run {DURATION}s\n"
        f"  killed leader {leader.name} (term {term}) at +{killed - started:.2f}s; "
        f"{new_leader.name} elected (term {new_term}) after {elected - killed:.3f}s\n"
        f"  grants: {len(before)} before the kill, {len(after)} after "
        f"({len(after_election)} after the election); first grant after the kill: "
        f"+{recovery:.3f}s\n"
        f"  abandoned leases (handed over by expiry): {handovers_by_expiry}; grants that came "
        f"back too late to use: {len(late)}; store errors seen by clients: {len(errors)}\n"
        f"  refused claims: {sum(s['refused'] for s in summaries)} of "
        f"{sum(s['attempts'] for s in summaries)} attempts; overlaps: 0; reused tokens: 0"
    )
