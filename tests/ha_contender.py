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


def parse(argv: list[str] | None) -> argparse.Namespace:
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
    return parser.parse_args(argv)


class Contender:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.keys = args.keys.split(",")
        self.store = LeaseStore.from_url(args.url, **json.loads(args.options))
        self.table = ResultTable(args.results, self.store)
        self.rng = random.Random(os.getpid() ^ time.monotonic_ns())
        self.generation = 0
        self.counts = {"attempts": 0, "refused": 0, "errors": 0, "late": 0}

    def log(self, record: dict[str, Any]) -> None:
        append(self.args.log, record)

    def claim(self, key: str, owner: str) -> tuple[Any, float] | None:
        """Claim and register: (lease, when the claim returned), or None if refused."""
        self.counts["attempts"] += 1
        try:
            lease = self.store.claim(key, owner_id=owner, ttl=self.args.ttl)
            granted = time.monotonic()
            if lease is not None:
                self.table.register(lease)
        except StoreUnavailable as e:
            self.counts["errors"] += 1
            self.log({"error": str(e)[:600], "op": "claim", "t": time.monotonic()})
            time.sleep(0.02)
            return None
        except StaleFencingToken:  # a newer owner registered first: not ours to use
            self.log({"late": True, "key": key, "token": lease.token, "t": time.monotonic()})
            return None
        if lease is None:
            self.counts["refused"] += 1
            time.sleep(self.rng.uniform(0.002, 0.02))
            return None
        return lease, granted

    def once(self) -> None:
        owner = f"contender-{self.args.index}:{os.getpid()}:{self.generation}"
        key = self.rng.choice(self.keys)
        sent = time.monotonic()
        claimed = self.claim(key, owner)
        if claimed is None:
            return
        lease, granted = claimed
        registered = time.monotonic()
        valid_until = sent + lease.ttl - MARGIN
        work = self.rng.uniform(0.01, 0.06)
        if registered + work >= valid_until:
            # Came back too late to be used (a claim held up by a failover).
            self.counts["late"] += 1
            self.log({"late": True, "key": key, "token": lease.token, "t": registered})
            return
        enter = time.monotonic()
        time.sleep(work)
        leave = time.monotonic()
        outcome, commit_started = "abandoned", leave
        if self.rng.random() < self.args.abandon:
            self.generation += 1  # as if this process died holding the lease
        else:
            outcome, commit_started = commit(self.table, lease, owner)
        self.log(
            {
                "key": key, "token": lease.token, "owner": owner, "sent": sent,
                "granted": granted, "registered": registered, "enter": enter, "leave": leave,
                "valid_until": valid_until, "commit_started": commit_started, "outcome": outcome,
            }
        )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    contender = Contender(args)
    contender.store.inspect(contender.keys[0])  # connect before the start line
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    if sys.stdin.readline().strip() != "go":
        return
    stop = time.monotonic() + args.duration
    while time.monotonic() < stop:
        contender.once()
        time.sleep(contender.rng.uniform(0.0, 0.005))
    contender.log({"summary": True, "index": args.index, **contender.counts})


if __name__ == "__main__":
    main()
