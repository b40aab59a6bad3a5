"""A lease contender that commits through the fenced result table, run as a process
by tests/contract/test_redis_ha_failover.py.

Run as a script: ``python tests/ha_contender.py URL LOG --results DB --keys k1,k2
--ttl T --duration D --index I [--options JSON]``. Imports only celery_lease.
Prints ``ready``, waits for ``go`` on stdin, then for D seconds does what a
LeasedTask does with leases in Redis and results in SQL: claim a random key,
register the token in the key's fence row, work inside its local view of the
lease (monotonic time of the claim's request + TTL - a margin), commit the
result through the fenced table (which checks the fence row and asks the lease
store, then releases), or, sometimes, abandon the lease to expire.

Every grant is appended to LOG, one JSON line written with ``O_APPEND`` and
fsync'd before the next claim: key, token, the ``CLOCK_MONOTONIC`` times its
claim was sent and returned, its registration returned, it entered and left the
critical section, its commit started, and how that ended (``accepted``,
``fenced``, ``error``).
Store errors are logged with their time. A summary line ends the log.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

from celery_lease import LeaseStore, StaleFencingToken, StoreUnavailable
from celery_lease.results import ResultTable

#: seconds kept off the local view of a lease (as HeldLease's clock-drift margin)
MARGIN = 0.1


def append(path: str, record: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(table: ResultTable, lease: Any, owner: str) -> tuple[str, float]:
    started = time.monotonic()
    try:
        value = {"owner": owner, "token": lease.token}
        table.commit(lease, value, task_id=f"{owner}:{lease.token}")
    except StaleFencingToken:
        return "fenced", started
    except StoreUnavailable:
        return "error", started
    return "accepted", started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ha_contender")
    parser.add_argument("url")
    parser.add_argument("log")
    parser.add_argument("--results", required=True)
    parser.add_argument("--keys", required=True)
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--abandon", type=float, default=0.05)
    parser.add_argument("--options", default="{}")
    args = parser.parse_args(argv)

    keys = args.keys.split(",")
    store = LeaseStore.from_url(args.url, **json.loads(args.options))
    table = ResultTable(args.results, store)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    generation = 0
    store.inspect(keys[0])  # connect before the start line
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    if sys.stdin.readline().strip() != "go":
        return
    stop = time.monotonic() + args.duration
    counts = {"attempts": 0, "refused": 0, "errors": 0, "late": 0}
    while time.monotonic() < stop:
        owner = f"contender-{args.index}:{os.getpid()}:{generation}"
        key = rng.choice(keys)
        counts["attempts"] += 1
        sent = time.monotonic()
        try:
            lease = store.claim(key, owner_id=owner, ttl=args.ttl)
            granted = time.monotonic()
            if lease is not None:
                table.register(lease)
        except StoreUnavailable as e:
            counts["errors"] += 1
            append(args.log, {"error": str(e)[:600], "op": "claim", "t": time.monotonic()})
            time.sleep(0.02)
            continue
        except StaleFencingToken:  # a newer owner registered first: not ours to use
            append(args.log, {"late": True, "key": key, "token": lease.token, "t": sent})
            continue
        if lease is None:
            counts["refused"] += 1
            time.sleep(rng.uniform(0.002, 0.02))
            continue
        registered = time.monotonic()
        valid_until = sent + lease.ttl - MARGIN
        work = rng.uniform(0.01, 0.06)
        if registered + work >= valid_until:
            # Came back too late to be used (a claim held up by a failover).
            counts["late"] += 1
            append(args.log, {"late": True, "key": key, "token": lease.token, "t": registered})
            continue
        enter = time.monotonic()
        time.sleep(work)
        leave = time.monotonic()
        outcome, commit_started = "abandoned", leave
        if rng.random() < args.abandon:
            generation += 1  # as if this process died holding the lease
        else:
            outcome, commit_started = commit(table, lease, owner)
        append(
            args.log,
            {
                "key": key,
                "token": lease.token,
                "owner": owner,
                "sent": sent,
                "granted": granted,
                "registered": registered,
                "enter": enter,
                "leave": leave,
                "valid_until": valid_until,
                "commit_started": commit_started,
                "outcome": outcome,
            },
        )
        time.sleep(rng.uniform(0.0, 0.005))
    append(args.log, {"summary": True, "index": args.index, **counts})


if __name__ == "__main__":
    main()
